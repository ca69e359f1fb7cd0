"""Multi-turn trajectories on the real service stack (issue 48): ``deploy.launcher up`` with two rollout replicas,
the reward service's env workers running the environments (``--env-module`` for the user ones), the controller
driving the turns.

The policy is a seeded random 2-layer Llama with the ChatML character tokenizer (tools rendered by its template),
fp8_e2e with an FP8 KV cache and batch invariance: every step's ``mismatch/max_abs_logprob_diff`` is exactly 0 —
the trainer's one forward over each whole trajectory against the replicas' per-turn decodes with their K/V kept
between turns, sticky per trajectory. A random policy never guesses the number, so every ``guess_number``
trajectory runs its ``max_turns``; on ``calculator`` it answers at once (one turn, reward 0). Environments that
crash or hang end their trajectories ungraded (counted, out of the loss), and a replica killed mid-trajectory
hands its trajectories to the other, which re-prefills them — still bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import yaml

from fp8rl.presets.chatml import random_chat_checkpoint
from fp8rl.rpc import env_pb2, env_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from fp8rl.rpc.channel import make_channel
from fp8rl.sdk import Fp8rlClient, InvalidArgument

from .conftest import REPO, Stack, alive, assert_zero_mismatch, down

pytestmark = [pytest.mark.integration, pytest.mark.agents]

WATCH_S = 240.0
TURNS = 3
HERE = Path(__file__).resolve().parent
E2E = REPO / "tests" / "e2e"  # envs_for_tests: FlakyEnv (crash / hang)


def _chat_model(path: Path) -> Path:
    return random_chat_checkpoint(path, max_position_embeddings=2048)


def _job(model: Path, name: str, *, steps: int = 2, env: dict | None = None, **more) -> dict:
    job = {"job": {"name": name, "steps": steps, "seed": 0, "checkpoint_every": 0},
           "policy": {"model": str(model),
                      "generation": {"vllm_cfg": {"precision": "fp8", "kv_cache_dtype": "fp8"}},
                      "training": {"lr": 0.01, "micro_batch_size": 8, "megatron_cfg": {"fp8_cfg": {"enabled": True}}}},
           "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
           "env": {"name": "guess_number", "max_turns": TURNS, "max_tokens_per_turn": 8,
                   "max_trajectory_tokens": 200, **(env or {})},
           "data": {"task": "env"}, "calibration": {"max_sequences": 4}}
    job.update(more)
    return job


@pytest.fixture(scope="module")
def env_stack(tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("env-stack")
    model = _chat_model(tmp / "model")
    job_file = tmp / "job.yaml"
    job_file.write_text(yaml.safe_dump(_job(model, "env-stack")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_") or k == "FP8RL_REDIS_SERVER"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(E2E), env.get("PYTHONPATH", "")])
    up = subprocess.run([sys.executable, "-m", "deploy.launcher", "up", "--job", str(job_file), "--run-dir",
                         str(tmp / "run"), "--replicas", "2", "--ready-timeout", "180", "--env-module", "stack_envs",
                         "--env-module", "envs_for_tests", "--env-module", "stack_agents", "--agents"], cwd=REPO,
                        env=env, capture_output=True, text=True,
                        timeout=300)
    if up.returncode != 0:
        pytest.fail(f"launcher up failed ({up.returncode}):\n{up.stderr[-4000:]}", pytrace=False)
    stack = Stack(tmp / "run", job_file, model)
    yield stack
    down(stack)


def _tasks(stack: Stack, answers: tuple[int, ...]) -> dict:
    """A user environment's tasks as a jsonl file under the controller's data root (the job file's directory)."""
    name = f"tasks-{uuid.uuid4().hex[:8]}.jsonl"
    rows = [{"prompt": "Guess my number between 1 and 100.", "answer": str(a)} for a in answers]
    (stack.job_file.parent / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"task": "jsonl", "path": name}


def _run(stack: Stack, job: dict) -> tuple[list, object]:
    with Fp8rlClient(stack.target, token=stack.client_token, tls_ca="", timeout_s=30) as c:
        job_id = c.submit_job(yaml.safe_dump(job))
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        return reports, c.get_job(job_id)


def test_a_calculator_job_runs_three_steps_on_the_stack(env_stack):
    job = _job(env_stack.model_dir, f"calc-{uuid.uuid4().hex[:6]}", steps=3,
               env={"name": "calculator", "max_turns": 3, "max_tokens_per_turn": 16, "max_trajectory_tokens": 200})
    reports, info = _run(env_stack, job)
    assert_zero_mismatch(info, reports, 3)
    for r in reports:
        m = r.metrics
        assert m["env/turns_mean"] >= 1 and m["env/ungraded"] == 0.0  # the env workers answered every step
        assert m["env/end/done"] + m["env/end/budget"] + m["env/end/max_turns"] == 4.0  # 2 tasks x 2
        assert 0.0 <= r.reward_mean <= 1.0


def _reused_tokens(stack: Stack) -> int:
    total = 0
    for name in ("rollout-0", "rollout-1"):
        with make_channel(f"127.0.0.1:{stack.process(name)['port']}", token=stack.service_token, tls_ca="") as ch:
            total += rollout_pb2_grpc.RolloutServiceStub(ch).Status(rollout_pb2.RolloutStatusRequest(),
                                                                    timeout=30).session_reused_tokens
    return total


def test_guess_number_trajectories_are_bitwise_across_turns_with_sticky_kv(env_stack):
    reused = _reused_tokens(env_stack)
    reports, info = _run(env_stack, _job(env_stack.model_dir, f"guess-{uuid.uuid4().hex[:6]}"))
    assert_zero_mismatch(info, reports, 2)
    # turns 2 and 3 of each of the 2 x 4 trajectories reused their history's K/V on the replica that kept it
    assert _reused_tokens(env_stack) - reused >= 2 * 4 * 2 * 100
    for r in reports:
        m = r.metrics
        assert m["env/turns_mean"] == TURNS and m["env/end/max_turns"] == 4.0  # a random policy never guesses it
        assert m["env/masked_tokens"] > 0 and m["env/model_tokens"] > 0  # feedback deltas: context, not trained
        assert 0.0 < m["env/share_of_step"] < m["env/share_of_rollout"] < 1.0
        print(f"\nstep {r.step}: env/share_of_step {m['env/share_of_step']:.4f}, env {m['env/seconds']:.3f} s of "
              f"rollout {r.phase_times.rollout:.2f} s (step {r.phase_times.total:.2f} s)")
        md = r.trajectories_md  # the report's view: model turns (trained) and environment replies (context)
        assert md.count("**model**") >= TURNS and "**environment**" in md and "max_turns" in md


@pytest.mark.parametrize("mode, end", [("crash", "env_error"), ("hang", "env_timeout")])
def test_an_environment_that_crashes_or_hangs_ends_only_its_trajectories_ungraded(env_stack, mode, end):
    job = _job(env_stack.model_dir, f"flaky-{mode}-{uuid.uuid4().hex[:6]}", steps=1,
               env={"name": "envs_for_tests:FlakyEnv", "kwargs": {"mode": mode}, "step_timeout_s": 2.0},
               data=_tasks(env_stack, (37, 42)))  # the odd task's trajectories fail on their second step
    t = time.monotonic()
    reports, info = _run(env_stack, job)
    assert_zero_mismatch(info, reports, 1)
    m = reports[0].metrics
    assert m[f"env/end/{end}"] == 2.0 == m["env/ungraded"]  # task 37's two: counted, never a silent 0
    assert m["env/end/max_turns"] == 2.0  # task 42's ran to their end
    assert time.monotonic() - t < WATCH_S / 2  # a hang costs its step bound, not the 120 s it sleeps


def test_a_replica_killed_mid_trajectory_hands_its_trajectories_over(env_stack, tmp_path):
    marker = tmp_path / "paused"
    job = _job(env_stack.model_dir, f"kill-{uuid.uuid4().hex[:6]}", steps=1,
               env={"name": "stack_envs:PausingGuess", "kwargs": {"marker": str(marker), "pause_s": 4.0},
                    "step_timeout_s": 30.0},
               data=_tasks(env_stack, (37, 42)))
    victim = env_stack.process("rollout-1")
    with Fp8rlClient(env_stack.target, token=env_stack.client_token, tls_ca="", timeout_s=30) as c:
        job_id = c.submit_job(yaml.safe_dump(job))
        deadline = time.monotonic() + WATCH_S
        while not marker.exists():  # the first environment step: turn 0 was sampled on both replicas
            assert time.monotonic() < deadline and c.get_job(job_id).state in ("pending", "running")
            time.sleep(0.05)
        os.kill(victim["pid"], signal.SIGKILL)
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        info = c.get_job(job_id)
    assert not alive(victim["pid"])
    assert_zero_mismatch(info, reports, 1)  # re-prefilled on the other replica: still bitwise
    assert reports[0].metrics["env/turns_mean"] == TURNS and reports[0].metrics["env/ungraded"] == 0.0


def test_submit_refuses_environments_the_workers_do_not_run(env_stack):
    with Fp8rlClient(env_stack.target, token=env_stack.client_token, tls_ca="", timeout_s=30) as c:
        before = c.list_jobs()
        with pytest.raises(InvalidArgument, match=r"env.name: .*not_started:Env.*does not run on this stack"):
            c.submit_job(yaml.safe_dump(_job(env_stack.model_dir, "unknown-env",
                                             env={"name": "not_started:Env"}, data={"task": "arith"})))
        assert c.list_jobs() == before


def _slow_async_job(stack: Stack, name: str, *, delay_s: float, partial: str = "finish") -> tuple[list, int]:
    """A 3-step k = 1 job of SlowGuess (each environment step ``delay_s``) under ``env.partial``: its reports, each
    checked (succeeded, every trajectory graded and of TURNS turns, lag <= 1, no replica fenced), and how many times
    a rollout replica logged holding a refit back meanwhile."""
    job = _job(stack.model_dir, f"{name}-{uuid.uuid4().hex[:6]}", steps=3,
               env={"name": "stack_envs:SlowGuess", "kwargs": {"delay_s": delay_s}, "partial": partial},
               data=_tasks(stack, (37, 42, 9, 64, 5, 77)),
               grpo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2,
                     "async_grpo": {"enabled": True, "max_weight_lag": 1}})
    logs = [stack.run_dir / "logs" / f"rollout-{i}.log" for i in (0, 1)]
    before = sum(p.read_text().count("multi-turn trajectories of version") for p in logs)
    reports, info = _run(stack, job)
    assert (info.state, info.error) == ("succeeded", ""), info.error
    assert [r.step for r in reports] == [0, 1, 2]
    for r in reports:
        m = r.metrics
        assert m["env/ungraded"] == 0.0 and m["env/turns_mean"] == TURNS and m["weight_lag_max"] <= 1, (r.step, m)
        # a replica that held a version back and then went straight to the next one is not waited for: its ack of
        # the skipped version never comes, and fencing it would cost the refit timeout and its sessions
        assert m["replica_fenced"] == 0.0 and m.get("refit/fenced", 0.0) == 0.0, (r.step, m)
    return reports, sum(p.read_text().count("multi-turn trajectories of version") for p in logs) - before


