"""Agents for the bring-your-own-agent tests (agent.entrypoint: tests.e2e.byo_agents:NAME): plain functions of a task
and an ``openai.OpenAI`` client, as a user writes them."""

from __future__ import annotations

import threading


def two_turns(task, client):
    """Asks, then asks it to check its answer, sending the assistant message back as the client returned it; the
    last answer's text is the reward's (graded against the task's answer)."""
    msgs = [{"role": "user", "content": str(task["question"])}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Check it."}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    return r.choices[0].message.content or ""


_calls = {"n": 0}
_lock = threading.Lock()


def flaky(task, client):
    """Every third agent raises after its first call, and every fourth makes no call at all; the others return a
    number (the length of the model's answer, a reward of its own choosing)."""
    with _lock:
        _calls["n"] += 1
        k = _calls["n"]
    if k % 4 == 0:
        return 1.0  # no model call: nothing to train on, ungraded whatever it returns
    r = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    if k % 3 == 0:
        raise RuntimeError("the agent's own tool crashed")
    return float(len(r.choices[0].message.content or ""))


def hot(task, client):
    """Asks for another temperature than the job's: refused by the endpoint, so this agent fails."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], temperature=1.7)
    return 1.0


def parity(task, client):
    """One model call, then the reward of the task alone (1 when its answer is even): an evaluation through the
    agent measures exactly this, whatever the random policy writes."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": str(task["question"])}],
                                   max_tokens=2)
    return float(int(task["answer"]) % 2 == 0)
