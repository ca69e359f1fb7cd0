"""Prometheus metrics of one fp8rl service process (``--metrics-port``, env ``FP8RL_METRICS_PORT``).

Every role serves the same families on ``http://HOST:PORT/metrics`` (text exposition format, from
``prometheus-client``); each role moves the ones it does something about, the rest stay at zero:

=====================================  ======================  ==================================================
family                                 who moves it            what
=====================================  ======================  ==================================================
``fp8rl_rpc_requests_total``           every role              RPCs served, by ``method`` and final gRPC ``code``
``fp8rl_rpc_seconds``                  every role              histogram of RPC handling time, by ``method``
``fp8rl_steps_total``                  controller              GRPO steps recorded
``fp8rl_step``                         controller              the last recorded step (0-based)
``fp8rl_last_step_phase_seconds``      controller              the last step's time per ``phase`` (rollout, ...)
``fp8rl_step_phase_seconds_total``     controller              the same, summed over the steps
``fp8rl_reward_mean``                  controller              the last step's mean reward
``fp8rl_accuracy``                     controller              the last step's accuracy
``fp8rl_token_mult_prob_error``        controller              rollout-vs-trainer mismatch of the last step
``fp8rl_policy_lag_versions``          controller              mean weight versions a sample was behind (async)
``fp8rl_tokens_per_second``            controller              generated tokens / rollout seconds, last step
``fp8rl_generated_tokens_total``       rollout                 tokens decoded
``fp8rl_generate_seconds_total``       rollout                 seconds spent generating
``fp8rl_weight_version``               rollout, calibrator,    the weight version this process holds
                                       trainer
``fp8rl_refits_total``                 trainer, rollout,       versions published (``direction=publish``) or
                                       calibrator              applied (``direction=apply``)
``fp8rl_refit_bytes_total``            (same)                  their bytes (the delta's when a delta was pulled)
``fp8rl_refit_seconds_total``          (same)                  their seconds
``fp8rl_train_steps_total``            trainer                 optimizer steps taken
``fp8rl_graded_total``                 reward                  responses graded
``fp8rl_calibrations_total``           calibrator, trainer     QKV scale calibrations done (trainer: site trainer)
``fp8rl_resident_memory_bytes``        every role              resident memory of the process now
``fp8rl_resident_memory_peak_bytes``   trainer, rollout,       peak RSS per ``phase`` of the last step (logprobs,
                                       calibrator; every role  train, rollout, calibrate: :mod:`fp8rl.memory`);
                                                               ``phase="process"``: since the process started
=====================================  ======================  ==================================================

Each process has its own registry (several services can live in one test process); the exporter is
``prometheus_client``'s threaded HTTP server on a daemon thread. Metrics carry no secrets and need no
token; they bind ``--metrics-host`` (default: the gRPC ``--host``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server

from fp8rl import memory

__all__ = ["ServiceMetrics", "serve_metrics", "scrape", "parse_metrics"]

disable_created_metrics()  # no `*_created` twin of every counter: Prometheus does not need them
RPC_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0, 300.0)


class ServiceMetrics:
    """The metric families of one process (see the module table) and the calls that move them."""

    def __init__(self, role: str) -> None:
        self.role = role
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.rpc_requests = Counter("fp8rl_rpc_requests", "RPCs served, by method and final status code",
                                    ["method", "code"], registry=r)
        self.rpc_seconds = Histogram("fp8rl_rpc_seconds", "RPC handling time", ["method"], buckets=RPC_BUCKETS,
                                     registry=r)
        self.steps = Counter("fp8rl_steps", "GRPO steps recorded by the controller", registry=r)
        self.step = Gauge("fp8rl_step", "the last recorded step (0-based)", registry=r)
        self.phase_last = Gauge("fp8rl_last_step_phase_seconds", "the last step's time per phase", ["phase"],
                                registry=r)
        self.phase_total = Counter("fp8rl_step_phase_seconds_total", "step time per phase, summed over steps",
                                   ["phase"], registry=r)
        self.reward_mean = Gauge("fp8rl_reward_mean", "the last step's mean reward", registry=r)
        self.accuracy = Gauge("fp8rl_accuracy", "the last step's accuracy", registry=r)
        self.mismatch = Gauge("fp8rl_token_mult_prob_error", "rollout-vs-trainer token probability mismatch, "
                              "last step (1.0 = none)", registry=r)
        self.lag = Gauge("fp8rl_policy_lag_versions", "mean weight versions a sample was behind the trainer, last step",
                         registry=r)
        self.validation = Gauge("fp8rl_validation", "the last validation of the job: greedy accuracy "
                                "(metric=\"accuracy\"), pass@j and mean@k", ["metric"], registry=r)
        self.entropy = Gauge("fp8rl_policy_entropy", "the trainer's token-mean policy entropy, last step",
                             registry=r)
        self.tokens_per_second = Gauge("fp8rl_tokens_per_second", "generated tokens per rollout second, last step",
                                       registry=r)
        self.generated_tokens = Counter("fp8rl_generated_tokens", "tokens decoded", registry=r)
        self.generate_seconds = Counter("fp8rl_generate_seconds", "seconds spent generating", registry=r)
        self.weight_version = Gauge("fp8rl_weight_version", "the weight version this process holds (-1: none)",
                                    registry=r)
        self.weight_version.set(-1)
        self.refits = Counter("fp8rl_refits", "weight versions published or applied", ["direction"], registry=r)
        self.refit_bytes = Counter("fp8rl_refit_bytes", "bytes of weight versions published or pulled",
                                   ["direction"], registry=r)
        self.refit_seconds = Counter("fp8rl_refit_seconds", "seconds spent publishing or applying weight versions",
                                     ["direction"], registry=r)
        self.train_steps = Counter("fp8rl_train_steps", "optimizer steps taken", registry=r)
        self.graded = Counter("fp8rl_graded", "responses graded", registry=r)
        self.calibrations = Counter("fp8rl_calibrations", "QKV scale calibrations done", registry=r)
        self.rss = Gauge("fp8rl_resident_memory_bytes", "resident memory of this process now", registry=r)
        self.rss.set_function(memory.rss_bytes)
        self.rss_peak = Gauge("fp8rl_resident_memory_peak_bytes", "this process's peak resident memory: per phase "
                              "of its last step (logprobs, train, rollout, calibrate...), phase=\"process\" since it "
                              "started", ["phase"], registry=r)
        self.rss_peak.labels(phase="process").set_function(memory.process_peak_bytes)
        for direction in ("publish", "apply"):  # both series exist from the start: rate() needs no gaps
            for fam in (self.refits, self.refit_bytes, self.refit_seconds):
                fam.labels(direction=direction)

    # -- what the roles call -------------------------------------------------------------------
    def observe_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """One RPC ended with ``code`` after ``seconds`` (the server's call observer, ``build_server(observer=...)``:
        calls the token check or the call gate refused are counted too, with the code they got)."""
        name = _method_name(method)
        self.rpc_requests.labels(method=name, code=code.name if isinstance(code, grpc.StatusCode) else str(code)).inc()
        self.rpc_seconds.labels(method=name).observe(seconds)

    def observe_report(self, report: Mapping) -> None:
        """The controller recorded one step's report (``JobService`` ``StepReport`` as a dict)."""
        self.steps.inc()
        self.step.set(report["step"])
        times = report.get("phase_times", {}) or {}
        for phase, seconds in times.items():
            if _finite(seconds):
                self.phase_last.labels(phase=phase).set(seconds)
                if seconds >= 0:
                    self.phase_total.labels(phase=phase).inc(seconds)
        for gauge, value in ((self.reward_mean, report.get("reward_mean")), (self.accuracy, report.get("accuracy"))):
            if _finite(value):
                gauge.set(value)
        metrics = report.get("metrics", {}) or {}
        for gauge, key in ((self.mismatch, "token_mult_prob_error"), (self.lag, "weight_lag_mean"),
                           (self.entropy, "train/entropy")):
            if _finite(metrics.get(key)):
                gauge.set(metrics[key])
        for key, value in metrics.items():  # val_accuracy, val/pass@1, val/pass@4, val/mean@4 on validation steps
            if (key == "val_accuracy" or key.startswith("val/")) and _finite(value):
                self.validation.labels(metric="accuracy" if key == "val_accuracy" else key[4:]).set(value)
        tokens, rollout_s = metrics.get("num_tokens"), times.get("rollout")
        if _finite(tokens) and _finite(rollout_s) and rollout_s > 0:
            self.tokens_per_second.set(tokens / rollout_s)

    def observe_memory(self, step_memory: Mapping[str, float]) -> None:
        """This process's phase peaks of its last step (:func:`fp8rl.memory.step_memory`: GB per phase)."""
        prefix = "memory/peak_rss_gb/"
        for key, gb in step_memory.items():
            if key.startswith(prefix) and _finite(gb):
                self.rss_peak.labels(phase=key[len(prefix):]).set(gb * memory.GB)

    def observe_generation(self, tokens: int, seconds: float) -> None:
        self.generated_tokens.inc(tokens)
        self.generate_seconds.inc(max(seconds, 0.0))

    def observe_refit(self, direction: str, version: int, nbytes: int, seconds: float) -> None:
        """One weight version published (trainer) or applied (replica)."""
        self.refits.labels(direction=direction).inc()
        self.refit_bytes.labels(direction=direction).inc(nbytes)
        self.refit_seconds.labels(direction=direction).inc(max(seconds, 0.0))
        self.weight_version.set(version)


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _method_name(full: str) -> str:
    """``/fp8rl.rollout.RolloutService/Generate`` -> ``RolloutService/Generate``."""
    service, _, method = full.lstrip("/").rpartition("/")
    return f"{service.rpartition('.')[2]}/{method}" if method else full


