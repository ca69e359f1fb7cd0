"""Bounded work: every size a job file or a request could otherwise set without limit, in one place.

These are the *defaults*. The job file's own bounds (YAML bytes and nesting, ``job.steps``, batch
shape) are fixed here; each service takes a flag to move its per-request bounds (named beside each
constant), so a deployment with bigger batches raises them where it runs them. Whatever enforces a
limit refuses with a message naming the field, the limit and the value — INVALID_ARGUMENT on the
wire (RESOURCE_EXHAUSTED for concurrency caps) — before any of the work is done.

The job-file bounds keep a valid job inside the default per-request bounds: a job's batch
(``grpo.num_prompts_per_step × grpo.num_generations_per_prompt`` rows, each up to
``max_new_tokens`` generated tokens) always fits one TrainStep, Calibrate, Score and Generate call
of a service running with the defaults.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
"""Largest value of a proto ``int32`` field (``n``, ``max_tokens``, ``limit``...)."""

INT64_MAX = 2**63 - 1
"""Largest value of a proto ``int64`` field (steps, versions, seeds)."""

# -- the job file (fp8rl.config) -------------------------------------------------------------------

MAX_JOB_YAML_BYTES = 64 * 1024
"""Bytes of one job YAML, checked before it is parsed (real job files are a few KiB; the worst 64 KiB parses in
well under a second)."""

MAX_YAML_DEPTH = 32
"""Nesting depth of mappings / lists in a job YAML (the schema itself is 5 deep)."""

MAX_CONFIG_INT = INT32_MAX
"""Magnitude bound of every integer in a job file without a tighter bound of its own."""

MAX_JOB_STEPS = 1_000_000
"""Most ``job.steps`` (and ``job.checkpoint_every`` / ``job.eval_every``) a job may ask for."""

MAX_JOB_SEED = 2**32 - 1
"""Largest ``job.seed``: per-call sampling seeds derived from it stay far inside int64."""

MAX_NEW_TOKENS = 32_768
"""Largest ``policy.generation.max_new_tokens``."""

# -- sampling (fp8rl.engines.SamplingParams) -------------------------------------------------------

MAX_TEMPERATURE = 100.0
"""Largest sampling temperature (finite, ``0 <= T <= MAX_TEMPERATURE``); beyond it sampling is uniform noise."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this (and above 0) are treated as 0, i.e. greedy: ``logits / T`` would overflow FP32."""

# -- per request, per service (each has a flag) ----------------------------------------------------

MAX_GENERATE_PROMPTS = 4096
"""Prompts in one Generate call (rollout ``--max-prompts``); also bounds ``grpo.num_prompts_per_step``."""

MAX_SAMPLES_PER_PROMPT = 1024
"""``n`` of one Generate call (rollout ``--max-n``); also bounds ``grpo.num_generations_per_prompt``."""

MAX_GENERATED_TOKENS = 1 << 24
"""Token budget of one Generate call, ``prompts × n × max_tokens`` (rollout ``--max-generated-tokens``)."""

MAX_BATCH_ROWS = 8192
"""Rows of one TrainStep / ComputeLogprobs (trainer ``--max-rows``) or Calibrate (calibrator ``--max-rows``)
call; a job's ``num_prompts_per_step × num_generations_per_prompt`` is bounded by it."""

MAX_SCORE_ITEMS = MAX_BATCH_ROWS
"""Items of one Score call (reward ``--max-items``)."""

MAX_TRAINER_RANKS = 1024
"""Data-parallel trainer ranks one job may ask for (``policy.training.dp_size``)."""

MAX_RESPONSE_CHARS = 1 << 18
"""Characters of one Score item's response or answer (reward ``--max-response-chars``)."""

MAX_WATCH_STREAMS = 4
"""Concurrent WatchJob streams of one controller (``--max-watch-streams``); more get RESOURCE_EXHAUSTED."""

RESERVED_WORKERS = 2
"""gRPC worker threads kept free of long calls (``build_server(reserved_workers=...)``), so health, Status
and refusals are always answered: at most ``workers - RESERVED_WORKERS`` other calls run at once."""

# -- data files (fp8rl.data.files) -----------------------------------------------------------------

MAX_DATA_BYTES = 256 * 1024 * 1024
"""Bytes of a job's ``data.path`` file (controller ``--max-data-bytes``)."""

MAX_DATA_ROWS = 1_000_000
"""Problems read from a job's ``data.path`` file (controller ``--max-data-rows``)."""

MAX_DATA_LINE_BYTES = 1024 * 1024
"""Bytes of one line of a JSON-lines data file."""