def test_asynchronous_grpo_holds_each_refit_until_the_trajectories_in_flight_end(env_stack):
    """k = 1: step s+1's trajectories are sampled while step s trains; a replica holds the new version back while
    its trajectories of the old one are in flight (env.partial finish), so none is restarted or retried and each is
    sampled by one version, at most one behind the trainer."""
    reports, held = _slow_async_job(env_stack, "async", delay_s=0.4)  # turns that outlast a TrainStep
    for r in reports:
        assert r.metrics["retries"] == 0.0, (r.step, r.metrics)
    # a replica held a published version back while its trajectories of the older one were in flight
    assert held > 0, [r.phase_times for r in reports]


def test_interrupt_lets_a_refit_land_mid_trajectory_on_the_stack(env_stack):
    """k = 1 with env.partial interrupt (issue 50): no replica holds a refit back, so step s's training lands while
    step s+1's trajectories are between turns and their next turns run on the new weights — each token keeping its
    version, a row within the lag bound by its oldest token. Each environment step takes 1 s, so a trajectory of 3
    turns spans > 2 s — and a step's 4 trajectories > 6 s where the environment worker steps them one after another,
    as here (about 12 s measured) — against a tiny model's train step and refit of ~1-2 s: a refit lands inside some
    trajectory of steps 1-2 unless training slows 2-4x. The bitwise per-version logprobs are the loop's test
    (tests/e2e/test_interrupt.py): the same engines, the same recompute of a dropped session."""
    reports, held = _slow_async_job(env_stack, "intr", delay_s=1.0, partial="interrupt")
    for r in reports:
        assert 1.0 <= r.metrics["env/versions_per_trajectory"] <= 2.0, (r.step, r.metrics)
    assert sum(r.metrics["env/interrupted"] for r in reports) >= 1, [r.metrics for r in reports]
    assert held == 0  # nothing held back for these trajectories


