"""``tiny-arith-tool``: tiny-arith's Llama with a ChatML chat template and a 2048-token context, warm-started to
call a calculator (issue 48).

The task is :class:`fp8rl.envs.calculator.CalculatorEnv`'s: products of a 3-digit and a 2-digit number, which a
4-layer, 256-wide model cannot compute in its head but can copy into a ``<tool_call>`` and copy back out of the
tool's result. The warm start teaches exactly that much and leaves the rest to RL: on :data:`TOOL_RATE` (40 %) of
its problems the model calls the tool and copies the result (``Answer: 10063``), on the others it answers at
once with its own (usually wrong) attempt at the product. So a GRPO job that raises the tool-call rate raises
accuracy, and its tools-disabled control (``CalculatorEnv(tools_enabled=False)``) has nothing to gain.

**Curriculum.** Copying digits across ~70 tokens of template text, behind a ~970-token system prompt that holds
other numbers (``12*34``, ``347*29``), is a circuit a randomly initialised model finds late: trained on whole
episodes alone it had not started after 600 steps (attention starts uniform over every key, so the signal towards
the one right key is diluted by the context length). Three stages (:data:`STAGES`) get there in minutes:

1. ``copy`` — short dense rows (:func:`copy_row`): a user turn ``What is 4071?`` answered ``4071``, or a
   ``<tool_response>`` answered ``Answer: 4071``; random digit strings of 3-8 characters. About 40 tokens, every
   learned token a copy: copying heads form in a few hundred cheap steps.
2. ``short`` — tool-calling episodes without the system turn (:func:`short_row`): the real format at the real
   distances, with ~170-token contexts.
3. ``episodes`` — whole episodes on the shared prefix, :data:`TOOL_RATE` of them with a tool call, the rest
   answered at once; one step in :data:`LONG_EVERY` on conversations of up to :data:`CONTEXT` tokens. It stops when
   the sampled check meets the target (**Stop** below).

**Rendering.** Every episode row is built exactly as a rollout builds its trajectory (token in, token out;
:class:`~fp8rl.envs.render.ChatRenderer`): ``opening(env.reset(task), env.tools())``, the assistant's turn
with its ``<|im_end|>``, ``delta(...)`` of the tool's result and the next generation prompt, the final turn with
its ``<|im_end|>``. The loss is on the assistant's tokens only (``<|im_end|>`` included).

**Trained at 2048.** The opening (system prompt, the Hermes ``# Tools`` block, the question) is about 1000
tokens, so every episode already runs at positions ~1000-1150. One ``episodes`` step in :data:`LONG_EVERY`
instead trains on conversations that go on to the full 2048 positions: after an episode's answer the user asks
the next question (``delta`` of a user message, as a chat client would render it) until the next exchange would
not fit. Their first exchange is a plain episode; the later ones see the whole context, so attention spans up
to 2047 positions are trained.

**Shared prefix.** The system prompt and the tools block (everything before the question) are the same tokens
in every episode. A step runs them once (batch 1) into a :class:`~fp8rl.model.kv_cache.KVCache` whose K/V
stay in the autograd graph, broadcasts them to the batch and runs only the per-problem suffixes on top: the same
loss and gradient as the full rows (up to FP32 summation order) for a fraction of the compute.

**Stop.** Every ``eval_every`` ``episodes`` steps a teacher-forced check (:func:`forced_tool_stats`: one
forward, no generation) estimates what sampling at temperature 1 would do; once it passes
(:data:`FORCED_GATE`), :func:`tool_use_stats` plays held-out episodes at temperature 1 with the real rollout
engine, and the warm start stops when those show a tool-call rate in :data:`TARGET_TOOL_RATE` and accuracy after
a call of ``target_tool_accuracy`` (0.8) or more. Cached like every preset: an HF checkpoint, the tokenizer and
its chat template beside it (with ``generation_config.json``: stop on ``<|im_end|>``), ``fp8rl_preset.json``
written last.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from fp8rl.engines.base import SamplingParams
from fp8rl.engines.torch_rollout import TorchRolloutEngine
from fp8rl.envs import ChatRenderer, Environment
from fp8rl.fp8 import Fp8Recipe
from fp8rl.model.config import ModelConfig
from fp8rl.model.hf_io import save_hf_checkpoint
from fp8rl.model.kv_cache import KVCache
from fp8rl.model.tokenizer import Tokenizer, load_tokenizer, stop_token_ids
from fp8rl.model.transformer import CausalLM

from .cache import PRESET_VERSION, preset_dir
from .catalog import register_preset
from .chatml import VOCAB_SIZE, build_chatml_tokenizer
from .tiny_arith import META_FILE
from .tool_formats import CALCULATOR, ToolFormat

log = logging.getLogger(__name__)

__all__ = ["CONTEXT", "FORCED_GATE", "STAGES", "TARGET_TOOL_ACCURACY", "TARGET_TOOL_RATE", "TINY_ARITH_TOOL",
           "TOOL_RATE", "Stage", "copy_row", "forced_tool_stats", "masked_loss", "meets_target", "prefix_loss",
           "prepare_tiny_arith_tool", "shared_prefix", "short_row", "tiny_arith_tool_config", "tool_use_stats",
           "transcript", "warm_start_tool"]

TINY_ARITH_TOOL = "tiny-arith-tool"
CONTEXT = 2048  # max_position_embeddings, and the length the long steps train at
TOOL_RATE = 0.4  # share of warm-start episodes that call the calculator
TARGET_TOOL_RATE = (0.25, 0.6)  # the warm start stops with the sampled tool-call rate in here ...
TARGET_TOOL_ACCURACY = 0.8  # ... and at least this accuracy after a call
# The teacher-forced check that gates the (slower) sampled one: its exact-episode probability is a lower bound on
# the sampled accuracy after a call, so the gate sits below the target.
FORCED_GATE = 0.6
# One `episodes` step in LONG_EVERY adds a conversation of up to CONTEXT tokens to its rows. Mixed into a step
# rather than given steps of their own: a step of two conversations alone set the copying back every time (the
# teacher-forced check after one fell from ~0.6 to ~0).
LONG_EVERY = 2


@dataclass(frozen=True)
class Stage:
    """One stage of the warm start's curriculum (module docstring)."""

    name: str
    """``copy`` (:func:`copy_row`), ``short`` (:func:`short_row`) or ``episodes`` (whole episodes, shared prefix)."""
    steps: int
    """Steps of this stage; ``episodes`` may stop earlier (its stop rule) and treats this as its maximum."""
    batch_size: int
    """Rows per step."""
    lr: float
    """AdamW learning rate after a linear warm-up of ``warmup`` steps."""
    warmup: int
    lr_end: float | None = None
    """None: ``lr`` stays constant after the warm-up; else it follows a cosine down to ``lr_end`` at ``steps``
    (sampling at temperature 1 needs sharp probabilities on every token of a tool call)."""

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based ``step``."""
        lr = self.lr * min(1.0, (step + 1) / self.warmup)
        if self.lr_end is None:
            return lr
        return self.lr_end + (lr - self.lr_end) * 0.5 * (1 + math.cos(math.pi * step / max(1, self.steps)))


# Measured on 1 thread (issue 48): with `copy` first, the copied digits of `short` reach ~1.0 (expression) and
# ~0.85 (answer) per digit in 150-200 steps; without it, neither moves in 600.
STAGES = (Stage("copy", 300, 32, 3e-3, 30), Stage("short", 120, 32, 3e-3, 10),
          Stage("episodes", 300, 32, 1e-3, 10, lr_end=1e-4))


def tiny_arith_tool_config() -> ModelConfig:
    """tiny-arith's architecture with the ChatML vocabulary (112 ids, padded to 128) and a 2048-token context."""
    return ModelConfig(
        architecture="llama", vocab_size=128 * math.ceil(VOCAB_SIZE / 128), hidden_size=256, intermediate_size=768,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=2, pad_token_id=0,  # <|im_end|>, <|endoftext|> (chatml.SPECIAL_TOKENS)
    )


