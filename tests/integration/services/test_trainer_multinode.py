"""The Helm chart's multi-pod trainer command, run: two "pods" as two processes on this host.

``trainer.pods: 2`` renders a StatefulSet whose container runs ``torchrun --nnodes 2 --node-rank
$(FP8RL_POD_INDEX) --master-addr <pod 0 on the headless Service> --master-port 29500 --nproc-per-node 1 ...
-m services.trainer --resume auto``. This test takes that command from the rendered chart and runs it twice, as
node 0 and node 1, with only what a cluster would supply swapped in — the pod index, pod 0's address (loopback),
a free rendezvous port, each pod's gRPC port, the job file, Redis and the shared checkpoint directory — so the
static rendezvous across nodes, rank 0 serving and rank 1 following, and a sharded checkpoint both nodes write
run for real. What it cannot show is the cluster itself (DNS, the claim, scheduling): that stays rendered.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import yaml

from fp8rl.rpc import trainer_pb2, trainer_pb2_grpc
from fp8rl.rpc.channel import make_channel

from .conftest import READY_TIMEOUT_S, REPO

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

CHART = REPO / "k8s" / "fp8rl"
T = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chart_trainer_command() -> list[str]:
    import helm_python as helm

    values = {"trainer": {"pods": 2, "procsPerPod": 1, "checkpoints": {"existingClaim": "shared"}},
              "job": {"policy": {"training": {"dp_size": 2}}}}
    out = helm.Chart.load(CHART).render(values, name="rl", namespace="fp8rl", is_install=True)
    docs = [d for name, text in out.items() if not name.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    [sts] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "rl-fp8rl-trainer"]
    [c] = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer"]
    return c["command"]


def _node(command: list[str], index: int, rendezvous: int) -> list[str]:
    """The rendered command as node ``index`` would run it here: this interpreter, pod 0 on loopback."""
    cmd = [sys.executable if a == "python" else a for a in command]
    cmd[cmd.index("--node-rank") + 1] = str(index)
    cmd[cmd.index("--master-addr") + 1] = "127.0.0.1"
    cmd[cmd.index("--master-port") + 1] = str(rendezvous)
    return cmd


def test_the_charts_two_pod_trainer_command_runs_as_two_nodes(tiny_checkpoint, write_job, redis_url, tmp_path):
    command = _chart_trainer_command()
    assert command[command.index("--nnodes") + 1] == "2" and "$(FP8RL_POD_INDEX)" in command
    job = write_job(tmp_path / "job.yaml", tiny_checkpoint, "multinode")
    spec = yaml.safe_load(job.read_text())
    spec["policy"]["training"]["dp_size"] = 2  # the ranks the chart's values start (pods x procsPerPod)
    job.write_text(yaml.safe_dump(spec))
    ckpt = tmp_path / "checkpoints"  # the ReadWriteMany claim both pods mount
    rendezvous = _free_port()
    procs, ready, logs = [], [], []
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_")}
    try:
        for i in range(2):
            ready.append(tmp_path / f"pod{i}.ready.json")
            logs.append(tmp_path / f"pod{i}.log")
            env = {**base_env, "FP8RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "FP8RL_CONFIG": str(job), "FP8RL_PORT": str(_free_port()), "FP8RL_HOST": "127.0.0.1",
                   "FP8RL_REDIS_URL": redis_url, "FP8RL_JOB_ID": "multinode", "FP8RL_REPLICA_ID": "trainer",
                   "FP8RL_CHECKPOINT_DIR": str(ckpt), "FP8RL_ADVERTISE_HOST": "127.0.0.1",
                   "FP8RL_READY_FILE": str(ready[i])}
            with open(logs[i], "ab") as log:
                procs.append(subprocess.Popen(_node(command, i, rendezvous), cwd=REPO, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 2 * READY_TIMEOUT_S
        while not ready[0].exists():
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    pytest.fail(f"pod {i} exited {p.returncode}:\n{logs[i].read_text(errors='replace')[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"pod 0 never served:\n{logs[0].read_text(errors='replace')[-4000:]}")
            time.sleep(0.1)
        port = json.loads(ready[0].read_text())["port"]
        stub = trainer_pb2_grpc.TrainerServiceStub(make_channel(f"127.0.0.1:{port}", token="", tls_ca=""))
        status = stub.Status(trainer_pb2.TrainerStatusRequest(), timeout=T, wait_for_ready=True)
        assert (status.backend, status.version) == ("torch", 0)
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(name="two-nodes"), timeout=T)
        shards = sorted(p.name for p in (ckpt / "two-nodes.dcp").iterdir())
        assert "__0_0.distcp" in shards and "__1_0.distcp" in shards, (saved, shards)  # both nodes wrote theirs
        assert "trainer rank 0 of 2 (FSDP2 over gloo)" in logs[0].read_text(errors="replace")
        assert "rank 1 of 2 following rank 0" in logs[1].read_text(errors="replace")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
