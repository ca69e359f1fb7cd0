"""The job schema: one frozen dataclass per YAML section, a docstring per setting (``doc`` of
:func:`~fp8rl.config.fields.setting`), validated on construction (:class:`~fp8rl.config.fields.Section`).

Keys follow NeMo RL's where it has them. ``python -m fp8rl.config`` prints every key with its default
and docstring (the text of ``docs/CONFIG.md``).
"""

from dataclasses import dataclass

from fp8rl import limits
from fp8rl.envs import env_names
from fp8rl.fp8.formats import DEFAULT_SCALING, SCALINGS, linear_format

from .fields import ConfigError, Section, section, setting

__all__ = [
    "AgentSection", "ArithSection", "AsyncGrpoConfig", "CalibrationConfig", "DataConfig", "EnvSection", "Fp8Cfg",
    "GenerationConfig",
    "GrpoConfig", "EvalSection", "ImportanceSamplingConfig", "JobSection", "LoraConfig", "LossSection", "MegatronCfg",
    "PolicyConfig", "RewardCombineConfig", "RewardConfig", "RewardModelConfig", "RewardShapingConfig",
    "RouterReplayConfig", "TrainingConfig", "VllmCfg", "MAX_PATH_CHARS",
]

MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


@dataclass(frozen=True)
class JobSection(Section):
    KEY = "job"
    name: str = setting("grpo", "Job name; job ids and the Redis namespace derive from it.")
    steps: int = setting(30, "GRPO steps to run.", gt=0, le=limits.MAX_JOB_STEPS)
    seed: int = setting(0, "Seeds data order, sampling and initialisation.", ge=0, le=limits.MAX_JOB_SEED)
    checkpoint_every: int = setting(10, "Save a trainer checkpoint every N steps and at the end (0: never).",
                                    ge=0, le=limits.MAX_JOB_STEPS)
    eval_every: int = setting(0, "Validation (greedy accuracy and the eval section's pass@k) every N steps and at "
                              "the end (0: none during the job; the in-process loop validates at the start and "
                              "the end anyway).",
                              ge=0, le=limits.MAX_JOB_STEPS)
    eval_size: int = setting(128, "Validation problems per evaluation.", gt=0, le=limits.MAX_GENERATE_PROMPTS)


@dataclass(frozen=True)
class VllmCfg(Section):
    KEY = "policy.generation.vllm_cfg"
    precision: str = setting("fp8", "Rollout linears: fp8 (block-scaled E4M3) or bf16.", choices=("bf16", "fp8"))
    kv_cache_dtype: str = setting("fp8", "Rollout KV cache: fp8 (per-tensor Q/K/V scales, recalibrated every "
                                  "step) or auto (the model dtype).", choices=("auto", "fp8"))
    fp8_attention: bool = setting(True, "With an FP8 KV cache, also run attention on FP8 Q/K/V.")
    num_first_layers_in_bf16: int = setting(0, "First decoder layers kept in BF16 (both engines).", ge=0)
    num_last_layers_in_bf16: int = setting(0, "Last decoder layers kept in BF16 (both engines).", ge=0)
    pow2_weight_scaling_factors: bool = setting(False, "Round FP8 weight block scales up to powers of two.")
    pow2_activation_scaling_factors: bool = setting(False, "Round FP8 activation scales up to powers of two.")
    fp8_vision_encoder: bool = setting(False, "A vision-language policy: its vision encoder's linears in FP8 too "
                                       "(both engines, the linears' format); off, the encoder stays in high "
                                       "precision in every recipe.")
    gpu_memory_utilization: float = setting(0.6, "vLLM: share of GPU memory for weights and KV cache.",
                                            gt=0.0, le=1.0)


@dataclass(frozen=True)
class GenerationConfig(Section):
    KEY = "policy.generation"
    backend: str = setting("torch", "Rollout engine: torch (embedded, exact FP8 numerics) or vllm.",
                           choices=("torch", "vllm"))
    temperature: float = setting(1.0, f"Sampling temperature, also the trainer's; below "
                                 f"{limits.GREEDY_TEMPERATURE} it is greedy (stored as 0).",
                                 ge=0.0, le=limits.MAX_TEMPERATURE)
    top_p: float = setting(1.0, "Nucleus sampling mass, in (0, 1].", gt=0.0, le=1.0)
    max_new_tokens: int = setting(8, "Most generated tokens per sample.", gt=0, le=limits.MAX_NEW_TOKENS)
    vllm_cfg: VllmCfg = section(VllmCfg, "Rollout precision (NeMo RL's vllm_cfg; used by every rollout engine).")

    def check(self) -> None:
        if 0 < self.temperature < limits.GREEDY_TEMPERATURE:  # logits / T would overflow: greedy, as engines do
            object.__setattr__(self, "temperature", 0.0)


# the registered formats (fp8rl.fp8.formats), each with its summary, and the ones vLLM loads
_FP8_RECIPE_HELP = (
    "FP8 scaling of every FP8 linear, rollout and trainer alike (one key for both engines: they quantize the same "
    "master weights the same way): " + "; ".join(f"{n} ({linear_format(n).summary})" for n in SCALINGS)
    + f". vLLM runs {' and '.join(n for n in SCALINGS if linear_format(n).refusal('vllm') is None)} only.")


@dataclass(frozen=True)
class Fp8Cfg(Section):
    KEY = "policy.training.megatron_cfg.fp8_cfg"
    enabled: bool = setting(True, "FP8 training linears (with precision fp8: the fp8_e2e recipe).")
    fp8: str = setting("e4m3", "FP8 format of weights, activations and gradients.", choices=("e4m3",))
    fp8_recipe: str = setting(DEFAULT_SCALING, _FP8_RECIPE_HELP, choices=SCALINGS)