def test_the_controller_killed_with_trajectories_in_flight_resumes_none_lost_or_doubled(env_stack, tmp_path):
    """Issue 50 on the stack: the controller SIGKILLed while step 0's trajectories are in flight (an environment
    step paused), started again on a new port. It resumes the job at its recorded step; the step in flight is run
    again from its plan (its trajectories restarted, not restored): every step reported once, every trajectory
    graded, the trainer's logprobs still bitwise the rollout's."""
    from .test_chaos import _kill, _restart_on_new_port

    marker = tmp_path / "paused"
    job = _job(env_stack.model_dir, f"ctl-{uuid.uuid4().hex[:6]}", steps=2,
               env={"name": "stack_envs:PausingGuess", "kwargs": {"marker": str(marker), "pause_s": 4.0},
                    "step_timeout_s": 30.0},
               data=_tasks(env_stack, (37, 42, 9, 64)))
    with Fp8rlClient(env_stack.target, token=env_stack.client_token, tls_ca="", timeout_s=30) as c:
        job_id = c.submit_job(yaml.safe_dump(job))
        deadline = time.monotonic() + WATCH_S
        while not marker.exists():  # turn 0 sampled, an environment step running: trajectories in flight
            assert time.monotonic() < deadline and c.get_job(job_id).state in ("pending", "running")
            time.sleep(0.05)
    old_port = _kill(env_stack, "controller")
    assert _restart_on_new_port(env_stack, "controller") != old_port
    with Fp8rlClient(env_stack.target, token=env_stack.client_token, tls_ca="", timeout_s=30) as c:
        reports = list(c.watch(job_id, timeout_s=WATCH_S))
        info = c.get_job(job_id)
    assert_zero_mismatch(info, reports, 2)  # steps 0 and 1, once each
    for r in reports:
        ends = sum(v for k, v in r.metrics.items() if k.startswith("env/end/"))
        assert ends == 4 and r.metrics["env/ungraded"] == 0.0, (r.step, r.metrics)
    # the killed controller had begun step 0's rollout: its successor ran those 2 x 2 trajectories again, counted
    # once, on the first step it recorded
    assert reports[0].metrics["resume/rollouts_restarted"] == 4.0
    assert "resume/rollouts_restarted" not in reports[1].metrics


