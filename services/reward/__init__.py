"""The reward service: ``RewardService.Score`` over :mod:`fp8rl.data.scoring` (DESIGN §2, reward phase).

Run it with ``python -m services.reward --config JOB.yaml --port 50053``; the service is
:class:`services.reward.server.RewardService` on the common skeleton (:mod:`services.common.runtime`).
"""