class MetricsServer:
    """The running exporter: its bound port, and ``close()``."""

    def __init__(self, httpd, thread: threading.Thread) -> None:
        self._httpd, self._thread = httpd, thread
        self.port: int = httpd.server_address[1]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_metrics(metrics: ServiceMetrics, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serves ``/metrics`` of ``metrics`` on ``host:port`` (0 picks a free port) from a daemon thread.

    Raises:
        RuntimeError: the address cannot be bound (port in use, host not local).
    """
    addr = {"[::]": "::", "": "0.0.0.0"}.get(host, host.strip("[]"))
    try:
        httpd, thread = start_http_server(port, addr=addr, registry=metrics.registry)
    except OSError as exc:
        if addr != "::":
            raise RuntimeError(f"could not serve metrics on {host}:{port}: {exc}") from None
        try:  # every interface, on a host (or container) without IPv6: IPv4's wildcard
            httpd, thread = start_http_server(port, addr="0.0.0.0", registry=metrics.registry)
        except OSError as exc4:
            raise RuntimeError(f"could not serve metrics on {host}:{port}: {exc}; nor on 0.0.0.0: {exc4}") from None
    return MetricsServer(httpd, thread)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """Exposition text, parsed by prometheus_client's own parser: ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> Samples:
    """One GET of ``http://host:port/metrics``, parsed (:func:`parse_metrics`).

    Raises:
        OSError: nothing answered (``urllib.error.URLError`` included).
        ValueError: the answer was not the text exposition format.
    """
    import urllib.request

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        kind = r.headers.get("Content-Type", "")
        if r.status != 200 or not kind.startswith("text/plain"):
            raise ValueError(f"http://{host}:{port}/metrics answered {r.status} {kind!r}, not Prometheus text")
        return parse_metrics(r.read().decode())
