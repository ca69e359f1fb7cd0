"""Tokens/s through a rollout replica's OpenAI-compatible endpoint vs its gRPC Generate, same process, same job.

    python bench/endpoint.py [--job deploy/default-job.yaml --sessions 1 16 64 --max-tokens 16 --repeats 3]

Starts the stack (``python -m deploy.launcher up``) with ``FP8RL_OPENAI_PORT=0`` — every rollout replica also
serves the endpoint on a free loopback port, read from its log — asks the calibrator for version 0's QKV scales
(what the controller does at a job's start), then, for each session count S:

* **gRPC**: one ``Generate`` of S prompts (n = 1; how the controller calls a replica for a turn);
* **endpoint**: S concurrent ``/v1/completions`` calls through the real ``openai`` client, one prompt each, each its
  own session (``X-Session-Id``), then a second turn of each session (the first turn's tokens + a few more: the
  engine reuses the session's K/V).

Each is repeated and the median taken. Prints generated tokens/s of both, ``ratio endpoint/grpc_tokens_per_s``
(target >= 0.9 at the larger session counts, where the endpoint batches concurrent calls into engine calls) and the
per-call latency p50 / p95 at each session count (the latency of one agent's turn). The endpoint's cost is HTTP +
JSON + the batcher per call; the engine work is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=str(REPO / "deploy" / "default-job.yaml"))
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import openai

    from fp8rl.config import load_job_config
    from fp8rl.controller.plan import JobPlan
    from fp8rl.rpc import calibrator_pb2, calibrator_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc
    from fp8rl.rpc.channel import make_channel

    job = load_job_config(a.job)
    plan = JobPlan("bench", job, Path(a.job).parent)
    prompts = [p for i in range(8) for p in plan.prompts(plan.batch(i))][:max(a.sessions)]
    run_dir = Path(tempfile.mkdtemp(prefix="bench-endpoint-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_") or k in ("FP8RL_REDIS_SERVER",
                                                                                         "FP8RL_CACHE")}
    env["FP8RL_OPENAI_PORT"] = "0"
    up = subprocess.run([sys.executable, "-m", "deploy.launcher", "up", "--job", a.job, "--run-dir", str(run_dir)],
                        cwd=REPO, env=env, capture_output=True, text=True)
    if up.returncode:
        sys.exit(f"launcher up failed:\n{up.stderr[-3000:]}")
    try:
        info = json.loads((run_dir / "stack.json").read_text())
        proc = {p["name"]: p for p in info["processes"]}
        token = Path(info["secrets"]["service_token_file"]).read_text().strip()
        log = (run_dir / "logs" / "rollout-0.log").read_text()
        port = int(re.search(r"OpenAI-compatible endpoint on http://127\.0\.0\.1:(\d+)/v1", log)[1])
        roll = rollout_pb2_grpc.RolloutServiceStub(make_channel(f"127.0.0.1:{proc['rollout-0']['port']}",
                                                                token=token, tls_ca=""))
        cal = calibrator_pb2_grpc.CalibratorServiceStub(make_channel(f"127.0.0.1:{proc['calibrator']['port']}",
                                                                     token=token, tls_ca=""))
        cal.Calibrate(calibrator_pb2.CalibrateRequest(version=0, sequences=[
            common_pb2.TokenSequence(token_ids=p) for p in prompts[:16]]), timeout=120)
        t0 = time.monotonic()
        while not roll.Status(rollout_pb2.RolloutStatusRequest(), timeout=10).ready:
            if time.monotonic() - t0 > 120:
                sys.exit("the rollout replica did not become ready")
            time.sleep(0.2)
        version = roll.Status(rollout_pb2.RolloutStatusRequest(), timeout=10).weight_version
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=300)

        def health() -> dict:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as resp:
                return json.loads(resp.read())

        print(f"# endpoint vs gRPC Generate, {time.strftime('%Y-%m-%d')}, job {Path(a.job).name}, "
              f"max_tokens {a.max_tokens}, {a.repeats} repeats (median)")

        def grpc_once(s: int) -> tuple[int, float]:
            req = rollout_pb2.GenerateRequest(request_id="bench", weight_version=version,
                                              prompts=[rollout_pb2.Prompt(token_ids=p) for p in prompts[:s]],
                                              sampling=rollout_pb2.SamplingParams(max_tokens=a.max_tokens, n=1,
                                                                                  temperature=1.0))
            t = time.perf_counter()
            out = [r.sample for r in roll.Generate(req, timeout=600)]
            return sum(len(x.token_ids) for x in out), time.perf_counter() - t

        def endpoint_once(s: int, rep: int) -> tuple[int, float, list[float]]:
            def agent(i: int) -> tuple[int, list[float]]:
                sid, lat, n = f"b{s}-{rep}-{i}", [], 0
                ids = list(prompts[i])
                for _turn in range(2):
                    t = time.perf_counter()
                    r = client.completions.create(model="m", prompt=[ids], max_tokens=a.max_tokens,
                                                  extra_headers={"X-Session-Id": sid})
                    lat.append(time.perf_counter() - t)
                    gen = r.choices[0].model_extra["generation_token_ids"]
                    n += len(gen)
                    ids = ids + gen + list(prompts[(i + 1) % len(prompts)][-3:])  # the next turn: a few more tokens
                client.delete(f"/fp8rl/sessions/{sid}", cast_to=object)
                return n, lat

            t = time.perf_counter()
            with ThreadPoolExecutor(s) as ex:
                got = list(ex.map(agent, range(s)))
            return sum(n for n, _ in got), time.perf_counter() - t, [x for _, lat in got for x in lat]

        def raw_once(s: int, rep: int) -> tuple[int, float, list[float]]:
            """The same two turns per session over plain aiohttp (one event loop, no SDK): the endpoint's own cost."""
            import asyncio

            import aiohttp

            async def run() -> list[tuple[int, list[float]]]:
                async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
                    async def agent(i: int) -> tuple[int, list[float]]:
                        sid, lat, n, ids = f"r{s}-{rep}-{i}", [], 0, list(prompts[i])
                        for _turn in range(2):
                            t = time.perf_counter()
                            async with http.post("/v1/completions", json={"prompt": [ids], "max_tokens": a.max_tokens},
                                                 headers={"X-Session-Id": sid}) as resp:
                                body = await resp.json()
                            lat.append(time.perf_counter() - t)
                            gen = body["choices"][0]["generation_token_ids"]
                            n += len(gen)
                            ids = ids + gen + list(prompts[(i + 1) % len(prompts)][-3:])
                        async with http.delete(f"/v1/fp8rl/sessions/{sid}"):
                            pass
                        return n, lat

                    return await asyncio.gather(*(agent(i) for i in range(s)))

            t = time.perf_counter()
            got = asyncio.run(run())
            return sum(n for n, _ in got), time.perf_counter() - t, [x for _, lat in got for x in lat]

        grpc_once(min(a.sessions))  # warm-up
        for s in a.sessions:
            g = [grpc_once(s) for _ in range(a.repeats)]
            g_tps = statistics.median(n / t for n, t in g)
            g2 = [grpc_once(s) for _ in range(a.repeats)]  # two turns' worth, as the endpoint's agents run
            g_tps = statistics.median([g_tps, *(n / t for n, t in g2)])
            before = health()
            e = [endpoint_once(s, r) for r in range(a.repeats)]
            after = health()
            calls, engine_calls = after["calls"] - before["calls"], after["engine_calls"] - before["engine_calls"]
            e_tps = statistics.median(n / t for n, t, _ in e)
            r = [raw_once(s, rep) for rep in range(a.repeats)]
            r_tps = statistics.median(n / t for n, t, _ in r)
            lat = sorted(x for _, _, xs in e for x in xs)
            p50, p95 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.95 * len(lat)))]
            print(f"sessions {s:3d}: gRPC {g_tps:8.1f} tok/s | endpoint {e_tps:8.1f} tok/s | per-turn latency p50 "
                  f"{p50 * 1e3:7.1f} ms p95 {p95 * 1e3:7.1f} ms | ratio endpoint/grpc_tokens_per_s "
                  f"{e_tps / g_tps:.2f} ({calls} calls in {engine_calls} engine calls); plain aiohttp client "
                  f"{r_tps:8.1f} tok/s, ratio endpoint_raw/grpc_tokens_per_s {r_tps / g_tps:.2f}")
    finally:
        subprocess.run([sys.executable, "-m", "deploy.launcher", "down", "--run-dir", str(run_dir)], cwd=REPO,
                       env=env, capture_output=True, text=True)


if __name__ == "__main__":
    main()
