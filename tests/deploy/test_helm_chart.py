"""k8s/fp8rl through Helm's own code (helm-python-sdk: Helm's Go SDK as a library), every rendered manifest
against the Kubernetes OpenAPI schemas (kubernetes-validate, strict), and the properties the chart promises."""

from __future__ import annotations

import base64
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "k8s" / "fp8rl"
VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.30.0"
FP8RL_ROLES = {"controller": 50050, "trainer": 50051, "rollout": 50052, "reward": 50053, "calibrator": 50054}
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
CRD_KINDS = {"ServiceMonitor"}  # prometheus-operator's: not in the Kubernetes schemas, checked by test_metrics_*
METRICS_PORT = 9400


def _values(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()) or {}


def render(values: dict | None = None) -> tuple[list[dict], str]:
    """Every object the chart renders (NOTES.txt aside) and the NOTES text."""
    out = helm.Chart.load(CHART).render(values or {}, name="rl", namespace="fp8rl", is_install=True)
    notes = out.pop("fp8rl/templates/NOTES.txt", "")
    docs = [d for text in out.values() for d in yaml.safe_load_all(text) if d]
    return docs, notes


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workload(docs: list[dict], component: str) -> dict:
    [w] = [d for d in docs if d["kind"] in WORKLOAD_KINDS
           and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return w


def container(docs: list[dict], component: str) -> dict:
    return workload(docs, component)["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture(scope="module", params=[p.name.removesuffix("-values.yaml") for p in VALUES])
def rendered(request):
    values = _values(request.param)
    docs, notes = render(values)
    return request.param, values, docs, notes


@pytest.mark.parametrize("values_file", VALUES, ids=lambda p: p.name)
def test_lint_strict(values_file):
    report = helm.lint(CHART, yaml.safe_load(values_file.read_text()) or {}, strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 = info ("icon is recommended")
    assert not problems and not report["errors"], report


def test_every_manifest_is_valid_kubernetes(rendered):
    _, _, docs, _ = rendered
    assert len(docs) >= 12
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(d, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{d['kind']}/{d['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")


def test_a_broken_manifest_fails_validation():
    docs, _ = render()
    bad = workload(docs, "trainer")
    bad["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["port"] = "grpc-by-name"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_workloads_services_and_replicas(rendered):
    name, values, docs, _ = rendered
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["kind"]
                  for d in docs if d["kind"] in WORKLOAD_KINDS}
    bundled = values.get("redis", {}).get("bundled", True)
    assert components == {"controller": "Deployment", "trainer": "StatefulSet", "rollout": "Deployment",
                          "reward": "Deployment", "calibrator": "Deployment",
                          **({"redis": "StatefulSet"} if bundled else {})}
    services = {s["metadata"]["labels"]["app.kubernetes.io/component"]: s for s in by_kind(docs, "Service").values()}
    metrics = values.get("metrics", {}).get("enabled", True)
    for role, port in FP8RL_ROLES.items():
        assert container(docs, role)["ports"] == [{"name": "grpc", "containerPort": port, "protocol": "TCP"}] + \
            ([{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}] if metrics else [])
        assert services[role]["spec"]["ports"][0]["targetPort"] == "grpc"
    assert workload(docs, "rollout")["spec"]["replicas"] == values.get("rollout", {}).get("replicas", 2)
    assert services["rollout"]["spec"]["clusterIP"] == "None"  # replicas are reached per pod, by lease


@pytest.mark.parametrize("replicas", [1, 3, 7])
def test_rollout_replicas_follow_the_value(replicas):
    docs, notes = render({"rollout": {"replicas": replicas}})
    assert workload(docs, "rollout")["spec"]["replicas"] == replicas
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert (len(pdbs) == 1) == (replicas > 1)  # a PDB over one replica would block every drain
    assert f"Rollout replicas: {replicas}" in notes


def test_probes(rendered):
    _, values, docs, _ = rendered
    tls = values.get("tls", {}).get("enabled", False)
    for role, port in FP8RL_ROLES.items():
        c = container(docs, role)
        startup, live, ready = c["startupProbe"], c["livenessProbe"], c["readinessProbe"]
        if tls:  # kubelet's gRPC probe speaks no TLS: the image's probe does
            assert ready["exec"]["command"] == ["python", "-m", "fp8rl.rpc.health_probe", f"localhost:{port}"]
        else:
            assert ready["grpc"] == {"port": port}, role
        if role == "rollout":  # NOT_SERVING until a job calibrates v0: liveness must not restart idle replicas
            assert live["tcpSocket"] == startup["tcpSocket"] == {"port": port}
        else:
            assert live == {**ready, "periodSeconds": 15, "timeoutSeconds": 5, "failureThreshold": 4}
        seconds = values.get(role, {}).get("startupSeconds") or yaml.safe_load(
            (CHART / "values.yaml").read_text())[role]["startupSeconds"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= seconds
    assert container(docs, "trainer")["startupProbe"]["failureThreshold"] * 10 >= 1800  # model load


def test_gpu_requests_node_selectors_and_tolerations():
    values = _values("gpu")
    docs, _ = render(values)
    for role, gpus in (("rollout", 1), ("trainer", 8), ("calibrator", 1)):
        c = container(docs, role)
        assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert c["image"] == f"registry.example.com/ml/fp8rl/{role}:0.1.0-gpu"
        pod = workload(docs, role)["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    for role in ("rollout", "trainer"):
        pod = workload(docs, role)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert container(docs, "trainer")["resources"]["requests"]["cpu"] == "16"  # merged, not replaced
    for role in ("controller", "reward"):
        assert "nvidia.com/gpu" not in str(container(docs, role)["resources"])
    cpu_docs, _ = render()
    assert "nvidia.com/gpu" not in str(container(cpu_docs, "rollout")["resources"])


TOKEN_SECRETS = {"FP8RL_SERVICE_TOKEN": "rl-fp8rl-service-token", "FP8RL_CLIENT_TOKEN": "rl-fp8rl-client-token"}


def test_secrets_are_referenced_never_inlined():
    values = _values("gpu")
    service, client = values["auth"]["serviceToken"], values["auth"]["clientToken"]
    password = values["redis"]["password"]
    docs, _ = render(values)
    secrets = by_kind(docs, "Secret")
    assert base64.b64decode(secrets["rl-fp8rl-service-token"]["data"]["token"]).decode() == service
    assert base64.b64decode(secrets["rl-fp8rl-client-token"]["data"]["token"]).decode() == client
    assert base64.b64decode(secrets["rl-fp8rl-redis"]["data"]["redis-password"]).decode() == password
    for d in docs:
        if d["kind"] == "Secret":
            continue
        text = yaml.safe_dump(d)
        for secret in (service, client, password):
            assert secret not in text, f"{d['kind']}/{d['metadata']['name']} inlines a secret"
    for role in FP8RL_ROLES:
        env = {e["name"]: e for e in container(docs, role)["env"]}
        for var, secret in TOKEN_SECRETS.items():  # both scopes wired into every role
            assert env[var]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "token"}, (role, var)
        assert "FP8RL_AUTH_TOKEN" not in env, role  # the one-token variable would blur the two scopes
        # every role holds a role lease in Redis (the reward service too: that is how it is found)
        assert env["FP8RL_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
        assert env["FP8RL_REDIS_URL"]["value"] == "redis://:$(FP8RL_REDIS_PASSWORD)@rl-fp8rl-redis:6379/0"


def test_generated_secrets_and_external_redis():
    docs, notes = render()
    generated = {name: base64.b64decode(by_kind(docs, "Secret")[name]["data"]["token"]).decode()
                 for name in TOKEN_SECRETS.values()}
    assert all(len(t) == 32 and t.isalnum() for t in generated.values())
    assert len(set(generated.values())) == 2  # one token per scope
    assert "secret rl-fp8rl-client-token" in notes and "rl-fp8rl-service-token" in notes
    docs, _ = render(_values("external-redis"))
    secrets = by_kind(docs, "Secret")
    assert not set(TOKEN_SECRETS.values()) & set(secrets)  # auth.existing*Secret: nothing generated
    assert base64.b64decode(secrets["rl-fp8rl-redis"]["data"]["redis-url"]).decode().startswith("redis://:ext-pass@")
    env = {e["name"]: e for e in container(docs, "trainer")["env"]}
    assert env["FP8RL_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "rl-fp8rl-redis", "key": "redis-url"}
    assert env["FP8RL_SERVICE_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "fp8rl-service-token"
    assert env["FP8RL_CLIENT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "fp8rl-client-token"
    assert not by_kind(docs, "NetworkPolicy")


def test_security_contexts(rendered):
    _, _, docs, _ = rendered
    for w in (d for d in docs if d["kind"] in WORKLOAD_KINDS):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {
                "drop": ["ALL"]}
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), f"{w['metadata']['name']}: no /tmp"


def test_network_policies_admit_only_release_pods():
    docs, _ = render()
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: p
                for p in by_kind(docs, "NetworkPolicy").values()}
    assert set(policies) == {"redis", "trainer", "rollout"}
    for component, port in (("redis", 6379), ("trainer", 50051), ("rollout", 50052)):
        rule = policies[component]["spec"]["ingress"][0]  # (the metrics port's rule: test_metrics_*)
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fp8rl",
                                                                 "app.kubernetes.io/instance": "rl"}}}]
        assert rule["ports"] == [{"port": port, "protocol": "TCP"}]


def test_job_configmap_is_a_valid_job():
    from fp8rl.config import parse_job_config

    for name in ("default", "gpu"):
        docs, _ = render(_values(name))
        [cm] = by_kind(docs, "ConfigMap").values()
        job = parse_job_config(cm["data"]["job.yaml"])  # what every service loads at start
        assert job.policy.generation.backend == ("vllm" if name == "gpu" else "torch")


@pytest.mark.parametrize(("values", "message"), [
    ({"rollout": {"replicaz": 3}}, "additional properties 'replicaz' not allowed"),
    ({"bogus": True}, "additional properties 'bogus' not allowed"),
    ({"rollout": {"replicas": -1}}, "/rollout/replicas"),
    ({"redis": {"bundled": False}}, "redis.bundled is false, so fp8rl needs an external Redis"),
    ({"tls": {"enabled": True}}, "tls.enabled is true but tls.secretName is empty"),
    ({"job": {"policy": {"model": "m", "generation": {"backend": "vllm"}}}},
     "needs GPU rollout replicas: set rollout.variant=gpu and rollout.gpus>=1"),
    ({"job": {"policy": {"model": "m", "training": {"backend": "megatron"}}}, "trainer": {"variant": "gpu"}},
     "needs a GPU trainer: set trainer.variant=gpu and trainer.gpus>=1 (have variant=gpu, gpus=0)"),
    ({"rollout": {"replicas": 2, "pdb": {"maxUnavailable": 2}}}, "would let a drain take every one"),
    ({"auth": {"serviceToken": "same-token", "clientToken": "same-token"}},
     "auth.serviceToken equals auth.clientToken"),
    ({"auth": {"existingServiceSecret": "s", "existingClientSecret": "s"}}, "name the same Secret"),
    ({"auth": {"token": "one-for-all"}}, "additional properties 'token' not allowed"),
    ({"trainer": {"pods": 2, "checkpoints": {"existingClaim": "ck"}}},
     "job.policy.training.dp_size is 1 but trainer.pods x trainer.procsPerPod is 2 x 1 = 2"),
    ({"trainer": {"pods": 2}, "job": {"policy": {"training": {"dp_size": 2}}}},
     "trainer.pods is 2: every rank writes its checkpoint shards into one directory"),
    ({"trainer": {"pods": 0}}, "/trainer/pods"),
    ({"trainer": {"variant": "gpu", "gpus": 1, "procsPerPod": 2},
      "job": {"policy": {"model": "m", "training": {"backend": "megatron", "dp_size": 2,
                                                    "megatron_cfg": {"tensor_model_parallel_size": 2}}}}},
     "dp_size x megatron_cfg tensor x pipeline parallel size is 2 x 2 = 4 ranks but trainer.pods x "
     "trainer.procsPerPod is 1 x 2 = 2"),
    ({"trainer": {"variant": "gpu", "gpus": 1, "procsPerPod": 2},
      "job": {"policy": {"model": "m", "training": {"backend": "megatron", "megatron_cfg": {
          "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}}}}},
     "dp_size x megatron_cfg tensor x pipeline parallel size is 1 x 4 = 4 ranks but trainer.pods x "
     "trainer.procsPerPod is 1 x 2 = 2"),
    ({"trainer": {"variant": "gpu", "gpus": 1, "procsPerPod": 3},
      "job": {"policy": {"model": "m", "training": {"backend": "megatron", "dp_size": 3,
                                                    "megatron_cfg": {"expert_model_parallel_size": 2}}}}},
     "expert_model_parallel_size is 2 but dp_size is 3: expert parallelism runs inside the data-parallel ranks"),
])
def test_bad_values_fail_the_render_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)


def _env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c["env"]}


def test_metrics_ports_env_annotations_and_network_policy_by_default():
    docs, _ = render()
    services = {s["metadata"]["labels"]["app.kubernetes.io/component"]: s for s in by_kind(docs, "Service").values()}
    for role in FP8RL_ROLES:
        w = workload(docs, role)
        env = _env(container(docs, role))
        assert (env["FP8RL_METRICS_PORT"], env["FP8RL_METRICS_HOST"]) == (str(METRICS_PORT), "0.0.0.0"), role
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert (ann["prometheus.io/scrape"], ann["prometheus.io/port"], ann["prometheus.io/path"]) == \
            ("true", str(METRICS_PORT), "/metrics")
        assert {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP",
                "appProtocol": "http"} in services[role]["spec"]["ports"]
    for name, policy in by_kind(docs, "NetworkPolicy").items():  # scrapers reach the metrics port of guarded pods
        metric_rules = [r for r in policy["spec"]["ingress"]
                        if r["ports"] == [{"port": METRICS_PORT, "protocol": "TCP"}]]
        assert len(metric_rules) == (0 if name.endswith("-redis") else 1), name
        assert all("from" not in r for r in metric_rules)
    assert not by_kind(docs, "ServiceMonitor") and "rl-fp8rl-dashboard" not in by_kind(docs, "ConfigMap")


def test_metrics_can_be_turned_off():
    docs, _ = render({"metrics": {"enabled": False, "port": 9400}})
    for role in FP8RL_ROLES:
        c = container(docs, role)
        assert "FP8RL_METRICS_PORT" not in _env(c) and [p["name"] for p in c["ports"]] == ["grpc"]
        assert "prometheus.io/scrape" not in workload(docs, role)["spec"]["template"]["metadata"]["annotations"]
    assert all(len(p["spec"]["ingress"]) == 1 for p in by_kind(docs, "NetworkPolicy").values())


def test_metrics_service_monitor_and_grafana_dashboard():
    import json

    docs, _ = render(_values("monitoring"))
    [sm] = by_kind(docs, "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["interval"] == "30s"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["fp8rl"]}
    selected = sm["spec"]["selector"]  # it selects exactly the role Services, by their labels
    roles = set(selected["matchExpressions"][0]["values"])
    for svc in by_kind(docs, "Service").values():
        labels = svc["metadata"]["labels"]
        chosen = all(labels.get(k) == v for k, v in selected["matchLabels"].items()) and \
            labels["app.kubernetes.io/component"] in roles
        assert chosen == (labels["app.kubernetes.io/component"] in FP8RL_ROLES), svc["metadata"]["name"]
    cm = by_kind(docs, "ConfigMap")["rl-fp8rl-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["fp8rl.json"])
    assert dash == json.loads((CHART / "dashboards" / "fp8rl.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])

    from fp8rl.metrics import ServiceMetrics  # every series the dashboard plots is one the services export

    families = {(f.name, f.type) for f in ServiceMetrics("x").registry.collect()}
    exported = {n + {"counter": "_total", "histogram": "_bucket"}.get(t, "") for n, t in families}
    import re

    used = set(re.findall(r"fp8rl_[a-z_]+", exprs))
    assert used and used <= exported, used - exported


@pytest.mark.parametrize(("values", "message"), [
    ({"metrics": {"enabled": True, "port": 50051}}, "/metrics/port"),
    ({"metrics": {"enabled": True, "port": 9400, "serviceMonitor": {"interval": "often"}}},
     "/metrics/serviceMonitor/interval"),
])
def test_bad_metrics_values_are_refused(values, message):
    with pytest.raises(helm.HelmError) as err:
        render(values)
    assert message in str(err.value)


def test_notes_tell_how_to_check_health_and_submit():
    _, notes = render()
    assert "python -m fp8rl.rpc.health_probe" in notes
    assert "fp8rl --target 127.0.0.1:50050 submit job.yaml --watch" in notes
    assert "secret rl-fp8rl-client-token" in notes  # the CLI's token is the client one


@pytest.mark.parametrize("pods,procs", [(1, 1), (2, 1), (8, 1), (1, 2)])
def test_the_trainer_runs_as_a_rank_group_of_pods(pods, procs):
    """N trainer pods: one StatefulSet of N pods started together, torchrun in each with the static rendezvous on
    pod 0 (found through a headless Service), gRPC routed to pod 0 only (rank 0 serves), a shared checkpoint claim."""
    world = pods * procs
    values = {"trainer": {"pods": pods, "procsPerPod": procs, "gpus": procs},
              "job": {"policy": {"training": {"dp_size": world}}}}
    if pods > 1:
        values["trainer"]["checkpoints"] = {"existingClaim": "shared-checkpoints"}
    docs, _ = render(values)
    for d in docs:  # still valid Kubernetes at every size
        if d["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(d, KUBE_VERSION, strict=True)
    sts, c = workload(docs, "trainer"), container(docs, "trainer")
    assert sts["spec"]["replicas"] == pods
    assert c["resources"]["limits"]["nvidia.com/gpu"] == procs
    services = by_kind(docs, "Service")
    env = {e["name"]: e for e in c["env"]}
    if world == 1:
        assert "command" not in c and "volumeClaimTemplates" in sts["spec"]  # as before: one process, its own claim
        assert "rl-fp8rl-trainer-ranks" not in services
        return
    cmd = c["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert cmd[-4:] == ["-m", "services.trainer", "--resume", "auto"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == str(procs) and "--max-restarts" in cmd
    if pods == 1:
        assert "--standalone" in cmd
        return
    ranks = services["rl-fp8rl-trainer-ranks"]
    assert ranks["spec"]["clusterIP"] == "None" and ranks["spec"]["publishNotReadyAddresses"] is True
    assert {"name": "rendezvous", "port": 29500, "targetPort": 29500, "protocol": "TCP"} in ranks["spec"]["ports"]
    assert sts["spec"]["serviceName"] == "rl-fp8rl-trainer-ranks" and sts["spec"]["podManagementPolicy"] == "Parallel"
    master = "rl-fp8rl-trainer-0.rl-fp8rl-trainer-ranks"
    assert cmd[cmd.index("--nnodes") + 1] == str(pods) and cmd[cmd.index("--master-addr") + 1] == master
    assert cmd[cmd.index("--node-rank") + 1] == "$(FP8RL_POD_INDEX)"
    assert env["FP8RL_POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    assert env["FP8RL_ADVERTISE_HOST"]["value"] == master  # manifests name rank 0's pod for shard streaming
    grpc = services["rl-fp8rl-trainer"]
    assert grpc["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "rl-fp8rl-trainer-0"
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"]["claimName"] == "shared-checkpoints"
    assert "volumeClaimTemplates" not in sts["spec"]
    policy = by_kind(docs, "NetworkPolicy")["rl-fp8rl-trainer"]["spec"]["ingress"]
    peers = [r for r in policy if "ports" not in r]  # every port, from the trainer's own pods only
    assert [r["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in peers] == ["trainer"]


@pytest.mark.parametrize("mp", [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}])
def test_a_model_parallel_megatron_trainer_runs_dp_size_x_tp_x_pp_ranks(mp):
    """dp_size 1 x tensor (or pipeline) parallel 2: one pod of 2 ranks (torchrun --nproc-per-node 2)."""
    docs, _ = render({"trainer": {"variant": "gpu", "gpus": 2, "procsPerPod": 2},
                      "job": {"policy": {"model": "m", "training": {"backend": "megatron", "megatron_cfg": mp}}}})
    cmd = container(docs, "trainer")["command"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "--standalone" in cmd


def test_an_expert_parallel_megatron_trainer_runs_dp_size_ranks():
    """dp_size 2 with expert parallelism 2 (the experts spread inside the data-parallel ranks): one pod of 2 ranks,
    not 4; the key reaches the trainer in the job file."""
    mc = {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall"}
    docs, _ = render({"trainer": {"variant": "gpu", "gpus": 2, "procsPerPod": 2},
                      "job": {"policy": {"model": "m", "training": {"backend": "megatron", "dp_size": 2,
                                                                    "megatron_cfg": mc}}}})
    cmd = container(docs, "trainer")["command"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "--standalone" in cmd
    from fp8rl.config import parse_job_config

    [cm] = by_kind(docs, "ConfigMap").values()
    job = parse_job_config(cm["data"]["job.yaml"])
    assert (job.policy.training.megatron_cfg.expert_model_parallel_size, job.trainer_ranks) == (2, 2)
    assert job.policy.training.megatron_cfg.moe_token_dispatcher_type == "alltoall"