@dataclass(frozen=True)
class MegatronCfg(Section):
    KEY = "policy.training.megatron_cfg"
    tensor_model_parallel_size: int = setting(1, "Megatron tensor-parallel size (backend megatron): ranks per "
                                              "data-parallel replica; the trainer runs as dp_size x this many. FP8 "
                                              "recipes need each rank's weight slices to be whole 128x128 blocks.",
                                              ge=1)
    pipeline_model_parallel_size: int = setting(1, "Megatron pipeline-parallel size (backend megatron): stages per "
                                                "data-parallel replica, each holding an equal share of the layers "
                                                "(it must divide the model's layers); every pass runs Megatron's "
                                                "1F1B schedule. The trainer runs as dp_size x tensor x pipeline "
                                                "ranks.", ge=1)
    expert_model_parallel_size: int = setting(1, "Megatron expert-parallel size (backend megatron, a mixture-of-"
                                              "experts model): each MoE layer's experts spread over this many "
                                              "data-parallel ranks, tokens sent to them by the dispatcher. It runs "
                                              "inside the data-parallel group (no extra ranks): it must divide "
                                              "dp_size and the model's experts.", ge=1)
    moe_token_dispatcher_type: str = setting("allgather", "Megatron's MoE token dispatcher (backend megatron): "
                                             "allgather (every rank gathers every token, keeps its experts') or "
                                             "alltoall (each token sent to the ranks of its experts only).",
                                             choices=("allgather", "alltoall"))
    fp8_cfg: Fp8Cfg = section(Fp8Cfg, "Trainer FP8 settings (read by both trainer backends).")


@dataclass(frozen=True)
class TrainingConfig(Section):
    KEY = "policy.training"
    backend: str = setting("torch", "Trainer backend: torch or megatron (Megatron-Core).",
                           choices=("torch", "megatron"))
    lr: float = setting(2e-4, "AdamW learning rate.", gt=0.0)
    weight_decay: float = setting(0.0, "AdamW weight decay.", ge=0.0)
    grad_clip: float = setting(1.0, "Global gradient-norm clip (0: none).", ge=0.0)
    micro_batch_size: int = setting(64, "Rows per forward/backward micro-batch.", gt=0)
    num_minibatches: int = setting(1, "Optimizer updates per step (the step's batch split PPO-style).", gt=0)
    activation_checkpointing: bool | None = setting(None, "Recompute each transformer layer's activations in the "
                                                    "backward instead of keeping them (torch backend, dense models): "
                                                    "a micro-batch keeps one hidden-size vector per token and layer "
                                                    "instead of several hidden + intermediate ones, for one more "
                                                    "forward of the layers per backward; gradients bitwise "
                                                    "unchanged. Unset (auto): on for a micro-batch whose saved "
                                                    "activations would pass a quarter of the trainer's floor (16 "
                                                    "bytes per parameter) and 1 GiB, decided from its shape "
                                                    "(fp8rl.engines.footprint); off for mixture-of-experts models, "
                                                    "trainer groups (dp_size > 1) and the megatron backend.",
                                                    kind=bool, optional=True)
    train_vision_encoder: bool = setting(False, "A vision-language policy: train its vision encoder too (torch "
                                         "backend; in high precision, never FP8). Off: the encoder is frozen and "
                                         "each prompt's pictures are encoded once per step.", kind=bool)
    share_prefix: bool = setting(True, "Run the leading tokens a micro-batch's rows share (a GRPO group's prompt, "
                                 "the system prompt and tools block every trajectory opens with) once instead of "
                                 "once per row (torch backend, dense non-MLA models, one rank): logprobs bitwise "
                                 "unchanged under batch invariance, gradients up to rounding (FP8: E4M3 rounding of "
                                 "other tensors); used from 16 shared tokens.", kind=bool)
    dp_size: int = setting(1, "Data-parallel trainer ranks under torchrun (torch backend: FSDP2, sharded "
                           "weights and AdamW state; megatron backend: Megatron-Core DDP, replicated state); the "
                           "launcher, compose and the Helm chart start this many).", ge=1, le=limits.MAX_TRAINER_RANKS)
    megatron_cfg: MegatronCfg = section(MegatronCfg, "Parallelism and FP8 (NeMo RL's megatron_cfg).")


@dataclass(frozen=True)
class NumericsConfig(Section):
    KEY = "policy.numerics"
    batch_invariant: bool | None = setting(None, "Batch-invariant numerics in both embedded engines (every GEMM "
                                           "over whole row tiles, split-KV attention over fixed key chunks, "
                                           "row-aligned KV cache): the rollout's logprobs are bitwise the "
                                           "trainer's (mismatch/max_abs_logprob_diff exactly 0), in every recipe, with "
                                           "an FP8 KV cache too (the trainer then quantizes Q/K/V with the "
                                           "rollout's scales). Unset (the default): on when both engines are the "
                                           "embedded torch ones, off with vLLM or Megatron (they choose kernels "
                                           "by shape and have no batch-invariant mode on CPU); true with them is "
                                           "refused.", kind=bool, optional=True)
    auto_bf16_layers: bool = setting(False, "In-process loop only: before step 0, the mismatch observatory "
                                     "(fp8rl.observatory) samples the first batch's prompts and sets "
                                     "vllm_cfg.num_first_layers_in_bf16 / num_last_layers_in_bf16 of both engines to "
                                     "the fewest bf16 layers whose re-measured token_mult_prob_error is within "
                                     "auto_bf16_target (else the best within auto_bf16_max_layers). Refused by the "
                                     "services stack; needs policy.training.backend: torch.")
    auto_bf16_target: float = setting(1.03, "auto_bf16_layers: the token_mult_prob_error to reach (DESIGN §4: "
                                      "1.03-1.05 is the usual acceptable bound).", ge=1.0)
    auto_bf16_max_layers: int = setting(4, "auto_bf16_layers: the budget, most first + last layers tried (one "
                                        "rollout and recompute each).", ge=0)


