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

MAX_REQUEST_ID_CHARS = 256
"""Characters of a Generate call's ``request_id`` (echoed on every response of the stream)."""

MAX_STOP_TOKEN_IDS = 256
"""Entries of a Generate call's ``sampling.stop_token_ids``."""

MAX_GEN_LOGPROB = 1e-6
"""Largest ``gen_logprob`` a TrainStep row may carry: a logprob is <= 0; FP32 log-softmax of the top token is 0
exactly, the margin only forgives an engine that rounds the other way."""

MIN_GEN_LOGPROB = -1e5
"""Smallest ``gen_logprob`` a TrainStep row may carry. A drawn token's sampling probability is at least FP32's
smallest positive value 2^-149, so its logprob under the sampling distribution is >= -103.3; an engine reporting
the raw model's logprob at temperature T <= 100 (:data:`MAX_TEMPERATURE`) stays above -103.3 T - ln V > -1.1e4
for any vocabulary V. Below this bound a value is not a logprob of a sampled token (e.g. -3e38)."""

MAX_BATCH_ROWS = 8192
"""Rows of one TrainStep / ComputeLogprobs (trainer ``--max-rows``) or Calibrate (calibrator ``--max-rows``)
call; a job's ``num_prompts_per_step × num_generations_per_prompt`` is bounded by it."""

MAX_SCORE_ITEMS = MAX_BATCH_ROWS
"""Items of one Score call (reward ``--max-items``)."""

MAX_TRAINER_RANKS = 1024
"""Data-parallel trainer ranks one job may ask for (``policy.training.dp_size``)."""

MAX_RESPONSE_CHARS = 1 << 18
"""Characters of one Score item's response or answer (reward ``--max-response-chars``)."""

MAX_WATCH_STREAMS = 32
"""Concurrent WatchJob streams of one controller (``--max-watch-streams``); more get RESOURCE_EXHAUSTED. A stream
waits on the server's I/O loop and holds no worker thread; each polls Redis twice a second."""

MAX_WATCH_STREAMS_PER_CLIENT = 4
"""Concurrent WatchJob streams of one client connection (``--max-watch-streams-per-client``; a process's channels
to one server share a connection): one client cannot hold every stream."""

# -- the controller's job store (fp8rl.controller.jobstore) ----------------------------------------

MAX_JOBS = 10_000
"""Jobs stored at once, any state (controller ``--max-jobs``); SubmitJob beyond is RESOURCE_EXHAUSTED."""

MAX_QUEUED_JOBS = 100
"""Pending jobs at once (controller ``--max-queued-jobs``); SubmitJob beyond is RESOURCE_EXHAUSTED."""

JOB_RETENTION_S = 7 * 24 * 3600.0
"""Seconds a finished (succeeded, failed, cancelled) job is kept, with its reports (``--job-retention-s``)."""

MAX_FINISHED_JOBS = 1000
"""Finished jobs kept at most; the oldest beyond are deleted (``--max-finished-jobs``)."""

MAX_LIST_JOBS = 1000
"""Jobs on one ListJobs page (``limit``); 0 asks for :data:`DEFAULT_LIST_JOBS`."""

DEFAULT_LIST_JOBS = 100
"""ListJobs' page size when the request gives no ``limit``."""

# -- what errors echo back ---------------------------------------------------------------------------

MAX_STATUS_DETAILS_CHARS = 4000
"""Characters of a status message the server sends (gRPC clients refuse trailers past their metadata limit,
8 KiB by default, and would see RESOURCE_EXHAUSTED instead of the real error)."""


RESERVED_WORKERS = 2
"""gRPC worker threads that serve only light calls (Status, GetJob, ListJobs; ``build_server(reserved_workers=...)``):
at most ``workers - RESERVED_WORKERS`` long calls run at once. Health needs no worker (it runs on the I/O loop)."""

# -- the wire, before a handler runs (fp8rl.rpc.guard / fp8rl.rpc.server) ---------------------------

MAX_BULK_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest request of the batch-carrying RPCs (:data:`BULK_REQUEST_METHODS`) and largest message any server sends
(weight-shard chunks, big rollout batches); every service's ``--max-message-bytes``. gRPC's default is 4 MiB."""

BULK_REQUEST_METHODS = frozenset({"TrainStep", "ComputeLogprobs", "Calibrate", "Score", "ScoreModel", "Generate"})
"""RPCs whose request carries a batch (token rows, texts): they take up to ``--max-message-bytes``."""

MAX_ENV_TASK_BYTES = 1 << 20
"""Largest JSON of an environment's task or kwargs (EnvService.Reset), and of a step's reply (messages + info)."""

MAX_ENV_IDS = 8192
"""Most trajectory ids / session keys in one EnvService.Close or RolloutService.ReleaseSessions call."""

MAX_ENV_ID_CHARS = 256
"""Longest trajectory id or session key."""

REQUEST_BYTES = {"SubmitJob": MAX_JOB_YAML_BYTES + 4096,
                 "Reset": 2 * MAX_ENV_TASK_BYTES + 4096,  # task and kwargs JSON
                 "Step": 4 * MAX_RESPONSE_CHARS + 4096,  # the model's turn, UTF-8
                 "Close": MAX_ENV_IDS * (MAX_ENV_ID_CHARS + 4), "ReleaseSessions": MAX_ENV_IDS * (MAX_ENV_ID_CHARS + 4)}
"""Request limits of the other RPCs that need more than :data:`MAX_REQUEST_BYTES` (a job YAML plus its id)."""

MAX_REQUEST_BYTES = 64 * 1024
"""Request limit of every other RPC (ids, names, a few numbers: Status, GetJob, ListJobs, WatchJob, CancelJob,
SaveCheckpoint, GetManifest, StreamShards, reflection). A server's gRPC receive limit is the largest of its
methods', so the controller refuses a 250 MiB message from its length prefix, before buffering it."""

FIRST_MESSAGE_TIMEOUT_S = 10.0
"""Seconds from a call's start to its request message; later is DEADLINE_EXCEEDED (a stalled call holds no
worker meanwhile, only its place among :data:`MAX_WAITING_CALLS`)."""

MAX_WAITING_CALLS = 64
"""Calls past the token check that may wait for their request message or a light worker at once, per server
(RESOURCE_EXHAUSTED beyond)."""

LIGHT_CALL_WAIT_S = 10.0
"""Seconds a light call (Status, GetJob, ListJobs) waits for one of the reserved workers before UNAVAILABLE."""

MAX_STREAMS_PER_CONNECTION = 64
"""Concurrent HTTP/2 streams (calls) of one client connection; more wait in the client (gRPC's own limit)."""

MAX_CONNECTIONS = 1024
"""Client connections one server accepts at once."""

HANDSHAKE_TIMEOUT_S = 10.0
"""Seconds a new connection has to finish its HTTP/2 (and TLS) handshake."""

MAX_METADATA_BYTES = 16 * 1024
"""Bytes of one call's metadata (headers): a bearer token and a few names."""

# -- data files (fp8rl.data.files) -----------------------------------------------------------------

MAX_DATA_BYTES = 256 * 1024 * 1024
"""Bytes of a job's ``data.path`` file (controller ``--max-data-bytes``)."""

MAX_DATA_ROWS = 1_000_000
"""Problems read from a job's ``data.path`` file (controller ``--max-data-rows``)."""

MAX_DATA_LINE_BYTES = 1024 * 1024
"""Bytes of one line of a JSON-lines data file."""
