"""The reward service: ``RewardService.Score`` over :mod:`fp8rl.data.scoring` (DESIGN §2, reward phase).

Run it with ``python -m services.reward --port 50053 --ready-file /tmp/reward.json``; the
servicer is :class:`services.reward.server.RewardServicer`.
"""
