"""Controller: accepts GRPO jobs (JobService) and drives them one step at a time over gRPC (DESIGN §1-§3).

Invariant: it keeps nothing in memory that a restart would need: job records, versions and lineage are in
Redis, and the step itself is :func:`fp8rl.controller.step.run_step`'s, converted to and from protos here.
"""