# ---------------------------------------------------------------------------------------------- transcripts
def transcript(renderer: ChatRenderer, task: dict[str, str], call: bool, *, env: Environment | None = None,
               history: list | None = None, fmt: ToolFormat = CALCULATOR) -> tuple[list[int], list[int], list]:
    """One episode of ``fmt``'s tool as a rollout would build it: ``(ids, loss_mask, messages)``.

    ``call`` chooses a tool turn (``fmt.call(task)``: ``<tool_call>`` of the question's expression) then
    ``Answer: <the tool's result>``, or ``Answer: <the answer>`` at once. ``loss_mask`` is 1 on the assistant's
    tokens, their ``<|im_end|>`` included. With ``history`` (a finished conversation's messages) the question is
    asked as the next user turn: the ids are then only what follows the history's last ``<|im_end|>``.
    """
    env = env or fmt.make_env()
    tok, tools = renderer.tokenizer, env.tools()
    opening = env.reset(task)
    if history is None:
        ids, messages = renderer.opening(opening, tools), list(opening)
    else:
        ids, _ = renderer.delta(history, opening[1:], tools)
        messages = [*history, *opening[1:]]
    mask = [0] * len(ids)

    def model_turn(text: str):
        nonlocal ids, mask
        turn = tok.encode(text, add_bos=False) + [renderer.end_of_turn_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
        messages.append({"role": "assistant", "content": text})
        return env.step(text)

    if call:
        out = model_turn(fmt.call(task))
        delta, _ = renderer.delta(messages, out.messages, tools)
        ids, mask = ids + delta, mask + [0] * len(delta)
        messages += out.messages
        answer = fmt.answer(out.messages[0]["content"])
    else:
        answer = task["answer"]
    out = model_turn(f"Answer: {answer}")
    assert out.done and out.reward == 1.0, (task, answer)  # the transcript teaches a right episode
    return ids, mask, messages


def _rows(renderer: ChatRenderer, tasks: list[dict[str, str]], rng: random.Random, max_len: int | None = None,
          max_rows: int | None = None, fmt: ToolFormat = CALCULATOR) -> list[tuple[list[int], list[int]]]:
    """One episode per task, or (``max_len``) conversations of consecutive tasks, each filled up to ``max_len`` ids;
    at most ``max_rows`` rows."""
    rows: list[tuple[list[int], list[int]]] = []
    history = None
    for task in tasks:
        call = rng.random() < TOOL_RATE
        if history is not None:  # the next question of the conversation, if it fits
            ids, mask, messages = transcript(renderer, task, call, history=history, fmt=fmt)
            if len(rows[-1][0]) + len(ids) <= max_len:
                rows[-1][0].extend(ids)
                rows[-1][1].extend(mask)
                history = messages
                continue
            if max_rows is not None and len(rows) == max_rows:
                break
        ids, mask, messages = transcript(renderer, task, call, fmt=fmt)
        rows.append((ids, mask))
        history = messages if max_len is not None else None
    return rows


def copy_row(tok: Tokenizer, rng: random.Random, fmt: ToolFormat = CALCULATOR) -> tuple[list[int], list[int]]:
    """A ``copy`` row: ``What is <s>?`` answered ``<s>``, or a ``<tool_response>`` of ``fmt.reply(<s>)`` answered
    ``Answer: <s>`` (as the episodes' turns are rendered, without the system turn), ``s`` 3-8 random digits or, in
    the question, ``fmt.expression`` of random numbers (calculator: a product of two of 1-4 digits);
    ``(ids, loss_mask)``, the mask on the assistant's tokens and ``<|im_end|>``."""

    def digits(lo: int, hi: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))

    s = digits(3, 8) if rng.random() < 0.5 else fmt.expression(digits)
    if rng.random() < 0.5:
        context, answer = f"<|im_start|>user\nWhat is {s}?<|im_end|>\n<|im_start|>assistant\n", s
    else:
        s = s.replace("*", "").replace("+", "")
        context = (f"<|im_start|>user\n<tool_response>\n{fmt.reply(s)}\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n")
        answer = f"Answer: {s}"
    ids, learned = tok.encode(context, add_bos=False), tok.encode(answer + "<|im_end|>", add_bos=False)
    return ids + learned, [0] * len(ids) + [1] * len(learned)


