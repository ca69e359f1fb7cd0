"""An agent job's rollout over an embedded engine: the endpoint started once, each phase's agents run on it.

The loop (training steps and validation) and ``python -m fp8rl.eval`` (scoring a trained policy with the agent it
was trained with) both drive agents this way, so the agent a user trained is the one they measure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fp8rl.endpoint import EndpointConfig, EndpointLimits, OpenAIEndpoint
from fp8rl.envs.trajectory import Trajectory

from .runner import load_agent, run_agents

__all__ = ["AgentDriver", "AgentSettings"]


@dataclass(frozen=True)
class AgentSettings:
    """A job's ``agent`` section, as plain values (``JobConfig.agent`` has these names)."""

    entrypoint: str
    concurrency: int = 16
    timeout_s: float = 300.0
    max_tokens_per_call: int = 256
    max_trajectory_tokens: int = 4096


class AgentDriver:
    """Runs an agent job's agents on one engine (its ``generate(prompts, params, *, weight_version, sessions)``).

    Args:
        settings: the job's agent section.
        engine: the rollout engine (``generate``, ``max_len``, ``weight_version``, ``drop_session``).
        tokenizer, vocab_size, model_name: what the endpoint renders with and reports.
        top_p: the job's ``policy.generation.top_p`` (every call samples at it).
        grade: ``grade(text, answer)`` for an agent that returns a text.
    """

    def __init__(self, settings: AgentSettings, engine: Any, tokenizer: Any, *, vocab_size: int, model_name: str,
                 top_p: float, grade: Callable[[str, str], float]) -> None:
        self.settings, self.engine, self.top_p, self.grade = settings, engine, top_p, grade
        self.fn = load_agent(settings.entrypoint)
        self._version = 0
        cfg = EndpointConfig(model_name=model_name, limits=self._limits(1.0),
                             session_max_tokens=settings.max_trajectory_tokens)
        self.endpoint = OpenAIEndpoint(
            lambda p, params, keys: engine.generate(p, params, weight_version=self._version, sessions=keys),
            tokenizer, vocab_size=vocab_size, max_len=engine.max_len, config=cfg,
            weight_version=lambda: engine.weight_version, drop_session=engine.drop_session)
        self.base_url = f"http://127.0.0.1:{self.endpoint.start()}/v1"

    def _limits(self, temperature: float) -> EndpointLimits:
        s = self.settings
        return EndpointLimits(max_tokens=s.max_tokens_per_call, default_max_tokens=s.max_tokens_per_call,
                              temperature=temperature, top_p=self.top_p)

    def run(self, tasks: Sequence[dict], openings: Sequence[Sequence[int]], version: int, *, n: int,
            temperature: float, tag: str) -> list[Trajectory]:
        """``n`` trajectories of every task at ``version`` and ``temperature`` (the calls may not ask for
        another), prompt-major."""
        self.endpoint.cfg = replace(self.endpoint.cfg, limits=self._limits(temperature))
        self._version = version
        s = self.settings
        return run_agents(self.fn, tasks, n, self.endpoint, self.base_url, concurrency=s.concurrency,
                          timeout_s=s.timeout_s, grade=self.grade, openings=openings, version=version, tag=tag)

    def close(self) -> None:
        self.endpoint.stop()
