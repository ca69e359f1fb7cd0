"""Multi-turn trajectories in the in-process loop (issue 48): token in / token out, environment tokens masked, the
trainer's one forward over a whole trajectory bitwise the rollout's per-turn decode, failures of the environment
left out of the loss and counted.

The policy is a seeded random 2-layer Llama with the ChatML character tokenizer of :mod:`fp8rl.presets.chatml`
(a chat template that renders tools and tool results). A random policy never guesses the number, so every
``guess_number`` trajectory runs its full ``max_turns`` — the turns are what is tested, not the policy.
"Exact" is bitwise: ``mismatch/max_abs_logprob_diff`` exactly 0.0 (:mod:`fp8rl.rl.metrics`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from fp8rl.config import parse_job_config
from fp8rl.engines.batch import build_train_batch
from fp8rl.loop import GRPOLoop, LoopConfig
from fp8rl.presets.chatml import chatml_template, random_chat_checkpoint

TURNS = 3
MAX_DIFF = "mismatch/max_abs_logprob_diff"


def _chat_model(path: Path, *, rewrite_history: bool = False, **arch) -> Path:
    return random_chat_checkpoint(path, chat_template=chatml_template(rewrite_history=rewrite_history), **arch)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return _chat_model(tmp_path_factory.mktemp("chat-model"))


def _job(model: Path, *, recipe: str = "fp8_e2e", kv: str = "fp8", env: dict | None = None, data: dict | None = None,
         **more) -> dict:
    fp8 = recipe != "bf16"
    job = {"job": {"steps": 1, "seed": 0, "checkpoint_every": 0},
           "policy": {"model": str(model),
                      "generation": {"vllm_cfg": {"precision": "fp8" if fp8 else "bf16", "kv_cache_dtype": kv}},
                      "training": {"lr": 0.01, "micro_batch_size": 8,
                                   "megatron_cfg": {"fp8_cfg": {"enabled": recipe == "fp8_e2e"}}}},
           "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
           "env": {"name": "guess_number", "max_turns": TURNS, "max_tokens_per_turn": 8,
                   "max_trajectory_tokens": 200, **(env or {})},
           "data": data or {"task": "env"}}
    for key, val in more.items():  # "section" replaces a section, "section__name" sets one key of it
        section, _, name = key.partition("__")
        if name:
            job.setdefault(section, {})[name] = val
        else:
            job[section] = val
    return job


def _loop(job: dict, **cfg) -> GRPOLoop:
    return GRPOLoop(LoopConfig(parse_job_config(job), **cfg))


def _trajectories(loop: GRPOLoop, step: int = 0) -> list:
    problems = loop.plan.batch(step)
    return [t for _, t in loop.backends.generate(loop.plan.prompts(problems), loop.rollout.weight_version, step=step,
                                                 n=loop.plan.group, temperature=1.0, problems=problems)]


@pytest.mark.parametrize("recipe,kv", [("bf16", "auto"), ("fp8_e2e", "auto"), ("fp8_e2e", "fp8")])
def test_a_multi_turn_step_is_bitwise_the_trainers_forward(chat_model, recipe, kv):
    """One GRPO step on 3-turn trajectories: the trainer's single forward over each whole trajectory gives the
    logprobs the rollout sampled every model token with, bitwise (per-turn prefill of the history included)."""
    loop = _loop(_job(chat_model, recipe=recipe, kv=kv))
    m = loop.step(0)
    kept = loop.rollout.session_stats()  # turns 2 and 3 reused the trajectory's K/V instead of re-prefilling it
    print(f"\n{recipe} kv={kv}: max |dlogprob| {m[MAX_DIFF]!r}, turns {m['env/turns_mean']}, "
          f"env tokens {m['env/masked_tokens']:.0f}, model tokens {m['env/model_tokens']:.0f}, KV reuse {kept}")
    assert kept["hits"] == 4 * (TURNS - 1) and kept["reused_tokens"] > 0 and kept["entries"] == 0  # released
    assert m[MAX_DIFF] == 0.0 and m["token_mult_prob_error"] == 1.0
    assert m["env/turns_mean"] == TURNS and m["env/end/max_turns"] == 4  # every trajectory ran its turns
    assert m["env/masked_tokens"] > 0 and m["env/model_tokens"] > 0 and m["env/ungraded"] == 0


@pytest.mark.moe  # about a minute on 2 cores: the moe tier (make test-moe) and the ISA tier run it
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_moe_trajectory_is_bitwise_with_routes_stitched_per_turn(tmp_path, replay):
    """Qwen3-MoE, fp8_e2e + FP8 KV: each turn's prefill routes (the environment's tokens included) and decode routes
    are stitched into one route tensor per trajectory, covering every fed position; replayed by the trainer
    (or not: under invariance routing agrees without replay) its logprobs are bitwise the rollout's."""
    model = _chat_model(tmp_path / "moe", architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=128, initializer_range=0.05)
    loop = _loop(_job(model, policy__router_replay={"enabled": replay}))
    if replay:
        for t in _trajectories(loop, step=1):
            assert t.routes is not None and t.routes.shape[0] == len(t.prompt_ids) + len(t.token_ids) - 1
    m = loop.step(0)
    assert m[MAX_DIFF] == 0.0 and m["env/turns_mean"] == TURNS
    if replay:  # the trainer's router, were it free, would pick the replayed experts: routing agreed bitwise
        assert m["moe/router_agreement"] == 1.0


