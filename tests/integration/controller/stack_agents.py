"""Agents the stack's agent-job tests run (``agent.entrypoint: stack_agents:NAME``): the reward service is started
with ``--env-module stack_agents`` and runs them in its sandbox. Self-contained: the sandbox mounts this module's
file, the service's site-packages and fp8rl, nothing else of the tests."""

from __future__ import annotations

import json
import os
import socket


def two_turns(task, client):
    """Asks, then asks it to check its answer, sending the assistant message back as the client returned it (its
    token ids ride along and are spliced); the last answer's text is graded against the task's answer."""
    msgs = [{"role": "user", "content": str(task["question"])}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Check it."}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=6)
    return r.choices[0].message.content or ""


def escape(task, client):
    """One model call, then what the task's answer asks: ``hang`` (past agent.timeout_s), ``raise``, or ``probe`` —
    try every way out the task's question names (a file of the host, a TCP port on loopback, the service's
    environment) and return 1.0 only when each one failed."""
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    what = task["answer"]
    if what == "hang":
        while True:
            pass
    if what == "raise":
        raise RuntimeError("the agent's own tool crashed")
    target = json.loads(task["question"])
    escaped = []
    try:
        with open(target["file"]) as f:
            f.read()
        escaped.append("read a host file")
    except OSError:
        pass
    try:
        socket.create_connection(("127.0.0.1", int(target["port"])), timeout=2).close()
        escaped.append("reached a loopback port")
    except OSError:
        pass
    if set(os.environ) - {"PATH", "HOME", "PWD", "LC_CTYPE"}:  # the sandbox sets these; Python coerces the locale
        escaped.append(f"saw the environment {sorted(os.environ)}")
    if escaped:
        print("escaped:", escaped)
        return 0.0
    return 1.0
