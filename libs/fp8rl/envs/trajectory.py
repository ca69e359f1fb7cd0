"""Multi-turn trajectories: the unit of agent RL, and the turn loop that samples them (DESIGN §4c, issue 48).

A :class:`Trajectory` is one task's conversation as the trainer sees it: the opening prompt, then ordered
segments — the model's turns (sampled tokens: trained, each with the engine's logprob and the weight version
that sampled it, and MoE routes) and the environment's replies (tool results, feedback, the next generation
prompt: context only, loss mask 0) — with one reward at the end. It has the attributes of an engine's
``Sample`` (``prompt_ids``, ``token_ids``, ``logprobs``, ``weight_version``, ``finish_reason``, ``routes``) plus
``token_mask`` (1 = the model's token), so everything that trains on samples trains on it; a single-turn sample
is the one-segment case.

:func:`run_trajectories` drives a batch of them turn by turn over a ``generate`` callable (the in-process
engine, or the rollout service behind the controller): every active trajectory's whole token list is the next
turn's prompt (the engine re-prefills it, or reuses its KV cache where it keeps one), the model's sampled ids
are appended as they are — never decoded and re-encoded — and the environment's messages are appended as the
chat template's delta (:class:`~fp8rl.envs.render.ChatRenderer`). With batch invariance the trainer's one
forward over the whole trajectory is then bitwise the rollout's per-turn decode.

How a trajectory ends (``end_reason``) and what it is worth:

=============== ====================================================== =========================
``done``        the environment said done                              its reward
``budget``      the next turn would pass max_trajectory_tokens or the  0 (graded)
                model's context
``max_turns``   env.max_turns model turns without done                 0 (graded)
``env_error``   the environment raised                                 None: ungraded
``env_timeout`` a step took longer than env.step_timeout_s             None: ungraded
=============== ====================================================== =========================

A turn cut by ``env.max_tokens_per_turn`` (no stop token sampled) is still stepped; the end-of-turn token the
template needs after it is appended as an environment token (context, never trained), and the conversation goes
on (``cut_turns`` counts them). An ungraded trajectory (reward None) is left out of the loss and of its group's
advantages and counted — an environment's failure is never a silent zero reward.

Each trajectory has a key unique in the process (``trajectory-<call>-<index>``), handed to ``generate`` with its
prompt every turn: the embedded engine keeps the trajectory's K/V between turns under it (so a turn prefills only
its new tokens, bitwise the full re-prefill under batch invariance: :mod:`fp8rl.engines.kv_sessions`) and drops it
when ``release`` is told the trajectory ended.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import Environment, EnvSpec, EnvStep, Message
from .render import ChatRenderer
from .tools import parse_tool_calls

__all__ = ["END_REASONS", "TURN_SEED_STRIDE", "UNGRADED", "Trajectory", "run_trajectories", "step_with_timeout",
           "trajectories_markdown", "trajectory_metrics"]

END_REASONS = ("done", "budget", "max_turns", "env_error", "env_timeout")
UNGRADED = ("env_error", "env_timeout")  # the environment's failures: no reward, out of the loss
_BATCHES = itertools.count()  # numbers each run_trajectories call: its trajectories' keys are unique in the process
TURN_SEED_STRIDE = 104_729  # a trajectory batch's turn t samples with the step's seed + t * this


@dataclass
class Trajectory:
    """One task's multi-turn conversation in tokens (see the module docstring).

    Attributes:
        prompt_index: the task's index in the step's batch (its GRPO group).
        prompt_ids: the opening prompt (system + user messages + the generation prompt).
        token_ids: every token after the prompt: the model's turns and the environment's deltas, in order.
        logprobs: per token, the engine's logprob (model tokens) or 0.0 (environment tokens).
        token_mask: per token, 1 for the model's, 0 for the environment's.
        versions: per token, the weight version that sampled it (-1 for environment tokens).
        segments: ``(source, length)`` runs over ``token_ids``: ``"model"`` or ``"env"``.
        routes: MoE routing replay: ``(len(prompt_ids) + len(token_ids) - 1, L, K)`` experts of every fed position,
            stitched turn by turn; None otherwise.
        reward: the environment's reward, 0 for a trajectory the policy ran out of turns / tokens on, None when
            ungraded (the environment failed).
        end_reason: one of :data:`END_REASONS`.
        finish_reason: the last model turn's (``stop`` / ``length``), as a sample's.
        turns, cut_turns, tool_calls, prefix_breaks, env_seconds: model turns (and those cut by the per-turn
            limit), parsed tool calls (and ``tool_errors``),
            deltas rendered by the neutral-history rule (the template rewrote history), time spent in env.step.
        env_info: the environment's own numeric counters, as its last step reported them (cumulative: e.g. the
            ``python`` environment's ``sandbox_runs``, ``sandbox_start_s``, ``killed/<reason>``).
        messages: the conversation as messages (what the report renders).
        version_begun: the version the trajectory was begun at; its row's version when the model sampled none of
            its tokens (an agent that never called the model: ungraded, kept only so the batch keeps its shape).
    """

    prompt_index: int
    prompt_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[tuple[str, int]] = field(default_factory=list)
    routes: Any = None
    reward: float | None = None
    end_reason: str = ""
    finish_reason: str = "stop"
    turns: int = 0
    cut_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    prefix_breaks: int = 0
    env_seconds: float = 0.0
    env_info: dict[str, float] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    version_begun: int = -1

    @property
    def weight_version(self) -> int:
        """The oldest version among the model's tokens (what staleness is counted by; ``finish`` keeps one); with no
        model token, the version it was begun at (``version_begun``)."""
        own = [v for v in self.versions if v >= 0]
        return min(own) if own else self.version_begun

    @property
    def done(self) -> bool:
        return bool(self.end_reason)

    @property
    def graded(self) -> bool:
        return self.end_reason not in UNGRADED

    @property
    def ids(self) -> list[int]:
        """Prompt and every token so far: the next turn's prompt."""
        return [*self.prompt_ids, *self.token_ids]

    def add_model(self, sample: Any) -> None:
        """Append one model turn (an engine sample whose prompt was :attr:`ids`): its tokens, logprobs, version and
        the routes of the positions it fed that earlier turns had not."""
        n = len(sample.token_ids)
        self.token_ids += sample.token_ids
        self.logprobs += sample.logprobs
        self.token_mask += [1] * n
        self.versions += [sample.weight_version] * n
        self.segments.append(("model", n))
        self.finish_reason = sample.finish_reason
        self.turns += 1
        r = getattr(sample, "routes", None)
        if r is not None:  # rows for prompt_k + turn_k - 1 positions; keep those past what is held
            import torch

            held = 0 if self.routes is None else self.routes.shape[0]
            self.routes = r.clone() if self.routes is None else torch.cat([self.routes, r[held:]])

    def add_env(self, ids: Sequence[int]) -> None:
        """Append the environment's delta (context only)."""
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.token_mask += [0] * len(ids)
        self.versions += [-1] * len(ids)
        if self.segments and self.segments[-1][0] == "env":  # one run of context (a cut turn's end token + reply)
            self.segments[-1] = ("env", self.segments[-1][1] + len(ids))
        else:
            self.segments.append(("env", len(ids)))

    def end(self, reason: str, reward: float | None) -> None:
        """Finish with ``reason``; a trailing environment segment (a reply no model turn read) is dropped."""
        if self.segments and self.segments[-1][0] == "env":
            n = self.segments.pop()[1]
            for seq in (self.token_ids, self.logprobs, self.token_mask, self.versions):
                del seq[len(seq) - n:]
        self.end_reason, self.reward = reason, (None if reason in UNGRADED else reward)


