"""Agents for the benches (``agent.entrypoint: endpoint_agents:NAME`` with ``bench/`` on the path): written as a user
writes one, against the ``openai`` client alone — plus fp8rl's sandboxed python tool, which they call themselves."""

from __future__ import annotations

import json

from fp8rl.envs import format_tool_call, make_env

MAX_TURNS = 3  # deploy/python-job-tiny.yaml's env.max_turns
MAX_TOKENS = 96  # its env.max_tokens_per_turn


def python_tool(task, client):
    """The python environment's episode driven by an agent through the endpoint: the same opening messages and
    tools (the environment's), each model turn's tool calls run in the bubblewrap sandbox and sent back as tool
    messages, the assistant message sent back as returned (its token ids spliced). Its reward is the environment's;
    past MAX_TURNS turns, 0."""
    env = make_env("python")
    messages, tools = env.reset(task), env.tools()
    for _ in range(MAX_TURNS):
        r = client.chat.completions.create(model="policy", messages=messages, tools=tools or None,
                                           max_tokens=MAX_TOKENS)
        msg = r.choices[0].message
        text = (msg.content or "") + "".join(
            "\n" + format_tool_call(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or [])
        out = env.step(text)
        if out.done:
            return out.reward
        messages += [msg.model_dump(exclude_none=True), *out.messages]
    return 0.0


def two_turns(task, client):
    """Asks, then asks it to check its answer, the assistant message sent back as returned; the last text is the
    reward's (graded). bench/agent_sandbox.py runs it in-process and in the sandbox."""
    msgs = [{"role": "user", "content": str(task["question"])}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Check it."}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
    return r.choices[0].message.content or ""


def no_call(task, client):
    """Returns at once: what starting an agent costs (the sandbox, the interpreter, importing openai)."""
    return 1.0