def short_row(renderer: ChatRenderer, prefix: list[int], task: dict[str, str], fmt: ToolFormat = CALCULATOR
              ) -> tuple[list[int], list[int]]:
    """A ``short`` row: the tool-calling episode of ``task`` without its system turn (from the question's
    ``<|im_start|>``), ids as :func:`transcript` renders them."""
    ids, mask, _ = transcript(renderer, task, True, fmt=fmt)
    start = len(prefix) - 1 - prefix[::-1].index(renderer.tokenizer.encode("<|im_start|>", add_bos=False)[0])
    return ids[start:], mask[start:]


def masked_loss(model: CausalLM, rows: list[tuple[list[int], list[int]]], pad_id: int) -> torch.Tensor:
    """Mean next-token loss over the masked tokens of ``rows`` (right-padded into one batch)."""
    S = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), S), pad_id, dtype=torch.long)  # (B, S)
    weights = torch.zeros(len(rows), S)
    for b, (row, mask) in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        weights[b, :len(row)] = torch.tensor(mask, dtype=torch.float32)
    logits = model(ids)[:, :-1]  # (B, S-1, V)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return (loss * weights[:, 1:].reshape(-1)).sum() / weights[:, 1:].sum()


def shared_prefix(renderer: ChatRenderer, fmt: ToolFormat = CALCULATOR) -> list[int]:
    """The ids every episode of ``fmt``'s tool opens with (system prompt and tools block, up to the question)."""
    env = fmt.make_env()
    a, b = (renderer.opening(env.reset({"question": q, "answer": "0"}), env.tools()) for q in ("0", "1"))
    n = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)  # the question's first token
    return a[:n - 1]  # one token back: no BPE merge across the boundary can differ between questions