def test_without_batch_invariance_the_turns_are_not_bitwise(chat_model):
    """Negative control: the same step with invariance off — decode and the trainer's full forward run other GEMM
    shapes, and the mismatch is no longer 0."""
    m = _loop(_job(chat_model, policy__numerics={"batch_invariant": False})).step(0)
    print(f"\ninvariance off: max |dlogprob| {m[MAX_DIFF]:.3g}")
    assert m[MAX_DIFF] > 0.0


def test_trajectory_tokens_are_the_sampled_ones_and_only_the_models_are_trained(chat_model):
    """Token in, token out: a trajectory is its opening, then the model's sampled ids as they were (stop token
    included) and the environment's deltas; the loss mask is 1 exactly on the model's ids, whose logprobs are the
    engine's; the environment's reply is the template's rendering of the conversation, so opening + segments equal
    one rendering of the whole conversation when the template does not rewrite history."""
    loop = _loop(_job(chat_model))
    trajs = _trajectories(loop)
    assert len(trajs) == 4
    for t in trajs:
        kinds = [k for k, _ in t.segments]
        assert kinds == ["model", "env"] * (TURNS - 1) + ["model"]  # a trailing reply no model read is dropped
        assert len(t.token_ids) == len(t.token_mask) == len(t.logprobs) == sum(n for _, n in t.segments)
        assert all((lp == 0.0) == (m == 0) or m == 1 for lp, m in zip(t.logprobs, t.token_mask, strict=True))
        assert {v for v, m in zip(t.versions, t.token_mask, strict=True) if m} == {0}
        rendered = loop.renderer.render(t.messages, [], add_generation_prompt=False)
        # the conversation rendered once starts with the trajectory's text (its last reply, which no model turn read,
        # is dropped from the tokens); compared as text: the model may sample "t", "h" where the tokenizer would
        # merge "th" — those ids are kept as sampled
        text = loop.tok.decode(t.ids, skip_special=False)
        # a turn may end on either stop token (<|endoftext|> or <|im_end|>); the template writes <|im_end|>
        assert rendered.startswith(text.replace("<|endoftext|>", "<|im_end|>")), (rendered, text)
    batch = build_train_batch(trajs, None, 2, loop.tok.pad_id, advantages=torch.ones(len(trajs)))
    for b, t in enumerate(trajs):
        p = len(t.prompt_ids)
        assert batch.loss_mask[b, :p].sum() == 0
        assert batch.loss_mask[b, p:p + len(t.token_ids)].tolist() == [float(m) for m in t.token_mask]


def test_environment_tokens_get_zero_gradient(chat_model):
    """The loss never sees an environment token: a train step with garbage generation logprobs and a zero
    proximal logprob on every environment position moves the weights bitwise as the real one does; the same
    positions with the loss mask set (negative control) move them differently."""
    loop = _loop(_job(chat_model, recipe="bf16", kv="auto"))
    trajs = _trajectories(loop)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    base = build_train_batch(trajs, None, 2, loop.tok.pad_id, advantages=adv)
    env = (base.attention_mask.bool() & (base.loss_mask == 0))
    env[:, :min(len(t.prompt_ids) for t in trajs)] = False  # the prompts too are context; keep to the deltas
    assert env.any()
    state = copy.deepcopy(loop.trainer.model.state_dict())
    opt_state = copy.deepcopy(loop.trainer.optimizer.state_dict())

    def step(batch) -> dict[str, torch.Tensor]:
        loop.trainer.model.load_state_dict(state)
        loop.trainer.optimizer.load_state_dict(opt_state)
        batch.prev_logprobs = loop.trainer.compute_logprobs(batch)
        loop.trainer.train_step(batch)
        return {k: v.detach().clone() for k, v in loop.trainer.model.state_dict().items()}

    real = step(copy.copy(base))
    noisy = copy.copy(base)
    noisy.gen_logprobs = base.gen_logprobs.masked_fill(env, -7.0)
    assert all(torch.equal(real[k], v) for k, v in step(noisy).items())
    trained = copy.copy(base)
    trained.loss_mask = base.loss_mask.masked_fill(env, 1.0)
    trained.gen_logprobs = noisy.gen_logprobs
    assert not all(torch.equal(real[k], v) for k, v in step(trained).items())


