"""Learning on a tool environment (issue 48: calculator; issue 50: python, ``deploy/python-job-tiny.yaml``): tool use
and accuracy before → after, over seeds, with the tools-disabled control — every number from this one run.

    python bench/agent_learning.py [--config deploy/tool-job-tiny.yaml] [--seeds 0 1 2] [--steps 30] [--prompts N]
                                   [--group N] [--lr LR] [--arms tools control] [--parallel N --threads T]
                                   [--agent endpoint_agents:python_tool]

``--agent MODULE:FUNCTION`` (issue 51) runs the same job as an agent job: the environment's tasks written to a
JSON-lines file (``data.task: jsonl``), no ``env`` section, ``agent.entrypoint`` the function — which drives the
policy through the loop's OpenAI-compatible endpoint (``bench/endpoint_agents.py:python_tool`` runs the python
environment's episode itself, its calls in the sandbox); training and both measurements go through it. The tools
arm only (an agent has no control switch).

For each seed it runs ``--config`` (default ``deploy/tool-job-tiny.yaml``: the tiny-arith-tool preset, fp8_e2e + FP8
KV; ``deploy/tool-job.yaml`` is SmolLM2-135M-Instruct) in the in-process loop twice: with the calculator, and with
``env.kwargs.tools_enabled: false`` (the control: the same prompt and tools, every call answered "unavailable");
``--prompts``, ``--group`` and ``--lr`` override the job file's settings. Before step 0 and after the last step it
measures, on ``--eval-tasks`` held-out tasks with ``--eval-samples`` trajectories each at temperature 1 through the
rollout engine (the deployed numerics), the **accuracy** (share of trajectories rewarded) and the **tool-call rate**
(share of trajectories that called the calculator). It prints each run's line and then, per arm, the mean gain and
its spread over seeds (sample standard deviation), and whether the gain is at least twice that spread:

    ratio accuracy_gain/spread tools X        ratio accuracy_gain/spread control X

The statistic is a mean over ``eval_tasks × eval_samples`` Bernoulli draws per measurement; its noise shows in
the spread over seeds (each seed changes the task stream, the sampling and the warm start's RNG use), which is
what the issue's margin (gain ≥ 2 × spread) is stated against.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "libs"))

from fp8rl.config import load_job_config  # noqa: E402
from fp8rl.controller.plan import env_tasks  # noqa: E402
from fp8rl.envs.trajectory import trajectory_metrics  # noqa: E402
from fp8rl.loop import GRPOLoop, LoopConfig  # noqa: E402

EVAL_SEED = 1 << 50  # held-out tasks: a seed stream no training step draws from
EVAL_CHUNK = 16  # held-out tasks generated together


def measure(loop: GRPOLoop, env_job, tasks: int, samples: int, seed: int) -> dict[str, float]:
    """Accuracy and tool-call rate of ``samples`` trajectories of each of ``tasks`` held-out tasks (``env_job``'s
    environment's), at temperature 1, through the rollout engine at the version it holds (an agent job: through
    its agent)."""
    problems = env_tasks(env_job, tasks, EVAL_SEED + seed)
    trajs = []
    # EVAL_CHUNK tasks at a time: their trajectories' K/V sessions fit the rollout's bound (all 256 at once evicted
    # some, and the whole batch's re-prefill that forced ran out of memory)
    for i in range(0, tasks, EVAL_CHUNK):
        part = problems[i:i + EVAL_CHUNK]
        pairs = loop.backends.generate(loop.plan.prompts(part), loop.rollout.weight_version,
                                       step=10**6 + seed * 1000 + i, n=samples, temperature=1.0, problems=part)
        trajs += [t for _, t in pairs]
    m = trajectory_metrics(trajs)
    graded = [t.reward for t in trajs if t.reward is not None]
    return {"accuracy": sum(r > 0.5 for r in graded) / max(1, len(graded)), "tool_call_rate": m["env/tool_call_rate"],
            "turns": m["env/turns_mean"]}


def one_run(seed: int, tools: bool, args) -> dict[str, float]:
    settings = {"job.seed": seed, "job.steps": args.steps, "job.checkpoint_every": 0,
                "env.kwargs": {"tools_enabled": tools}}
    for key, value in (("grpo.num_prompts_per_step", args.prompts), ("grpo.num_generations_per_prompt", args.group),
                       ("policy.training.lr", args.lr)):
        if value is not None:  # else the job file's
            settings[key] = value
    env_job = job = load_job_config(args.config).with_settings(settings)
    data_root = None
    if args.agent:
        job = as_agent_job(job, args.agent, seed)
        data_root = str(Path(job.data.path).parent)
    loop = GRPOLoop(LoopConfig(job, data_root=data_root))
    before = measure(loop, env_job, args.eval_tasks, args.eval_samples, seed)
    t0 = time.perf_counter()
    diffs = []
    for step in range(args.steps):
        row = loop.step(step)
        diffs.append(row["mismatch/max_abs_logprob_diff"])
    took = time.perf_counter() - t0
    after = measure(loop, env_job, args.eval_tasks, args.eval_samples, seed)
    out = {"seed": seed, "tools": tools, "s_per_step": took / args.steps, "max_abs_logprob_diff": max(diffs),
           **{f"before/{k}": v for k, v in before.items()}, **{f"after/{k}": v for k, v in after.items()}}
    print(f"seed {seed} {'tools  ' if tools else 'control'}: accuracy {before['accuracy']:.3f} -> "
          f"{after['accuracy']:.3f}, tool-call rate {before['tool_call_rate']:.3f} -> {after['tool_call_rate']:.3f}, "
          f"turns {before['turns']:.2f} -> {after['turns']:.2f}, {out['s_per_step']:.1f} s/step, "
          f"max |dlogprob| over steps {out['max_abs_logprob_diff']!r}", flush=True)
    return out


def as_agent_job(job, entrypoint: str, seed: int):
    """``job`` (an environment job) as an agent job of ``entrypoint`` on the environment's own tasks, written to a
    JSON-lines file: enough for every step (the file is read in order, an epoch being one pass)."""
    import json
    import tempfile

    from fp8rl.config import parse_job_config

    problems = env_tasks(job, job.grpo.num_prompts_per_step * job.job.steps, seed)
    path = Path(tempfile.mkdtemp(prefix="agent-tasks-")) / "tasks.jsonl"
    path.write_text("".join(json.dumps({"question": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    d = job.to_dict()
    e = d.pop("env")
    d["data"] = {"task": "jsonl", "path": str(path)}
    d["agent"] = {"entrypoint": entrypoint, "concurrency": 16, "max_tokens_per_call": e["max_tokens_per_turn"],
                  "max_trajectory_tokens": 4096, "timeout_s": 600.0}
    return parse_job_config(d)


def _run_in_worker(seed: int, tools: bool, args) -> dict[str, float]:
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return one_run(seed, tools, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy" / "tool-job-tiny.yaml", help="the job file")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=None, help="grpo.num_prompts_per_step (default: the job file's)")
    p.add_argument("--group", type=int, default=None,
                   help="grpo.num_generations_per_prompt (default: the job file's)")
    p.add_argument("--lr", type=float, default=None, help="policy.training.lr (default: the job file's)")
    p.add_argument("--eval-tasks", type=int, default=64)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--arms", nargs="+", choices=("tools", "control"), default=["tools", "control"],
                   help="which arms to run (default both; e.g. one process per arm on a machine with cores to spare)")
    p.add_argument("--parallel", type=int, default=1,
                   help="runs at once, each a process of --threads torch threads (default 1: one after another)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    p.add_argument("--agent", default=None, metavar="MODULE:FUNCTION",
                   help="run the job as an agent job of this function (tools arm only; bench/ is on the path)")
    args = p.parse_args(argv)
    if args.agent and "control" in args.arms:
        p.error("--agent runs the tools arm only: pass --arms tools")
    arms = [arm == "tools" for arm in args.arms]
    todo = [(seed, tools, args) for seed in args.seeds for tools in arms]
    if args.parallel > 1:  # separate processes (spawned: no threads or engines shared), all numbers from this run
        with multiprocessing.get_context("spawn").Pool(args.parallel) as pool:
            runs = pool.starmap(_run_in_worker, todo)
    else:
        runs = [_run_in_worker(*t) for t in todo]
    for tools in arms:
        name = "tools" if tools else "control"
        for key in ("accuracy", "tool_call_rate"):
            gains = [r[f"after/{key}"] - r[f"before/{key}"] for r in runs if r["tools"] == tools]
            mean = statistics.fmean(gains)
            spread = statistics.stdev(gains) if len(gains) > 1 else float("nan")
            print(f"{name}: {key} gain {mean:+.3f} (per seed {', '.join(f'{g:+.3f}' for g in gains)}; spread "
                  f"{spread:.3f} over {len(gains)} seeds)")
            if key == "accuracy" and spread == spread:
                print(f"ratio accuracy_gain/spread {name} {mean / spread if spread else float('inf'):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