# -- agent jobs: the agents in the reward service's sandbox, their calls on the replicas' endpoints ---------------
def _agent_job(stack: Stack, name: str, entrypoint: str, rows: list[dict], *, steps: int, n: int = 2,
               **agent) -> dict:
    job = _job(stack.model_dir, name, steps=steps)
    del job["env"]
    data = f"agent-tasks-{uuid.uuid4().hex[:8]}.jsonl"
    (stack.job_file.parent / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
    job["data"] = {"task": "jsonl", "path": data}
    job["grpo"] = {"num_prompts_per_step": len(rows), "num_generations_per_prompt": n}
    job["agent"] = {"entrypoint": f"stack_agents:{entrypoint}", "concurrency": 4, "max_tokens_per_call": 8,
                    "timeout_s": 60, **agent}
    return job


def test_an_agent_job_runs_three_steps_on_the_stack_bitwise(env_stack):
    """A user's agent function, run by the reward service in its sandbox, drives the policy through the replicas'
    OpenAI endpoints (two calls each, the assistant message sent back as the client returned it): every session is
    a trajectory of two model turns, and the trainer's logprobs over it are the replicas', bitwise, for 3 steps."""
    rows = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "What is 3+4?", "answer": "7"}]
    reports, info = _run(env_stack, _agent_job(env_stack, f"agent-{uuid.uuid4().hex[:6]}", "two_turns", rows,
                                               steps=3))
    assert_zero_mismatch(info, reports, 3)
    for r in reports:
        m = r.metrics
        assert m["env/turns_mean"] == 2.0 and m["env/ungraded"] == 0.0 and m["env/end/done"] == 4.0
        assert m["env/masked_tokens"] > 0 and m["env/model_tokens"] > 0  # the agent's messages: context only
        assert "stack_agents:two_turns" in r.trajectories_md and "**model**" in r.trajectories_md
        print(f"\nstep {r.step}: 4 sandboxed agents x 2 calls, rollout {r.phase_times.rollout:.2f} s of the step's "
              f"{r.phase_times.total:.2f} s")


