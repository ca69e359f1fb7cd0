"""Bring your own agent (issue 51): user functions that drive the policy through the OpenAI-compatible endpoint,
their sessions trained as multi-turn trajectories (:mod:`.runner`)."""

from .driver import AgentDriver
from .runner import AgentResult, load_agent, run_agents, trajectory_of_session

__all__ = ["AgentDriver", "AgentResult", "load_agent", "run_agents", "trajectory_of_session"]
