"""What running agents in the sandbox costs (agent jobs on the stack) against running them in-process (the loop).

    python bench/agent_sandbox.py [--agents 16 --slots 2 --repeats 3]

One endpoint (``fp8rl.endpoint.OpenAIEndpoint``) over an embedded engine holding a seeded random 2-layer Llama with
a ChatML tokenizer (the tests' chat model; fp8_e2e, FP8 KV, batch invariance). The same agents
(``bench/endpoint_agents.py``: ``two_turns``, two calls of 8 tokens; ``no_call``, which returns at once) run

* **in-process**: ``fp8rl.agents.run_agents`` — threads of this process, each with its ``openai`` client;
* **sandboxed**: as the reward service runs them on the stack — each in bubblewrap
  (``fp8rl.agents.sandboxed.run_sandboxed_agent``, ``--slots`` at once), its client on an
  ``fp8rl.agents.proxy.AgentProxy`` socket to the same endpoint.

Prints the wall time of each batch (median of ``--repeats``), ``ratio sandboxed/in_process`` of each agent (both
measured in this run), and the start cost of one sandboxed agent (``no_call``: bubblewrap, the interpreter,
``import openai``). Needs bubblewrap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))  # endpoint_agents: the sandbox mounts its file

    from fp8rl.agents import load_agent, run_agents
    from fp8rl.agents.proxy import AgentProxy
    from fp8rl.agents.sandboxed import run_sandboxed_agent, sandbox_python_problem
    from fp8rl.config import parse_job_config
    from fp8rl.endpoint import EndpointConfig, EndpointLimits, OpenAIEndpoint
    from fp8rl.envs.sandbox import SandboxPool, sandbox_problem
    from fp8rl.loop import GRPOLoop, LoopConfig
    from fp8rl.presets.chatml import random_chat_checkpoint

    if problem := sandbox_problem() or sandbox_python_problem():
        sys.exit(f"no agent sandbox here: {problem}")
    model = random_chat_checkpoint(Path(tempfile.mkdtemp(prefix="bench-agent-sandbox-")) / "model",
                                   max_position_embeddings=2048)
    job = {"job": {"name": "bench-agent-sandbox", "steps": 1, "seed": 0, "checkpoint_every": 0},
           "policy": {"model": str(model), "generation": {"vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "fp8"}},
                      "training": {"megatron_cfg": {"fp8_cfg": {"enabled": True}}}},
           "data": {"task": "arith"}}
    loop = GRPOLoop(LoopConfig(parse_job_config(job)))
    eng = loop.rollout
    ep = OpenAIEndpoint(lambda p, params, keys: eng.generate(p, params, sessions=keys), loop.tok,
                        vocab_size=eng.model.config.vocab_size, max_len=eng.max_len,
                        config=EndpointConfig(model_name="policy", limits=EndpointLimits(temperature=1.0, top_p=1.0)),
                        weight_version=lambda: eng.weight_version, drop_session=eng.drop_session)
    base = f"http://127.0.0.1:{ep.start()}/v1"
    tasks = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(a.agents)]
    proxy, pool = AgentProxy(timeout_s=600), SandboxPool(a.slots, uid_base=61000, queue_timeout_s=600)

    def in_process(name: str) -> float:
        t0 = time.perf_counter()
        trajs = run_agents(load_agent(f"endpoint_agents:{name}"), tasks, 1, ep, base, concurrency=a.slots,
                           timeout_s=300, grade=lambda text, ans: float(ans in text), openings=[[1]] * len(tasks),
                           version=0, tag=f"in-{name}")
        assert all(t.end_reason in ("done", "env_error") for t in trajs)
        return time.perf_counter() - t0

    def sandboxed(name: str) -> float:
        def one(k: int):
            sid = f"sb-{name}-{time.monotonic_ns()}-{k}"
            d = proxy.open(sid, base, temperature=1.0, top_p=1.0, max_tokens=8)
            try:
                r = run_sandboxed_agent(pool, f"endpoint_agents:{name}", tasks[k], d, timeout_s=300,
                                        give=lambda uid: proxy.give_to(sid, uid))
            finally:
                proxy.close(sid)
            if r.end != "done":
                sys.exit(f"a sandboxed agent failed: {r.error}")

        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.slots) as ex:
            list(ex.map(one, range(len(tasks))))
        return time.perf_counter() - t0

    try:
        rows = {}
        for name in ("no_call", "two_turns"):
            ins = statistics.median(in_process(name) for _ in range(a.repeats))
            sbx = statistics.median(sandboxed(name) for _ in range(a.repeats))
            rows[name] = (ins, sbx)
            print(f"{name:>9}: {a.agents} agents, {a.slots} at once: in-process {ins:.2f} s, sandboxed {sbx:.2f} s "
                  f"(ratio sandboxed/in_process {sbx / ins:.1f}); per sandboxed agent "
                  f"{sbx / a.agents * a.slots:.2f} s of a slot")
        start = rows["no_call"][1] / a.agents * a.slots
        print(f"start cost of one sandboxed agent (bubblewrap + interpreter + import openai): {start:.2f} s of a "
              f"slot; two_turns' sandboxed overhead per agent: "
              f"{(rows['two_turns'][1] - rows['two_turns'][0]) / a.agents * a.slots:.2f} s of a slot")
    finally:
        proxy.shutdown()
        ep.stop()


if __name__ == "__main__":
    main()