def test_a_history_rewriting_template_keeps_the_exact_tokens(tmp_path):
    """A template that drops earlier assistant turns' content (as Qwen3 strips <think>): the trajectory keeps the
    tokens the model saw — still bitwise the trainer's — and counts every reply rendered by the neutral-history
    rule; re-rendering the conversation (what a stack that re-tokenizes would train on) gives other tokens."""
    model = _chat_model(tmp_path / "rewriting", rewrite_history=True)
    loop = _loop(_job(model))
    m = loop.step(0)
    assert m[MAX_DIFF] == 0.0 and m["env/prefix_breaks"] > 0
    t = _trajectories(loop, step=1)[0]
    rerendered = loop.renderer.render(t.messages, [], add_generation_prompt=False)
    # negative control: the template rewrote the history, so a re-rendering is not what the model saw
    assert not rerendered.startswith(loop.tok.decode(t.ids, skip_special=False))


def test_a_user_environment_that_crashes_or_hangs_ends_only_its_trajectory_ungraded(chat_model, tmp_path,
                                                                                    monkeypatch):
    """A user environment by import path whose odd tasks raise (or hang past env.step_timeout_s) on their second
    step: those trajectories end ungraded — reward None, out of the loss and of their group's advantages, counted
    — and the step still trains on the others."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    rows = [{"prompt": "Guess my number between 1 and 100.", "answer": str(a)} for a in (37, 42, 9, 64)]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for mode, reason in (("crash", "env_error"), ("hang", "env_timeout")):
        job = _job(chat_model, env={"name": "envs_for_tests:FlakyEnv", "kwargs": {"mode": mode},
                                    "step_timeout_s": 0.5},
                   data={"task": "jsonl", "path": "tasks.jsonl"})
        loop = _loop(job, data_root=str(tmp_path))
        m = loop.step(0)
        odd = sum(int(r["answer"]) % 2 for r in rows[:2]) * 2  # the step's 2 prompts x 2 samples
        print(f"\n{mode}: ungraded {m['env/ungraded']:.0f}, ends {reason} {m[f'env/end/{reason}']:.0f}")
        assert m["env/ungraded"] == odd == m[f"env/end/{reason}"] and odd > 0
        assert m[MAX_DIFF] == 0.0 and loop.trainer.version == 1


def test_an_unknown_user_environment_is_refused_naming_the_path(chat_model, tmp_path):
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"prompt": "Guess.", "answer": "3"}) + "\n")
    job = _job(chat_model, env={"name": "no_such_module:Env"}, data={"task": "jsonl", "path": "tasks.jsonl"})
    with pytest.raises(ValueError, match="no_such_module"):
        _loop(job, data_root=str(tmp_path))


def test_async_grpo_finishes_trajectories_on_one_version(chat_model):
    """Asynchronous GRPO with max_weight_lag 1 (env.partial finish): a refit waits for the trajectories in flight,
    so every trajectory's model tokens come from one version, at most one behind the trainer."""
    cfg = LoopConfig(parse_job_config(_job(chat_model, job={"steps": 3, "seed": 0, "checkpoint_every": 0},
                                           grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                                                 "async_grpo": {"enabled": True, "max_weight_lag": 1}})))
    loop = GRPOLoop(cfg)
    rows = []
    loop.run_async(3, rows.append)
    assert len(rows) == 3 and all(r["weight_lag_max"] <= 1 for r in rows)
    assert all(r["numeric/" + MAX_DIFF] == 0.0 for r in rows if r.get("stale_fraction", 0.0) < 1.0)


def test_the_tool_job_file_loads_and_the_stack_takes_it():
    """``deploy/tool-job.yaml`` is a valid job of the calculator that the service stack takes (its environments run
    in the reward service's env workers)."""
    from fp8rl.config import load_job_config

    job = load_job_config(Path(__file__).resolve().parents[2] / "deploy" / "tool-job.yaml")
    assert job.env.name == "calculator" and job.data.task == "env" and job.policy.model == "smollm2-135m-instruct"
    job.check_services()


def test_a_run_reports_trajectories_with_model_and_environment_tokens_apart(chat_model, tmp_path):
    """``python -m fp8rl.loop`` on an environment: validation runs trajectories too (greedy accuracy), the step rows
    carry the env/* metrics, and the report shows a few trajectories with the model's (trained) and the
    environment's (context) tokens told apart."""
    from fp8rl.loop import run

    job = _job(chat_model, job={"steps": 1, "seed": 0, "checkpoint_every": 0, "eval_size": 1}, eval={"k": 0})
    out = run(LoopConfig(parse_job_config(job), out_dir=str(tmp_path / "run")), progress=False)
    row = out["steps"][0]
    assert row["env/turns_mean"] == TURNS and row[MAX_DIFF] == 0.0
    md = (tmp_path / "run" / "trajectories.md").read_text()
    assert md.count("**model**") >= TURNS and "**environment**" in md and "max_turns" in md
