"""Small environments written against OpenEnv's own base classes (``openenv-core`` ships none that fit a unit test):
what a user brings to the openenv adapter. Imported only where ``openenv-core`` is installed (the adapters tier)."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core import Action, Environment, Observation, State
from pydantic import Field


class SayAction(Action):
    text: str = Field(...)


class HintObservation(Observation):
    text: str = ""


class GuessWordOpenEnv(Environment[SayAction, HintObservation, State]):
    """The model must say the task's answer; a wrong turn gets a hint (reward 0), three turns at most. ``reset``
    takes the task (OpenEnv's ``**kwargs``)."""

    def __init__(self, max_turns: int = 3) -> None:
        super().__init__()
        self.max_turns, self.word = max_turns, ""
        self._state = State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> HintObservation:
        self.word = str(kwargs["task"]["answer"])
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return HintObservation(text="Say the number.")

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> HintObservation:
        self._state.step_count += 1
        if self.word in action.text:
            return HintObservation(text="Right.", done=True, reward=1.0)
        if self._state.step_count >= self.max_turns:
            return HintObservation(text="Out of turns.", done=True, reward=0.0)
        return HintObservation(text=f"No. It has {len(self.word)} digits.", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class TwoTextsObservation(Observation):
    text: str = ""
    note: str = ""


class Crashing(Environment[SayAction, TwoTextsObservation, State]):
    """Two str fields in its observation (the adapter must be told which to show) and a step that raises."""

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> TwoTextsObservation:
        return TwoTextsObservation(text="go", note="internal")

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> TwoTextsObservation:
        raise RuntimeError("the environment's own bug")

    @property
    def state(self) -> State:
        return State()


class NotAnEnvironment:
    pass
