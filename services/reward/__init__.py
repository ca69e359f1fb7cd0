"""The reward service: ``RewardService.Score`` over :mod:`fp8rl.data.scoring` (DESIGN §2, reward phase).

Run it with ``python -m services.reward --config JOB.yaml --port 50053``; the service is
:class:`services.reward.server.RewardService` on the common skeleton (:mod:`services.common.runtime`).

Invariant: every item gets a status (GRADED / UNPARSABLE are verdicts, TIMEOUT / ERROR are not), and a grader
that hangs or crashes costs one worker process, never the service. Grading needs no Redis.
"""