@dataclass(frozen=True)
class RouterReplayConfig(Section):
    KEY = "policy.router_replay"
    enabled: bool = setting(False, "Mixture-of-experts models: rollout routing replay (R3). The rollout records the "
                            "experts every token used in every layer and ships them with the sample; the trainer's "
                            "logprob and training passes use those experts (gates from its own router scores, so "
                            "the router still learns). Batch-invariant numerics need no replay (routing already "
                            "agrees bitwise); replay is for engines that are not (vLLM, or invariance off). The "
                            "torch rollout engine only.")
    measure_unreplayed: bool = setting(False, "With replay: the trainer's logprob pass also runs once without it "
                                       "and reports that mismatch (moe/unreplayed/*: what replay removed); one extra "
                                       "no-grad forward per step, so off unless asked.")


@dataclass(frozen=True)
class LoraConfig(Section):
    KEY = "policy.lora"
    enabled: bool = setting(False, "Train LoRA adapters on a frozen base instead of every weight. The base stays in "
                            "the recipe's form in every engine (FP8 linears: E4M3 + scales); each targeted "
                            "projection computes y = W(x) + (dropout(x) @ A^T) @ B^T * alpha / rank, the same way in "
                            "the rollout, the trainer and the calibrator (bitwise under policy.numerics."
                            "batch_invariant). Refit ships the base once, then only the adapters. The torch "
                            "trainer and the torch rollout engine only.")
    rank: int = setting(16, "The adapters' rank r (PEFT's r).", gt=0, le=4096)
    alpha: float = setting(32.0, "The update is scaled by alpha / rank (PEFT's lora_alpha).", gt=0)
    dropout: float = setting(0.0, "Dropout on the adapters' input in training passes (PEFT's lora_dropout); "
                             "logprob passes never drop.", ge=0, le=0.99)
    target_modules: tuple = setting(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                     "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"),
                                    "Projections that get adapters, by module name (PEFT's target_modules); the "
                                    "default is every attention and MLP projection the model has (multi-head latent "
                                    "attention's too), a mixture-of-experts model's experts and shared experts "
                                    "included (its router never). Names given otherwise must each match a "
                                    "projection.")
    dtype: str = setting("bfloat16", "The precision the adapters are computed and shipped in: the trainer keeps FP32 "
                         "masters (AdamW updates them) and every engine computes with their rounding to this dtype, "
                         "which is what a refit carries (bfloat16 halves the adapters' refit bytes).",
                         choices=("bfloat16", "float32"))
    share_experts: bool = setting(False, "A mixture-of-experts layer's experts share one adapter per targeted "
                                  "projection (the same low-rank update on every expert, trained on every token the "
                                  "layer routes; a refit ships one adapter per projection, not one per expert) "
                                  "instead of an adapter each.")


@dataclass(frozen=True)
class PolicyConfig(Section):
    KEY = "policy"
    model: str = setting("tiny-arith", "A preset name (tiny-arith, smollm2-135m-instruct) or a local HF checkpoint "
                        "directory.")
    language_model_only: bool = setting(False, "Of a vision-language checkpoint (Qwen2-VL, Qwen2.5-VL, Qwen3-VL "
                                        "*ForConditionalGeneration), train the language model alone on text "
                                        "prompts: its text tower loads as the plain model of its family, the "
                                        "vision encoder is left out of every engine and written back unchanged "
                                        "by an export. The embedded rollout only.")
    generation: GenerationConfig = section(GenerationConfig, "The rollout engine.")
    training: TrainingConfig = section(TrainingConfig, "The trainer.")
    numerics: NumericsConfig = section(NumericsConfig, "How the engines compute (batch invariance, automatic bf16 "
                                       "layers).")
    router_replay: RouterReplayConfig = section(RouterReplayConfig, "Mixture-of-experts routing replay (NeMo RL's "
                                                "key).")
    lora: LoraConfig = section(LoraConfig, "LoRA adapters on a frozen base (NeMo RL's key).")


@dataclass(frozen=True)
class ImportanceSamplingConfig(Section):
    KEY = "loss.importance_sampling"
    mode: str = setting("token", "Correction of the rollout/trainer mismatch: none, token (per-token ratio), "
                        "tis (truncated), icepop (masked outside [icepop_lo, icepop_hi]), seq_mask_tis.",
                        choices=("none", "token", "tis", "icepop", "seq_mask_tis"))
    tis_cap: float = setting(2.0, "tis: upper truncation of the ratio.")
    tis_min: float = setting(0.0, "tis: lower truncation of the ratio.")
    icepop_lo: float = setting(0.5, "icepop: tokens with a ratio below this are masked.")
    icepop_hi: float = setting(5.0, "icepop: tokens with a ratio above this are masked.")
    seq_mask_lo: float = setting(0.999, "seq_mask_tis: sequences whose geometric-mean ratio is below this are "
                                 "masked.")
    seq_mask_hi: float = setting(1.002, "seq_mask_tis: sequences whose geometric-mean ratio is above this are "
                                 "masked.")


