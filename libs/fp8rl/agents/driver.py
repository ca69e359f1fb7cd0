"""An agent job's rollout over an embedded engine: the endpoint started once, each phase's agents run on it.

The loop (training steps and validation) and ``python -m fp8rl.eval`` (scoring a trained policy with the agent it
was trained with) both drive agents this way, so the agent a user trained is the one they measure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fp8rl.endpoint import EndpointConfig, EndpointLimits, OpenAIEndpoint
from fp8rl.envs.trajectory import Trajectory

from .runner import load_agent, run_agents

if TYPE_CHECKING:
    from fp8rl.config import JobConfig

__all__ = ["AgentDriver"]


class AgentDriver:
    """Runs a job's agents (its ``agent`` section) on one engine (``generate(prompts, params, *, weight_version,
    sessions)``, ``max_len``, ``weight_version``, ``drop_session``).

    Args:
        job: the agent job (``agent.*``; ``policy.generation.top_p``: every call samples at it).
        engine, tokenizer: the rollout engine and the policy's tokenizer (what the endpoint renders with).
        vocab_size, model_name: what the endpoint checks ids against and reports.
        grade: ``grade(text, answer)`` for an agent that returns a text.
    """

    def __init__(self, job: JobConfig, engine: Any, tokenizer: Any, *, vocab_size: int, model_name: str,
                 grade: Callable[[str, str], float]) -> None:
        self.settings, self.top_p, self.grade = job.agent, job.policy.generation.top_p, grade
        self.fn = load_agent(job.agent.entrypoint)
        self._version = 0
        cfg = EndpointConfig(model_name=model_name, limits=self._limits(1.0),
                             session_max_tokens=job.agent.max_trajectory_tokens)
        self.endpoint = OpenAIEndpoint(
            lambda p, params, keys: engine.generate(p, params, weight_version=self._version, sessions=keys),
            tokenizer, vocab_size=vocab_size, max_len=engine.max_len, config=cfg,
            weight_version=lambda: engine.weight_version, drop_session=engine.drop_session)
        self.base_url = f"http://127.0.0.1:{self.endpoint.start()}/v1"

    def _limits(self, temperature: float) -> EndpointLimits:
        s = self.settings
        return EndpointLimits(max_tokens=s.max_tokens_per_call, default_max_tokens=s.max_tokens_per_call,
                              temperature=temperature, top_p=self.top_p)

    def run(self, problems: Sequence[Any], openings: Sequence[Sequence[int]], version: int, *, n: int,
            temperature: float, tag: str) -> list[Trajectory]:
        """``n`` trajectories of every problem (``prompt``, ``answer``: the agent's task) at ``version`` and
        ``temperature`` (the calls may not ask for another), prompt-major."""
        self.endpoint.cfg = replace(self.endpoint.cfg, limits=self._limits(temperature))
        self._version = version
        s = self.settings
        tasks = [{"question": p.prompt, "answer": p.answer} for p in problems]
        return run_agents(self.fn, tasks, n, self.endpoint, self.base_url, concurrency=s.concurrency,
                          timeout_s=s.timeout_s, grade=self.grade, openings=openings, version=version, tag=tag)

    def close(self) -> None:
        self.endpoint.stop()