def _suffix_logits(model: CausalLM, prefix: list[int], rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Yields ``(ids, weights, logits)`` for groups of ``rows`` (each starting with ``prefix``) of similar length:
    the suffix ids ``(B, S)`` right-padded, their loss mask and the logits ``(B, S-1, V)`` of every suffix
    position but the last (position ``t`` predicts suffix token ``t + 1``). The shared ``prefix`` runs once; its
    K/V, in the autograd graph, are broadcast to every group (module docstring)."""
    P = len(prefix)
    if any(ids[:P] != prefix for ids, _ in rows):
        raise ValueError("every row must start with the shared prefix")
    one = KVCache.for_model(model, 1, P)
    model(torch.tensor([prefix]), kv_cache=one, logits_to_keep=1)  # the prefix's own tokens are never trained
    rows = sorted(rows, key=lambda r: len(r[0]))
    # groups of similar length (direct answers ~40 suffix tokens, tool episodes ~170, conversations ~1000): a row
    # opens a new group when it is over twice the group's shortest, so padding at most doubles a group's work
    groups: list[list[tuple[list[int], list[int]]]] = []
    for row in rows:
        if not groups or len(row[0]) - P > 2 * (len(groups[-1][0][0]) - P):
            groups.append([])
        groups[-1].append(row)
    for group in groups:
        B, S = len(group), max(len(ids) for ids, _ in group) - P
        ids = torch.full((B, S), pad_id, dtype=torch.long)  # right padding: causal rows never see it
        weights = torch.zeros(B, S)
        for b, (row, mask) in enumerate(group):
            ids[b, :len(row) - P] = torch.tensor(row[P:])
            weights[b, :len(row) - P] = torch.tensor(mask[P:], dtype=torch.float32)
        cache = KVCache.for_model(model, B, P + S)
        for layer in range(cache.num_layers):  # (1, Hkv, P, D) -> (B, Hkv, P, D): the backward sums over the batch
            cache.k[layer][:, :, :P] = one.k[layer][:, :, :P]
            cache.v[layer][:, :, :P] = one.v[layer][:, :, :P]
        cache.advance(P)
        yield ids, weights, model(ids, kv_cache=cache)[:, :-1]  # (B, S-1, V)


def prefix_loss(model: CausalLM, prefix: list[int], rows: list[tuple[list[int], list[int]]], pad_id: int
                ) -> torch.Tensor:
    """Mean next-token loss over the masked tokens of ``rows`` (each starting with ``prefix``, which holds no
    masked token): equal to the loss of the full rows, the prefix run once (:func:`_suffix_logits`)."""
    total, count = torch.zeros(()), 0.0
    for ids, weights, logits in _suffix_logits(model, prefix, rows, pad_id):
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        total = total + (loss * weights[:, 1:].reshape(-1)).sum()
        count += float(weights[:, 1:].sum())
    return total / count


@torch.no_grad()
def forced_tool_stats(model: CausalLM, renderer: ChatRenderer, prefix: list[int], tasks: list[dict[str, str]],
                      fmt: ToolFormat = CALCULATOR) -> dict[str, float]:
    """What sampling at temperature 1 would do, read off one teacher-forced forward of tool transcripts of
    ``tasks``: ``tool_call_rate``, the mean probability that the first token opens a tool call, and
    ``accuracy_with_tool``, the mean probability of sampling the rest of the right episode exactly (a lower
    bound on the accuracy after a call). Cheap (no generation): the warm start checks it often and runs
    :func:`tool_use_stats` only once it passes."""
    rows = [transcript(renderer, task, True, fmt=fmt)[:2] for task in tasks]
    opens, exact = [], []
    for ids, weights, logits in _suffix_logits(model, prefix, rows, renderer.tokenizer.pad_id):
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]  # (B, S-1)
        w = weights[:, 1:]
        first = w.argmax(dim=1)  # the first assistant token of each row
        opens += logp[torch.arange(len(ids)), first].exp().tolist()
        w[torch.arange(len(ids)), first] = 0
        exact += (logp * w).sum(dim=1).exp().tolist()
    return {"tool_call_rate": sum(opens) / len(opens), "accuracy_with_tool": sum(exact) / len(exact)}


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def tool_use_stats(model: CausalLM, tok: Tokenizer, n: int = 64, seed: int = 0, temperature: float = 1.0, *,
                   tools_enabled: bool = True, max_turns: int = 3, max_tokens_per_turn: int = 96,
                   batch_size: int = 64, fmt: ToolFormat = CALCULATOR) -> dict[str, float | None]:
    """Plays ``n`` episodes of ``fmt``'s tool (``fmt.tasks(n, seed)``) multi-turn: the rollout engine samples
    each turn at ``temperature``, ``fmt``'s environment (the calculator's by default) answers it, the
    :class:`~fp8rl.envs.render.ChatRenderer` appends its delta. A turn cut at ``max_tokens_per_turn``, an episode
    past ``max_turns`` or past the model's context ends with reward 0.

    Returns:
        ``tool_call_rate`` (episodes with a tool call), ``accuracy`` (mean reward), ``accuracy_with_tool`` /
        ``accuracy_without_tool`` (None when no episode is in that group), ``tool_error_rate`` (calls answered
        with an error: malformed ones, or all of them with ``tools_enabled=False``), ``mean_turns``.
    """
    renderer = ChatRenderer(tok)
    engine = TorchRolloutEngine(model, Fp8Recipe(linear="bf16"), eos_token_ids=stop_token_ids(tok),
                                max_batch_size=batch_size, pad_token_id=tok.pad_id, seed=seed)
    envs = [fmt.make_env(tools_enabled=tools_enabled) for _ in range(n)]
    tools = envs[0].tools() if envs else []
    messages = [env.reset(task) for env, task in zip(envs, fmt.tasks(n, seed), strict=True)]
    ids = [renderer.opening(m, tools) for m in messages]
    reward, turns = [0.0] * n, [0] * n
    info: list[dict] = [{} for _ in range(n)]  # the environment's cumulative counters (tool_calls, tool_errors)
    active = list(range(n))
    for turn in range(max_turns):
        active = [i for i in active if len(ids[i]) + max_tokens_per_turn <= engine.max_len]
        if not active:
            break
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens_per_turn, seed=seed * 1009 + turn)
        going = []
        for s in engine.generate([ids[i] for i in active], params):
            i = active[s.prompt_index]
            turns[i] += 1
            if s.finish_reason != "stop":
                continue  # cut by the budget: the trajectory ends here
            text = tok.decode(s.token_ids[:-1], skip_special=False)
            ids[i] += s.token_ids
            messages[i].append({"role": "assistant", "content": text})
            out = envs[i].step(text)
            info[i] = out.info
            if out.done:
                reward[i] = out.reward
                continue
            delta, _ = renderer.delta(messages[i], out.messages, tools)
            ids[i] += delta
            messages[i] += out.messages
            going.append(i)
        active = going
    calls = [float(x.get("tool_calls", 0.0)) for x in info]
    errors = [float(x.get("tool_errors", 0.0)) for x in info]
    with_tool = [r for r, c in zip(reward, calls, strict=True) if c > 0]
    without = [r for r, c in zip(reward, calls, strict=True) if c == 0]

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    return {"episodes": n, "tool_call_rate": len(with_tool) / max(n, 1), "accuracy": sum(reward) / max(n, 1),
            "accuracy_with_tool": mean(with_tool), "accuracy_without_tool": mean(without),
            "tool_error_rate": sum(errors) / sum(calls) if sum(calls) else 0.0, "mean_turns": mean(turns) or 0.0}


def meets_target(stats: dict, target_tool_accuracy: float = TARGET_TOOL_ACCURACY) -> bool:
    """The warm start's stop rule: tool-call rate in :data:`TARGET_TOOL_RATE`, accuracy after a call high enough."""
    lo, hi = TARGET_TOOL_RATE
    return lo <= stats["tool_call_rate"] <= hi and (stats["accuracy_with_tool"] or 0.0) >= target_tool_accuracy