@dataclass(frozen=True)
class LossSection(Section):
    KEY, VIEW = "loss", "loss_config"  # fp8rl.rl.LossConfig checks the combination
    clip_eps_low: float = setting(0.2, "PPO clip, below 1.")
    clip_eps_high: float = setting(0.2, "PPO clip, above 1 (clip-higher when larger than clip_eps_low).")
    dual_clip_c: float | None = setting(None, "Dual-clip bound for negative advantages (null: off).", kind=float,
                                        optional=True)
    kl_coef: float = setting(0.0, "k3 KL coefficient to the initial policy (0: no reference model).", ge=0.0)
    loss_agg_mode: str = setting("token-mean", "How token losses make the step's loss (verl's names): token-mean "
                                 "(every generated token of the batch weighs the same; DAPO), seq-mean-token-mean "
                                 "(each sequence's token mean, averaged over sequences; GRPO as published) or "
                                 "seq-mean-token-sum-norm (each sequence's token sum over loss_agg_norm_tokens, "
                                 "averaged over sequences; Dr. GRPO).",
                                 choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    loss_agg_norm_tokens: int | None = setting(None, "seq-mean-token-sum-norm: the constant each sequence's token "
                                               "sum is divided by (Dr. GRPO: the generation budget). Unset: "
                                               "policy.generation.max_new_tokens.", kind=int, optional=True, gt=0)
    router_aux_loss_coef: float = setting(0.0, "Mixture-of-experts models: weight of the load-balancing loss "
                                          "(transformers' load_balancing_loss_func) added to the policy loss; 0 "
                                          "reports it (moe/aux_loss) without training on it. A checkpoint's own "
                                          "router_aux_loss_coef (pretraining's) is not used.", ge=0.0)
    importance_sampling: ImportanceSamplingConfig = section(ImportanceSamplingConfig, "Off-policy correction.")


@dataclass(frozen=True)
class AsyncGrpoConfig(Section):
    KEY = "grpo.async_grpo"
    enabled: bool = setting(False, "Overlap generation with training: rollouts of steps s+1 ... s+k are generated "
                            "while step s trains (fp8rl.controller.pipeline).")
    max_weight_lag: int = setting(1, "k: a trained sample may come from a version at most this many versions older "
                                  "than the trainer's (NeMo RL: max_trajectory_age_steps). 0 is the synchronous "
                                  "order exactly.", ge=0, le=16)


@dataclass(frozen=True)
class RewardShapingConfig(Section):
    KEY = "grpo.reward_shaping"
    enabled: bool = setting(False, "DAPO's soft overlong penalty: a response longer than max_new_tokens - "
                            "overlong_buffer_length tokens loses overlong_buffer_penalty x (excess / "
                            "overlong_buffer_length) of reward (the whole penalty at max_new_tokens).")
    overlong_buffer_length: int = setting(4, "Tokens before policy.generation.max_new_tokens where the penalty "
                                          "ramps up (must be below max_new_tokens).", gt=0)
    overlong_buffer_penalty: float = setting(1.0, "The penalty at max_new_tokens.", ge=0.0)


@dataclass(frozen=True)
class EvalSection(Section):
    KEY = "eval"
    k: int = setting(4, "Validation samples per problem at eval.temperature, besides the greedy answer: pass@j "
                     "(the unbiased estimator, for j = 1, 2, 4, ... up to k) and mean@k. 0: greedy accuracy only.",
                     ge=0, le=limits.MAX_SAMPLES_PER_PROMPT)
    temperature: float = setting(1.0, "Sampling temperature of the k validation samples.", gt=0.0,
                                 le=limits.MAX_TEMPERATURE)


@dataclass(frozen=True)
class GrpoConfig(Section):
    KEY = "grpo"
    num_prompts_per_step: int = setting(16, "Distinct prompts per step.", gt=0, le=limits.MAX_GENERATE_PROMPTS)
    num_generations_per_prompt: int = setting(8, "Samples per prompt (the group size G), at least 2.",
                                              le=limits.MAX_SAMPLES_PER_PROMPT)
    leave_one_out: bool = setting(True, "Baseline of a sample: the mean of the other G-1 (else of all G).")
    normalize_rewards: bool = setting(True, "Divide each advantage by its group's reward std (GRPO); false keeps "
                                      "the plain difference to the baseline (Dr. GRPO; verl's "
                                      "norm_adv_by_std_in_grpo).")
    use_dynamic_sampling: bool = setting(False, "DAPO's dynamic sampling: groups whose rewards (after "
                                         "reward_shaping's penalty, the ones advantages come from) are all equal "
                                         "(no learning signal) are dropped and more prompts drawn (a seeded draw "
                                         "outside the step's own batch) and sampled until "
                                         "num_prompts_per_step groups remain or dynamic_sampling_max_gen_batches "
                                         "rounds ran (then the step trains on the groups it has); the rounds and "
                                         "counts are reported (dynamic_sampling/*).")
    dynamic_sampling_max_gen_batches: int = setting(4, "Dynamic sampling: most generation rounds per step (the "
                                                    "first included).", gt=0, le=64)
    overlong_filtering: bool = setting(False, "DAPO's overlong filtering: truncated responses (max_new_tokens "
                                       "reached without a stop token) are left out of the loss (their rewards "
                                       "still count in their group's baseline).")
    reward_shaping: RewardShapingConfig = section(RewardShapingConfig, "DAPO's overlong reward shaping.")
    async_grpo: AsyncGrpoConfig = section(AsyncGrpoConfig, "Asynchronous GRPO with bounded staleness.")

    def check(self) -> None:
        if self.num_generations_per_prompt < 2:
            raise ConfigError(f"{self.key('num_generations_per_prompt')}: must be >= 2 (GRPO compares samples of "
                              f"one prompt)")


@dataclass(frozen=True)
class ArithSection(Section):
    KEY, VIEW = "data.arith", "arith_config"  # fp8rl.data.ArithConfig checks the ranges
    max_operand: int = setting(20, "Largest operand drawn.")
    num_terms: int = setting(2, "Operands per problem (2-4).")
    ops: tuple = setting(("+", "-"), "Operations drawn from (a subset of +, -, *).")
    word_problems: bool = setting(False, "Templated sentences instead of bare 12+7=.")


GENERATED_TASKS = ("arith", "env", "shapes")  # data.task values that generate their problems (no data file)


@dataclass(frozen=True)
class DataConfig(Section):
    KEY = "data"
    task: str = setting("arith", "arith (generated problems), dataset (a local data file of prompt/answer rows: JSON "
                        "lines .jsonl/.json, .parquet, or an Arrow dataset directory written by datasets' "
                        "save_to_disk or an .arrow file; the format is told by the name) or jsonl (a JSON-lines file "
                        "whatever its name, in file order unless shuffle) or env (the tasks env.name's "
                        "environment generates, seeded by job.seed) or shapes (count the squares in a generated "
                        "picture: a vision-language policy's task, fp8rl.data.shapes).",
                        choices=("arith", "jsonl", "dataset", "env", "shapes"))
    path: str | None = setting(None, "jsonl, dataset: the training data, under the data root (relative paths are "
                               "relative to it): --data-root of the controller or the in-process loop, by default "
                               "the directory of the job file it was started with.", kind=str, optional=True)
    validation_path: str | None = setting(None, "jsonl, dataset: held-out data (any format dataset reads) the "
                                          "validation problems come from, its first job.eval_size rows; unset: the "
                                          "first rows of path.", kind=str, optional=True)
    prompt_key: str | None = setting(None, "jsonl, dataset: dotted path of the prompt in a row (prompt, "
                                     "extra_info.question, ...): text, or a list of {role, content} chat messages "
                                     "(rendered by the tokenizer's chat template, generation prompt added). Unset: "
                                     "the known row shapes, {prompt, answer}, {problem, expected_answer}, verl's "
                                     "{prompt, reward_model.ground_truth} and GSM8K's {question, answer}.", kind=str,
                                     optional=True)
    answer_key: str | None = setting(None, "jsonl, dataset: dotted path of the reference answer in a row "
                                     "(reward_model.ground_truth, extra_info.answer, ...), a string or a number; a "
                                     "GSM8K solution ending in '#### 72' is graded on 72. Unset: the known row "
                                     "shapes.", kind=str, optional=True)
    max_prompt_tokens: int | None = setting(None, "jsonl, dataset: prompts longer than this many tokens (as the "
                                            "policy sees them, chat template included) are dropped from the training "
                                            "and validation problems; the counts are logged and reported. Unset: "
                                            "none dropped.", kind=int, optional=True, gt=0)
    shuffle: bool | None = setting(None, "jsonl, dataset: visit the training rows in a new seeded permutation every "
                                   "epoch (a pure function of job.seed and the epoch: a restarted controller draws "
                                   "the same batches); false: file order, epoch after epoch. Unset: true for "
                                   "dataset, false for jsonl.", kind=bool, optional=True)
    chat_template: bool = setting(False, "Render each text prompt as a user message with the tokenizer's own chat "
                                  "template (generation prompt added) before tokenizing; the tokenizer must have one. "
                                  "Chat-message prompts are rendered with it whatever this says.")
    system_prompt: str | None = setting(None, "With chat_template: a system message put before each prompt that has "
                                        "none of its own (None: the template's default).", kind=str, optional=True)
    arith: ArithSection = section(ArithSection, "The arithmetic task's difficulty.")

    def __post_init__(self) -> None:
        for name in ("path", "validation_path"):  # checked first: a clearer message than the generic "expected str"
            p = getattr(self, name)
            if p is not None and not (isinstance(p, str) and 0 < len(p) <= MAX_PATH_CHARS and "\0" not in p):
                from .fields import short

                raise ConfigError(f"data.{name}: expected a file path of 1-{MAX_PATH_CHARS} characters, got "
                                  f"{short(p)}")
        super().__post_init__()

    def check(self) -> None:
        from fp8rl.data.keys import KeyPathError, parse_key

        if self.task not in GENERATED_TASKS and not self.path:
            raise ConfigError(f"data.path: required when data.task is {self.task!r}")
        if self.task in GENERATED_TASKS:
            for name in ("validation_path", "prompt_key", "answer_key", "max_prompt_tokens", "shuffle") + \
                    (("path",) if self.task != "arith" else ()):
                if getattr(self, name) is not None:
                    raise ConfigError(f"data.{name}: only used with data.task jsonl or dataset ({self.task} generates "
                                      f"its problems)")
        for name in ("prompt_key", "answer_key"):
            if getattr(self, name) is not None:
                try:
                    parse_key(getattr(self, name))
                except KeyPathError as e:
                    raise ConfigError(f"data.{name}: {e}") from None
        if self.system_prompt is not None and not self.chat_template:
            raise ConfigError("data.system_prompt: only used with data.chat_template: true")

    @property
    def shuffled(self) -> bool:
        """Whether the training rows are visited in a seeded permutation per epoch (``shuffle``, resolved)."""
        return self.shuffle if self.shuffle is not None else self.task == "dataset"


@dataclass(frozen=True)
class EnvSection(Section):
    KEY = "env"
    name: str | None = setting(None, "Multi-turn, tool-using trajectories (fp8rl.envs): a registered environment "
                               f"({', '.join(env_names())}; python runs the model's code in a bubblewrap sandbox) "
                               "or a user one as an import path package.module:Class. "
                               "Unset: single-turn samples (one prompt, one answer). Each task is a problem of "
                               "data (question and answer); data.task env draws the environment's own generated "
                               "tasks.", kind=str, optional=True)
    kwargs: dict | None = setting(None, "Constructor arguments of the environment, a mapping (e.g. tools_enabled: "
                                  "false, the calculator's control).", kind=dict, optional=True)
    max_turns: int = setting(8, "Model turns per trajectory; a trajectory still going after them ends with reward "
                             "0 (end reason max_turns).", gt=0, le=1024)
    max_tokens_per_turn: int = setting(64, "Tokens the model may write in one turn (policy.generation."
                                       "max_new_tokens is not used with an environment).", gt=0,
                                       le=limits.MAX_NEW_TOKENS)
    max_trajectory_tokens: int = setting(1024, "Tokens after the opening prompt (the model's and the "
                                         "environment's); a trajectory that cannot fit one more whole turn ends "
                                         "with reward 0 (end reason budget).", gt=0, le=1 << 20)
    step_timeout_s: float = setting(10.0, "Seconds one environment step may take; a step that takes longer (or "
                                    "raises) ends its trajectory ungraded: left out of the loss and of its group's "
                                    "advantages, and counted (env/ungraded), never a silent 0.", gt=0.0)
    partial: str = setting("finish", "Asynchronous GRPO: finish (a refit waits until the trajectories in flight "
                           "end, so every trajectory is sampled by one version) or interrupt (a refit waits only "
                           "for the turn in flight; the trajectories continue on the new weights, every token "
                           "keeping the version and behaviour logprob it was sampled with, the old version's K/V "
                           "recomputed under the new weights; a row's version for the lag bound is its oldest "
                           "token's). The in-process loop and the service stack run both.",
                           choices=("finish", "interrupt"))

    def check(self) -> None:
        if self.name is None and self.kwargs:
            raise ConfigError("env.kwargs: only used with env.name")
        if self.max_trajectory_tokens < self.max_tokens_per_turn:
            raise ConfigError(f"env.max_trajectory_tokens ({self.max_trajectory_tokens}) must be >= "
                              f"env.max_tokens_per_turn ({self.max_tokens_per_turn})")

    def spec(self):
        """The :class:`fp8rl.envs.EnvSpec` of this section (None when no environment is set)."""
        if self.name is None:
            return None
        from fp8rl.envs import EnvSpec

        return EnvSpec(self.name, dict(self.kwargs or {}), self.max_turns, self.max_tokens_per_turn,
                       self.max_trajectory_tokens, self.step_timeout_s)


@dataclass(frozen=True)
class AgentSection(Section):
    KEY = "agent"
    entrypoint: str | None = setting(
        None, "Bring your own agent (fp8rl.agents): an import path package.module:function called as "
        "function(task, client) for every trajectory, task a dict (question, answer) of data's problems and client "
        "an openai.OpenAI pointed at the policy's OpenAI-compatible endpoint (one session per trajectory: every call "
        "it makes is a turn, the model's tokens trained, everything else masked). It returns the reward (a number), "
        "or a text that reward.grader grades against the task's answer. On the service stack it runs in the reward "
        "service's code sandbox (its module one of the service's --env-module). Unset: no agent.", kind=str,
        optional=True)
    concurrency: int = setting(16, "Agents run at once (threads of the in-process loop; on the stack at most the "
                               "reward service's --agent-slots); their calls are batched by the endpoint.",
                               gt=0, le=1024)
    timeout_s: float = setting(300.0, "Seconds one agent may take; past it its trajectory ends ungraded "
                               "(env_timeout).", gt=0.0)
    max_tokens_per_call: int = setting(256, "max_tokens of an agent's call that sets none (and the most any call may "
                                       "ask for).", gt=0, le=limits.MAX_NEW_TOKENS)
    max_trajectory_tokens: int = setting(4096, "Tokens one agent's trajectory may hold; a call past it is refused "
                                         "and the agent sees the error.", gt=0, le=1 << 20)

    def check(self) -> None:
        if self.entrypoint is None:
            return
        module, _, attr = self.entrypoint.partition(":")
        if not (module and attr and all(part.isidentifier() for part in (*module.split("."), attr))):
            raise ConfigError(f"agent.entrypoint: {self.entrypoint!r} is not an import path package.module:function")
        if self.max_trajectory_tokens < self.max_tokens_per_call:
            raise ConfigError(f"agent.max_trajectory_tokens ({self.max_trajectory_tokens}) must be >= "
                              f"agent.max_tokens_per_call ({self.max_tokens_per_call})")


DEFAULT_JUDGE_TEMPLATE = (
    "You are grading a response to a question.\n\nQuestion:\n{question}\n\nReference answer:\n{answer}\n\n"
    "Response:\n{response}\n\nIs the response correct? Think briefly, then end with \\boxed{{1}} if it is "
    "correct and \\boxed{{0}} if it is not.")


@dataclass(frozen=True)
class RewardModelConfig(Section):
    KEY = "reward.model"
    kind: str | None = setting(None, "A reward model beside the rule grader: judge (an LLM-as-judge, GenRM: a causal "
                               "LM reads the question, the response and the reference answer through template and "
                               "its text or verdict probability becomes a score) or classifier (a transformers "
                               "*ForSequenceClassification checkpoint: its score head over the last token). None: "
                               "the rule grader alone.", kind=str, optional=True, choices=("judge", "classifier"))
    model: str | None = setting(None, "The reward model: a preset name or a local HF checkpoint directory (its "
                                "weights fixed for the job).", kind=str, optional=True)
    precision: str = setting("fp8", "Its linears: fp8 (block-scaled E4M3, the policy's fp8_recipe scaling) or bf16.",
                             choices=("bf16", "fp8"))
    backend: str = setting("torch", "judge: the engine it generates on, torch (embedded, exact FP8 numerics) or vllm "
                           "(vLLM on the checkpoint directory; its FP8 needs what the vLLM rollout needs: AMX on "
                           "CPU, refused at start elsewhere; parse verdict_prob reads logits vLLM does not return).",
                           choices=("torch", "vllm"))
    kv_cache_dtype: str = setting("auto", "judge: its KV cache, auto (the model dtype) or fp8 (per-tensor Q/K/V "
                                  "scales calibrated once, on the first batch it judges).", choices=("auto", "fp8"))
    max_batch: int = setting(16, "Items one forward batch holds (gathered across concurrent Score calls).", gt=0,
                             le=limits.MAX_BATCH_ROWS)
    max_input_tokens: int = setting(2048, "Tokens one rendered judge prompt or classifier input may hold; a longer "
                                    "one leaves its item ungraded (counted), never scored.", gt=0, le=1 << 20)
    max_new_tokens: int = setting(256, "judge: tokens the judge may write per item (parse boxed / score / verdict).",
                                  gt=0, le=limits.MAX_NEW_TOKENS)
    template: str = setting(DEFAULT_JUDGE_TEMPLATE, "judge: the prompt, with {question}, {response} and {answer} "
                            "(the reference answer, empty when there is none) filled in; rendered as one user turn "
                            "by the judge's chat template when it has one. Literal braces are doubled.")
    parse: str = setting("boxed", "judge: how its output becomes a score in [0, 1]: boxed (the last \\boxed{x}, "
                         "x / max_score), score (the last 'score: x', x / max_score), verdict (the last of the "
                         "verdicts' words it writes, that word's value) or verdict_prob (no generation: the "
                         "verdict words' probabilities as the judge's first token, value-weighted). Output that "
                         "does not parse leaves its sample unscored.",
                         choices=("boxed", "score", "verdict", "verdict_prob"))
    verdicts: dict | None = setting(None, "judge, parse verdict / verdict_prob: each verdict word and its score in "
                                    "[0, 1] (None: yes 1, no 0).", kind=dict, optional=True)
    max_score: float = setting(1.0, "judge, parse boxed / score: the top of the judge's scale (10 for a 0-10 "
                               "scale); a value outside [0, max_score] does not parse.", gt=0.0)
    n: int = setting(1, "judge: samples per item, their parsed scores averaged (an item with none parsed is left "
                     "unscored).", gt=0, le=limits.MAX_SAMPLES_PER_PROMPT)
    temperature: float = setting(0.0, "judge: sampling temperature of its samples (0: greedy; n > 1 wants > 0).",
                                 ge=0.0, le=limits.MAX_TEMPERATURE)
    positive_label: int = setting(-1, "classifier: the label whose probability is the score (softmax over the "
                                  "labels; a one-label head: sigmoid of its logit). -1: the last label.")
    timeout_s: float = setting(600.0, "Seconds one Score call may wait for its model scores; past it the items not "
                               "scored are ungraded (retried, then left out of the step).", gt=0.0)
    follow_policy: bool = setting(False, "judge: the policy itself is the judge, at the version the rollout holds (it "
                                  "refits with the rollout: the loop's rollout engine, the stack's rollout replicas; "
                                  "their precision); model / precision / kv_cache_dtype are then unused and parse "
                                  "is boxed, score or verdict.")
    pairwise: bool = setting(False, "judge: compare each response with every other response of its GRPO group (that "
                             "the gate let through) instead of judging it alone: the template reads the two as "
                             "{response} and {other}, the parsed score is the chance the first is the better, and a "
                             "response's score is its mean win over both orders of every pair (G(G-1) judge calls "
                             "per group).")
    agreement: bool = setting(False, "precision fp8: also score every item with the same model in bf16 (twice the "
                              "model's work) and record reward/model_agreement (the share of items whose bf16 score "
                              "equals the FP8 one, unscored counting as a value) and reward/model_abs_diff_mean "
                              "(mean |FP8 - bf16| over the items both scored); the FP8 score is the reward.")

    @property
    def verdict_scores(self) -> dict[str, float]:
        """The verdict words and their scores (``verdicts``, or yes 1 / no 0)."""
        return dict(self.verdicts) if self.verdicts is not None else {"yes": 1.0, "no": 0.0}

    def check(self) -> None:
        if self.kind is None:
            return
        if self.follow_policy:
            if self.kind != "judge" or self.parse == "verdict_prob" or self.agreement:
                raise ConfigError(f"{self.key('follow_policy')}: the policy judges as a generating judge: it needs "
                                  f"kind judge, a parse other than verdict_prob (the rollout returns no verdict "
                                  f"probabilities) and no agreement (its precision is the rollout's)")
        elif not self.model:
            raise ConfigError(f"{self.key('model')}: {self.key('kind')} {self.kind!r} needs a model (a preset or a "
                              f"checkpoint directory)")
        if self.model and len(self.model) > MAX_PATH_CHARS:
            raise ConfigError(f"{self.key('model')}: longer than {MAX_PATH_CHARS} characters")
        if self.agreement and self.precision != "fp8":
            raise ConfigError(f"{self.key('agreement')}: compares the FP8 model with itself in bf16; it needs "
                              f"{self.key('precision')}: fp8")
        if self.backend == "vllm" and (self.kind != "judge" or self.parse == "verdict_prob" or self.agreement
                                       or self.kv_cache_dtype != "auto" or self.follow_policy):
            raise ConfigError(f"{self.key('backend')}: vllm serves a generating judge of its own: it needs kind "
                              f"judge, a parse other than verdict_prob (vLLM returns no verdict probabilities), "
                              f"kv_cache_dtype auto (no calibration is built for it), no agreement and no "
                              f"follow_policy")
        if self.pairwise and self.kind != "judge":
            raise ConfigError(f"{self.key('pairwise')}: a {self.kind} scores one response; pairwise needs a judge")
        if self.kind == "classifier" and self.kv_cache_dtype != "auto":
            raise ConfigError(f"{self.key('kv_cache_dtype')}: a classifier keeps no KV cache (one forward per item)")
        if self.kind == "judge":
            from string import Formatter

            try:
                names = {f for _, f, _, _ in Formatter().parse(self.template) if f is not None}
            except ValueError as exc:
                raise ConfigError(f"{self.key('template')}: not a format string: {exc} (double literal braces)") \
                    from None
            allowed = {"question", "response", "answer"} | ({"other"} if self.pairwise else set())
            unknown = names - allowed
            if unknown or "response" not in names or (self.pairwise and "other" not in names):
                raise ConfigError(f"{self.key('template')}: fields {sorted(names)}; it must hold {{response}}"
                                  f"{' and {other} (pairwise)' if self.pairwise else ''} and may hold {{question}} "
                                  f"and {{answer}}")
            if self.parse.startswith("verdict"):
                bad = {w: v for w, v in self.verdict_scores.items() if not (w.strip() and isinstance(v, int | float)
                                                                       and not isinstance(v, bool) and 0 <= v <= 1)}
                if len(self.verdict_scores) < 2 or bad:
                    raise ConfigError(f"{self.key('verdicts')}: at least two words, each mapped to a score in "
                                      f"[0, 1], got {self.verdict_scores}")
            if self.parse == "verdict_prob" and self.n != 1:
                raise ConfigError(f"{self.key('n')}: verdict_prob reads one distribution per item (n must be 1)")


@dataclass(frozen=True)
class RewardCombineConfig(Section):
    KEY = "reward.combine"
    gate: bool = setting(False, "With a reward model: the rule grader gates it — a response the rule grader "
                         "fails scores 0 (the model is not asked), one it passes gets the weighted mix below.")
    rule_weight: float = setting(0.0, "Weight of the rule grader's reward in the mix (with a reward model).", ge=0.0)
    model_weight: float = setting(1.0, "Weight of the reward model's score in the mix.", ge=0.0)

    def check(self) -> None:
        if self.rule_weight + self.model_weight <= 0:
            raise ConfigError(f"{self.key('rule_weight')} + {self.key('model_weight')} must be > 0")


@dataclass(frozen=True)
class RewardConfig(Section):
    KEY = "reward"
    grader: str = setting("exact_match", "Grader name (fp8rl.data graders, or one registered by "
                          "--grader-module).")
    timeout_s: float = setting(5.0, "Seconds one item may take to grade; past it the item is TIMEOUT.", gt=0.0)
    model: RewardModelConfig = section(RewardModelConfig, "A reward model (judge or classifier) served by the "
                                       "reward service beside the rule grader.")
    combine: RewardCombineConfig = section(RewardCombineConfig, "How the rule grader's reward and the model's score "
                                           "make the reward (with a reward model).")


@dataclass(frozen=True)
class CalibrationConfig(Section):
    KEY = "calibration"
    margin: float = setting(1.05, "Headroom multiplied into each Q/K/V amax before it becomes a scale.", gt=0.0)
    percentile: float = setting(99.9, "Percentile of |Q|, |K|, |V| taken as the amax.")
    max_sequences: int = setting(16, "Sequences per calibration (an evenly spaced subset of the step's).", gt=0,
                                 le=limits.MAX_BATCH_ROWS)
    site: str = setting("auto", "Where each new version's Q/K/V scales come from: logprobs (the trainer records "
                        "the Q/K/V amax of the step's logprob pass — version v's weights over every sequence of the "
                        "batch — and publishes them as v+1's: no forward of their own, one step stale), trainer "
                        "(the trainer runs a forward of max_sequences of the step's sequences on v+1's weights right "
                        "after its optimizer step), calibrator (the calibrator service pulls v+1's weights and does "
                        "that; asynchronous GRPO overlaps it with the next rollout), or auto: logprobs on a "
                        "one-process torch trainer, calibrator otherwise. Version 0 is always calibrated on its own "
                        "weights (the calibrator service; the loop's trainer).",
                        choices=("auto", "logprobs", "trainer", "calibrator"))


@dataclass(frozen=True)
class RefitConfig(Section):
    KEY = "refit"
    transport: str = setting("auto", "How replicas pull a version's shards: auto (shared memory when the trainer is on "
                             "the replica's host, else the collective broadcast when the trainer runs one, else "
                             "gRPC), grpc, shm or collective. Any other than grpc falls back to gRPC when it "
                             "cannot deliver a version.", choices=("auto", "grpc", "shm", "collective"))
    shm_root: str = setting("/dev/shm", "Shared-memory directory the trainer writes shards into (in containers, a "
                            "volume the trainer and its same-host replicas share).")
    collective: bool = setting(False, "The trainer also broadcasts every version to a torch.distributed group of "
                               "the replicas that join it (gloo on CPU, NCCL on GPU).")
    parallel_streams: int = setting(4, "Shards a replica pulls at once (one gRPC stream each).", gt=0, le=64)
    delta: bool = setting(False, "Also publish each version as an element-sparse delta against the previous one "
                          "(changed E4M3 bytes, FP32 scales and BF16 elements); a replica at that version pulls "
                          "only the delta.")

    def check(self) -> None:
        if self.transport == "collective" and not self.collective:
            raise ConfigError(f"{self.key('transport')}: 'collective' needs {self.key('collective')}: true "
                              f"(the trainer must run the broadcast group)")
        if not self.shm_root.startswith("/"):
            raise ConfigError(f"{self.key('shm_root')}: must be an absolute path, got {self.shm_root!r}")