def test_an_agent_cannot_leave_its_sandbox_and_its_failures_are_ungraded(env_stack):
    """Agents that try to read the service's token file, reach a loopback port and read the service's
    environment find none of them (each such agent returns 1.0 only when all failed); one that hangs past
    agent.timeout_s is killed, one that raises ends its trajectory — both ungraded, counted, never a 0."""
    target = json.dumps({"file": env_stack.info["secrets"]["service_token_file"],
                         "port": env_stack.info["controller"].rsplit(":", 1)[1]})
    rows = [{"prompt": target, "answer": "probe"}, {"prompt": target, "answer": "probe"},
            {"prompt": "-", "answer": "hang"}, {"prompt": "-", "answer": "raise"}]
    reports, info = _run(env_stack, _agent_job(env_stack, f"escape-{uuid.uuid4().hex[:6]}", "escape", rows, steps=1,
                                               timeout_s=8))
    assert (info.state, info.error) == ("succeeded", ""), info.error
    m = reports[0].metrics
    assert m["env/end/env_timeout"] == 2.0 and m["env/end/env_error"] == 2.0 and m["env/ungraded"] == 4.0
    assert m["env/end/done"] == 4.0 and reports[0].reward_mean == 1.0  # every probe found every way out shut
    assert reports[0].max_abs_logprob_diff == 0.0


def test_the_stack_refuses_an_agent_whose_module_the_reward_service_does_not_run(env_stack):
    job = _agent_job(env_stack, "agent-bad", "two_turns", [{"prompt": "x", "answer": "1"}], steps=1)
    job["agent"]["entrypoint"] = "os:system"
    with Fp8rlClient(env_stack.target, token=env_stack.client_token, tls_ca="", timeout_s=30) as c:
        with pytest.raises(InvalidArgument, match="agent.entrypoint.*--env-module"):
            c.submit_job(yaml.safe_dump(job))
    # nor does the reward service run one when asked directly (the service token: the controller's own calls)
    task = env_pb2.AgentTask(session_id="s", task_json="{}", base_url="http://127.0.0.1:1/v1")
    ok = {"timeout_s": 5, "concurrency": 1, "temperature": 1.0, "top_p": 1.0, "max_tokens_per_call": 4}
    with make_channel(f"127.0.0.1:{env_stack.process('reward')['port']}", token=env_stack.service_token,
                      tls_ca="") as ch:
        stub = env_pb2_grpc.EnvServiceStub(ch)
        for req, fragment in (
                (env_pb2.RunAgentsRequest(entrypoint="os:system", tasks=[task], **ok), "--env-module"),
                (env_pb2.RunAgentsRequest(entrypoint="stack_agents", tasks=[task], **ok), "package.module:function"),
                (env_pb2.RunAgentsRequest(entrypoint="stack_agents:two_turns", tasks=[task, task], **ok), "repeated"),
                (env_pb2.RunAgentsRequest(entrypoint="stack_agents:two_turns", tasks=[env_pb2.AgentTask(
                    session_id="s", task_json="{}", base_url="file:///etc/passwd")], **ok), "base_url"),
                (env_pb2.RunAgentsRequest(entrypoint="stack_agents:two_turns", tasks=[task],
                                          **{**ok, "timeout_s": float("nan")}), "timeout_s")):
            with pytest.raises(grpc.RpcError) as err:
                stub.RunAgents(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details(), (
                fragment, err.value.details())