# ---------------------------------------------------------------------------------------------- the preset
def prepare_tiny_arith_tool(
    directory: str | Path | None = None,
    *,
    seed: int = 0,
    stages: tuple[Stage, ...] = STAGES,
    target_tool_accuracy: float = TARGET_TOOL_ACCURACY,
    eval_every: int = 20,
    eval_size: int = 64,
    eval_seed: int = 10**6,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Create (or reuse) the cached tiny-arith-tool checkpoint and return its directory (module docstring): a
    random-init model (``seed``) through :func:`warm_start_tool` with the calculator (:data:`CALCULATOR`)."""
    out = Path(directory) if directory is not None else preset_dir(TINY_ARITH_TOOL)
    if (out / META_FILE).exists() and not force:
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_chatml_tokenizer(out)  # tokenizer, chat template, generation_config.json (stops on <|im_end|>)
    torch.manual_seed(seed)
    cfg = tiny_arith_tool_config()
    return warm_start_tool(CausalLM(cfg), cfg, out, TINY_ARITH_TOOL, CALCULATOR, seed=seed, stages=stages,
                           target_tool_accuracy=target_tool_accuracy, eval_every=eval_every, eval_size=eval_size,
                           eval_seed=eval_seed, progress=progress, task_meta={"env": "calculator", "digits": [3, 2]})


def warm_start_tool(model: CausalLM, cfg: ModelConfig, out: Path, name: str, fmt: ToolFormat, *, seed: int,
                    stages: tuple[Stage, ...], target_tool_accuracy: float, eval_every: int, eval_size: int,
                    eval_seed: int, progress: bool, task_meta: dict, meta: dict | None = None) -> Path:
    """Run ``stages`` on ``model`` with ``fmt``'s tool into ``out`` (which holds the ChatML tokenizer already);
    save the checkpoint and ``fp8rl_preset.json`` (written last) and return ``out``.

    Deterministic for a given seed and thread count. Runs ``stages`` in order; the ``episodes`` stage stops at its
    ``steps`` or at the first check (every ``eval_every`` steps) where :func:`forced_tool_stats` passes
    :data:`FORCED_GATE` and then :func:`tool_use_stats` on ``eval_size`` held-out episodes (``seed=eval_seed``,
    temperature 1) meets the target (:func:`meets_target`). ``fp8rl_preset.json`` records the steps of each stage,
    the last sampled stats and ``met_target`` (and ``meta``). The training tasks come from seeds no RL job or check
    draws (``seed * 10**7 + step + 10**8``).
    """
    tok = load_tokenizer(out)
    renderer = ChatRenderer(tok)
    prefix = shared_prefix(renderer, fmt)
    opt = torch.optim.AdamW(model.parameters(), lr=stages[0].lr, betas=(0.9, 0.98), weight_decay=0.01)
    checks = fmt.tasks(24, eval_seed + 1)  # the teacher-forced check's problems
    t0 = time.perf_counter()
    stats: dict = {}
    forced: dict = {}
    met = False
    done: dict[str, int] = {}
    long_rows = 0
    step_seed = seed * 10**7 + 10**8  # + the step, counted over all stages: no two steps draw the same tasks
    for stage in stages:
        bar = tqdm(range(stage.steps), desc=f"{name} warm start: {stage.name}", disable=not progress, unit="step")
        step = 0
        for step in bar:
            model.train()
            for g in opt.param_groups:
                g["lr"] = stage.lr_at(step)
            rng = random.Random(f"{name}:{seed}:{stage.name}:{step}")
            if stage.name == "copy":
                loss = masked_loss(model, [copy_row(tok, rng, fmt) for _ in range(stage.batch_size)], tok.pad_id)
            elif stage.name == "short":
                tasks = fmt.tasks(stage.batch_size, step_seed)
                loss = masked_loss(model, [short_row(renderer, prefix, t, fmt) for t in tasks], tok.pad_id)
            elif stage.name == "episodes":
                tasks = fmt.tasks(stage.batch_size + 16, step_seed)
                rows = _rows(renderer, tasks[:stage.batch_size], rng, fmt=fmt)
                if (step + 1) % LONG_EVERY == 0:  # and a conversation filled to CONTEXT (about 9 exchanges)
                    rows += _rows(renderer, tasks[stage.batch_size:], rng, CONTEXT, 1, fmt=fmt)
                    long_rows += 1
                loss = prefix_loss(model, prefix, rows, tok.pad_id)
            else:
                raise ValueError(f"unknown warm-start stage {stage.name!r}; stages: copy, short, episodes")
            step_seed += 1
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if stage.name != "episodes" or (step + 1) % eval_every:
                continue
            forced = forced_tool_stats(model.eval(), renderer, prefix, checks, fmt)
            bar.set_postfix(loss=f"{loss.item():.3f}", tools=f"{forced['tool_call_rate']:.2f}",
                            exact=f"{forced['accuracy_with_tool']:.2f}")
            log.info("step %d loss %.3f forced %s (%.0f s)", step + 1, loss.item(), forced, time.perf_counter() - t0)
            if meets_target(forced, FORCED_GATE):  # then the real check: sampled episodes, multi-turn
                stats = tool_use_stats(model, tok, eval_size, eval_seed, 1.0, fmt=fmt)
                log.info("step %d sampled %s (%.0f s)", step + 1, stats, time.perf_counter() - t0)
                met = meets_target(stats, target_tool_accuracy)
                if met:
                    break
        done[stage.name] = step + 1
        log.info("%s: stage %s done in %d steps (%.0f s), loss %.3f; forced %s", name, stage.name,
                 step + 1, time.perf_counter() - t0, loss.item(),
                 forced_tool_stats(model.eval(), renderer, prefix, checks, fmt))
    if not met:  # stopped at the last step: record where it ended
        stats = tool_use_stats(model.eval(), tok, eval_size, eval_seed, 1.0, fmt=fmt)
        log.warning("%s: the warm start did not meet its target: %s", name, stats)
    save_hf_checkpoint(model.eval(), cfg, out)
    record = {"preset": name, "version": PRESET_VERSION, "task": task_meta, "seed": seed, "tool_rate": TOOL_RATE,
              "context": CONTEXT, "stage_steps": done, "long_rows": long_rows, "shared_prefix_tokens": len(prefix),
              "forced_tool_stats": forced, "tool_use_stats": stats, "met_target": met, "eval_seed": eval_seed,
              **(meta or {}), "seconds": round(time.perf_counter() - t0, 1)}
    (out / META_FILE).write_text(json.dumps(record, indent=2))
    log.info("%s ready in %s: %s", name, out, record)
    return out


register_preset(TINY_ARITH_TOOL, lambda progress: prepare_tiny_arith_tool(progress=progress))