class _Timeout(Exception):
    pass


def step_with_timeout(env: Environment, text: str, timeout_s: float) -> EnvStep:
    """``env.step(text)`` on a daemon thread, given at most ``timeout_s`` seconds.

    Raises:
        TimeoutError: the step did not return in time (the thread is abandoned: a daemon never blocks exit).
        Exception: whatever the step raised.
    """
    box: queue.Queue = queue.Queue(1)

    def run() -> None:
        try:
            box.put((True, env.step(text)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.put((False, e))

    threading.Thread(target=run, daemon=True, name="fp8rl-env-step").start()
    try:
        ok, value = box.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"the environment's step took longer than {timeout_s:g} s") from None
    if not ok:
        raise value
    if not isinstance(value, EnvStep):
        raise TypeError(f"env.step returned {type(value).__name__}, not an EnvStep")
    return value


GenerateTurn = Callable[[list[list[int]], int, int, list[str]], list[Any]]
"""``generate(prompts, max_tokens, turn, keys)`` → one sample per prompt (``token_ids`` with its stop token,
``logprobs``, ``finish_reason``, ``weight_version``, optionally ``routes``), prompts in order. ``keys`` name each
prompt's trajectory (unique in the process): an engine that keeps K/V between turns reuses the trajectory's."""


def run_trajectories(
    tasks: Sequence[dict[str, Any]], group: int, spec: EnvSpec, make_env: Callable[[], Environment],
    renderer: ChatRenderer, generate: GenerateTurn, *, max_context: int,
    decode: Callable[[Sequence[int]], str], stop_ids: Sequence[int],
    release: Callable[[str], Any] | None = None, step_env: Callable[[Environment, str], EnvStep] | None = None,
    reraise: tuple[type[BaseException], ...] = (), key_prefix: str = "trajectory-",
) -> list[Trajectory]:
    """``group`` trajectories of every task, prompt-major (task 0's first), driven to their ends.

    Each turn, every trajectory still going is sampled once (one batched ``generate``), its turn decoded
    (``decode``, special tokens kept, the stop token cut) and stepped in its own environment; a reply that does not
    end it is appended as the template's delta. Budgets: ``spec.max_turns`` model turns, ``spec.max_tokens_per_turn``
    tokens a turn, ``spec.max_trajectory_tokens`` tokens after the prompt and ``max_context`` positions in all.
    ``release(key)`` is told each trajectory's key once it ends (an engine drops the K/V it kept for it).

    ``step_env(env, text)`` steps one environment (default :func:`step_with_timeout` with ``spec.step_timeout_s``;
    an environment that bounds its own steps, as the stack's remote one does, is stepped directly). An exception of
    ``reraise`` (e.g. the environment's host is unreachable: not the environment's failure) propagates instead of
    ending the trajectory ``env_error``. Keys are ``key_prefix`` + a batch number + the trajectory's index.
    """
    step_env = step_env or (lambda env, text: step_with_timeout(env, text, spec.step_timeout_s))
    batch = next(_BATCHES)
    stops = set(stop_ids)
    trajs: list[Trajectory] = []
    openings: dict[str, tuple[int, ...]] = {}
    envs: list[Environment] = []
    tools: list[list[dict]] = []
    for i, task in enumerate(tasks):
        for _ in range(group):
            env = make_env()
            opening = env.reset(dict(task))
            tl = env.tools()
            # a task's G trajectories open alike: rendered once (the messages compared, never assumed equal)
            key = json.dumps([opening, tl], sort_keys=True, default=repr)
            if key not in openings:
                openings[key] = tuple(renderer.opening(opening, tl))
            t = Trajectory(i, openings[key], messages=list(opening))
            trajs.append(t)
            envs.append(env)
            tools.append(tl)
    for turn in range(spec.max_turns):
        active = [k for k, t in enumerate(trajs) if not t.done]
        for k in list(active):  # room for one more whole turn, or the policy ran out of budget
            t = trajs[k]
            if len(t.token_ids) + spec.max_tokens_per_turn > spec.max_trajectory_tokens or \
                    len(t.prompt_ids) + len(t.token_ids) + spec.max_tokens_per_turn > max_context:
                t.end("budget", 0.0)
                active.remove(k)
        if not active:
            break
        samples = generate([trajs[k].ids for k in active], spec.max_tokens_per_turn, turn,
                           [f"{key_prefix}{batch}-{k}" for k in active])
        for k, s in zip(active, samples, strict=True):
            t, env = trajs[k], envs[k]
            t.add_model(s)
            ids = list(s.token_ids)
            if ids and ids[-1] in stops:
                ids = ids[:-1]
            text = decode(ids)
            t.messages.append({"role": "assistant", "content": text})
            calls = parse_tool_calls(text)
            t.tool_calls += sum(1 for c in calls if hasattr(c, "name"))
            t.tool_errors += sum(1 for c in calls if not hasattr(c, "name"))
            t0 = time.perf_counter()
            try:
                st = step_env(env, text)
            except reraise:
                raise
            except TimeoutError:
                t.env_seconds += time.perf_counter() - t0
                t.end("env_timeout", None)
                continue
            except Exception as e:  # noqa: BLE001 - any failure of the environment ends only this trajectory
                t.env_seconds += time.perf_counter() - t0
                t.messages.append({"role": "tool", "content": f"environment error: {type(e).__name__}: {e}"[:500]})
                t.end("env_error", None)
                continue
            t.env_seconds += time.perf_counter() - t0
            t.env_info.update({k: float(v) for k, v in st.info.items()
                               if isinstance(v, int | float) and not isinstance(v, bool)})
            if isinstance(st.info.get("tool_errors"), int | float):  # the environment's own (cumulative) count wins
                t.tool_errors = int(st.info["tool_errors"])
            if st.done:
                t.messages += st.messages
                t.end("done", float(st.reward))
                continue
            if s.finish_reason == "length":  # the turn was cut: its end-of-turn token is written in as context
                t.add_env([renderer.end_of_turn_id])
                t.cut_turns += 1
            delta, prefix_ok = renderer.delta(t.messages, st.messages, tools[k])
            t.prefix_breaks += int(not prefix_ok)
            t.messages += st.messages
            t.add_env(delta)
    for t in trajs:
        if not t.done:
            t.end("max_turns", 0.0)
    if release is not None:
        for k in range(len(trajs)):
            release(f"{key_prefix}{batch}-{k}")
    return trajs


def trajectory_metrics(trajs: Sequence[Trajectory], step_seconds: float | None = None) -> dict[str, float]:
    """The step's ``env/*`` metrics: turns per trajectory, tool calls and errors, masked (environment) tokens,
    ungraded trajectories, prefix breaks, ends by reason, the environments' own counters summed (``env/info/*``:
    the sandbox's runs, start and wall seconds, kills by reason), and the environment's time (and its share of
    ``step_seconds``, the rollout phase's: ``env/share_of_rollout``; the step's train phase adds
    ``env/share_of_step``)."""
    if not trajs:
        return {}
    n = len(trajs)
    own = [[v for v, m in zip(t.versions, t.token_mask, strict=True) if m] for t in trajs]  # model tokens' versions
    versions = [len(set(vs)) for vs in own]
    tokens = sum(len(vs) for vs in own)
    stale = sum(sum(v < max(vs) for v in vs) for vs in own if vs)  # sampled by a version older than its newest
    out = {
        "env/turns_mean": sum(t.turns for t in trajs) / n,
        "env/turns_max": float(max(t.turns for t in trajs)),
        "env/tool_calls_per_trajectory": sum(t.tool_calls for t in trajs) / n,
        "env/tool_call_rate": sum(t.tool_calls > 0 for t in trajs) / n,
        "env/tool_errors": float(sum(t.tool_errors for t in trajs)),
        "env/masked_tokens": float(sum(len(t.token_mask) - sum(t.token_mask) for t in trajs)),
        "env/model_tokens": float(sum(sum(t.token_mask) for t in trajs)),
        "env/ungraded": float(sum(not t.graded for t in trajs)),
        "env/prefix_breaks": float(sum(t.prefix_breaks for t in trajs)),
        "env/cut_turns": float(sum(t.cut_turns for t in trajs)),
        "env/seconds": sum(t.env_seconds for t in trajs),
        # env.partial interrupt: the versions a trajectory's model tokens were sampled by (1 each under finish)
        "env/versions_per_trajectory": sum(versions) / n,
        "env/interrupted": float(sum(k > 1 for k in versions)),
        "env/tokens_per_version": tokens / max(1, sum(versions)),  # model tokens each version sampled, per trajectory
        "env/stale_token_share": stale / max(1, tokens),  # model tokens older than their trajectory's newest version
    }
    for reason in END_REASONS:
        out[f"env/end/{reason}"] = float(sum(t.end_reason == reason for t in trajs))
    for key in sorted({k for t in trajs for k in t.env_info} - {"tool_calls", "tool_errors"}):
        out[f"env/info/{key}"] = sum(t.env_info.get(key, 0.0) for t in trajs)  # the environments' own counters
    if step_seconds:
        out["env/share_of_rollout"] = out["env/seconds"] / step_seconds
    return out


def trajectories_markdown(trajs: Sequence[Trajectory], decode: Callable[[Sequence[int]], str], *,
                          title: str = "Trajectories") -> str:
    """A few trajectories for a report, their exact tokens decoded segment by segment: the prompt and the
    environment's replies as quoted context, the model's turns as code (what was trained), with each one's end
    reason, reward and turns."""
    out = [f"# {title}", ""]
    for n, t in enumerate(trajs):
        reward = "ungraded" if t.reward is None else f"{t.reward:g}"
        out += [f"## trajectory {n} (task {t.prompt_index}): {t.end_reason}, reward {reward}, {t.turns} model turns, "
                f"{t.tool_calls} tool calls", "", "**prompt** (context):", "", *_quoted(decode(t.prompt_ids)), ""]
        start = 0
        for source, length in t.segments:
            text = decode(t.token_ids[start:start + length])
            start += length
            if source == "model":
                out += [f"**model** ({length} tokens, trained):", "", "```", text.replace("```", "` ` `"), "```", ""]
            else:
                out += [f"**environment** ({length} tokens, context):", "", *_quoted(text), ""]
    return "\n".join(out) + "\n"


def _quoted(text: str) -> list[str]:
    return [f"> {line}" if line else ">" for line in text.split("\n")]
