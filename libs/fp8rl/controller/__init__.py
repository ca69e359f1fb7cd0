"""The controller's library: what a GRPO job does at every step, independent of how the services are reached.

* :mod:`.plan` — a job's batches, sampling seeds, advantages and summaries: pure functions of the job
  config and the step index, so a restarted controller draws exactly the batches it would have drawn.
* :mod:`.jobstore` — the job queue and records in Redis (the controller keeps nothing in memory).
* :mod:`.pool` — the rollout replicas of a job, found through their leases, sampled with every request
  pinned to one weight version.

Invariant: nothing here imports ``services`` or speaks a service's wire format beyond the generated
rollout stubs the pool calls; the gRPC adapters live in ``services/controller``.
"""
