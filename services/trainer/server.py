"""TrainerService and WeightStore on one port: the policy trainer (``policy.training.backend: torch``) and its shards.

Wiring only — proto rows ↔ :class:`TrainBatch` (padded by :func:`fp8rl.engines.build_train_batch`), the
:class:`TorchTrainer`, and :class:`RefitPublisher` + :class:`WeightStoreServicer`:

* Startup: load the policy (or ``--resume`` a checkpoint) and publish its version — 0 for a fresh job.
* ``TrainStep(expected_version=v, rows)``: prev logprobs at v (mismatch metrics against the rows'
  ``gen_logprobs``), clipped policy loss, AdamW → v+1, then publish v+1: shards held for the
  WeightStore, manifest in Redis, ``weights_published`` on the events stream. FP8 recipes ship the
  linears the *rollout* runs in FP8 (``fp8_linear_names`` under ``job.fp8_recipe("rollout")``) as
  E4M3 + FP32 128×128 block scales; everything else travels in its own dtype.
* Invariant: the version the trainer holds is always published. A step that applied but could not
  be published (Redis down) fails the call with UNAVAILABLE and is published again before the next call.
* Malformed rows are INVALID_ARGUMENT with the row and field named; the trainer's state is untouched.
  More than ``--max-rows`` rows (``fp8rl.limits.MAX_BATCH_ROWS``) are refused before the call waits for
  the trainer; a call cancelled or past its deadline stops between micro-batches, nothing applied.
* ``SaveCheckpoint`` writes only into ``--checkpoint-dir`` (:mod:`services.trainer.checkpoints`): a request
  names a checkpoint or nothing, never a path; old automatic checkpoints are pruned.
* ``policy.training.dp_size: N`` under torchrun: this process is rank 0 and leads N - 1 followers
  (:mod:`services.trainer.ranks`); every call above reaches every rank, publishing gathers the full tensors
  here, and checkpoints are ``.dcp`` directories the ranks write together (torch backend, FSDP2) or one ``.pt``
  file rank 0 writes (megatron backend: Megatron-Core DDP, state replicated on every rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import threading
import time

import grpc
import torch

from fp8rl import limits, memory
from fp8rl.engines import (
    Cancelled,
    MemoryBudgetError,
    QKVCalibrator,
    Sample,
    StaleSampleError,
    TrainBatch,
    build_train_batch,
    make_calibrator,
    replay_route_shape,
    train_on_batch,
)
from fp8rl.fp8 import QKVScales, fp8_linear_names
from fp8rl.presets import load_policy
from fp8rl.refit import RefitError, StaleVersionError
from fp8rl.refit.transport.grpc import DEFAULT_CHUNK_BYTES, WeightStoreServicer
from fp8rl.refit.transport.shm import ShmUnavailableError
from fp8rl.rl import MAX_ABS_LOGPROB_DIFF, mismatch_metrics
from fp8rl.rpc import common_pb2, trainer_pb2, trainer_pb2_grpc, weights_pb2_grpc
from fp8rl.rpc.routes import routes_from_proto
from services.common.pictures import RequestPictures
from services.common.refit import build_publisher, start_broadcaster
from services.common.runtime import (
    Abort,
    Context,
    Service,
    ServiceSpec,
    StartupError,
    check_token_ids,
    env_default,
    require,
    rpc_method,
)

from .build import build_trainer
from .checkpoints import CheckpointDir, CheckpointLimitError, CheckpointNameError, resolve_checkpoint
from .ranks import CommandChannel, LeaderTrainer

log = logging.getLogger(__name__)

__all__ = ["TrainerService", "TrainerServicer", "SPEC", "resolve_checkpoint", "build_trainer"]


class TrainerService(Service):
    """The trainer backend, its publisher, and the two servicers sharing its port."""

    def __init__(self, ctx: Context) -> None:
        job, args = ctx.job, ctx.args
        self.ctx = ctx
        self.backend = job.policy.training.backend
        policy, tok, path = load_policy(job.policy.model, language_model_only=job.policy.language_model_only)
        self.pad_id = tok.pad_id
        self.pictures = RequestPictures(policy.config, path)  # a vision-language policy's rows carry images
        self.vocab_size, self.max_len = policy.config.vocab_size, policy.config.max_position_embeddings
        self.route_shape = replay_route_shape(job, policy.config)
        rollout = job.fp8_recipe("rollout")
        self.fp8_prefixes = fp8_linear_names(policy, rollout)  # what the rollout runs in FP8 travels in FP8
        self.pow2, self.scaling = rollout.pow2_weight_scaling_factors, rollout.scaling
        try:  # torch or megatron, per policy.training.backend; same TrainerConfig mapping either way
            self.trainer, parallel = build_trainer(job, policy)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if parallel is not None:  # rank 0 of dp_size: every trainer call from here on reaches every rank
            self.trainer = LeaderTrainer(self.trainer, CommandChannel(parallel))
            how = "FSDP2"
            if self.backend == "megatron":
                mc = job.policy.training.megatron_cfg
                how = "Megatron-Core DDP" + (f", tensor x pipeline parallel {mc.tensor_model_parallel_size} x "
                                             f"{mc.pipeline_model_parallel_size}" if job.trainer_model_parallel > 1
                                             else "")
                if mc.expert_model_parallel_size > 1:
                    how += (f", expert parallel {mc.expert_model_parallel_size} "
                            f"({mc.moe_token_dispatcher_type} dispatcher)")
            log.info("trainer rank 0 of %d (%s over %s)", parallel.world, how, torch.distributed.get_backend())
        try:
            self.checkpoints = CheckpointDir(args.checkpoint_dir or f"checkpoints/{ctx.job_id}",
                                             keep=args.keep_checkpoints, max_named=args.max_named_checkpoints)
            path = self._resume_path(args.resume)
        except (ValueError, FileNotFoundError) as exc:
            raise StartupError(str(exc)) from None
        if path is not None:
            self.trainer.load_checkpoint(str(path))
            log.info("resumed from %s at weight version %d", path, self.trainer.version)
        try:
            self.publisher = build_publisher(ctx.store, ctx.job.refit, shard_bytes=args.shard_bytes,
                                             lora=ctx.job.policy.lora.enabled)
        except ShmUnavailableError as exc:
            raise StartupError(f"refit.transport shm: {exc}") from None
        self.weight_store = WeightStoreServicer(self.publisher, chunk_bytes=args.chunk_bytes)
        self.lock = threading.Lock()  # one step / logprobs / checkpoint at a time
        self.published: int | None = None
        self.trained_from: dict[int, int] = {}  # held version -> the version its optimizer step started from
        self.scales_version: int | None = None  # trainer-side FP8 KV: the version whose QKV scales it holds
        # calibration.site trainer / logprobs (TrainStepRequest.calibrate_scales / scales_from_logprobs, per job):
        # v+1's QKV scales computed here, published right after the version's manifest
        self.calibrator: QKVCalibrator | None = None
        self.calibrator_unavailable: str | None = None  # why this trainer cannot calibrate, or None
        if job.kv_cache_dtype != "fp8":
            self.calibrator_unavailable = "this deployment's KV cache is not FP8 (no QKV scales to calibrate)"
        elif parallel is not None or self.backend != "torch":
            self.calibrator_unavailable = "calibrating in the trainer needs a one-process torch trainer"
        else:
            self.calibrator = make_calibrator(job, self.trainer.model, tok.pad_id)
        self.pending_scales: QKVScales | None = None
        self.ready = False

    def load_held_scales(self, wait_s: float = 60.0) -> None:
        """Trainer-side FP8 KV (batch-invariant recipes): install the QKV scales the rollout uses for the held
        version, read from the refit store; in asynchronous GRPO they may still be calibrating, so wait a bounded
        time. Raises :class:`Abort` UNAVAILABLE when none arrive (nothing is computed with other scales)."""
        if not getattr(self.trainer, "needs_qkv_scales", False):
            return
        v = self.trainer.version
        if self.scales_version == v:
            return
        deadline = time.monotonic() + wait_s
        while (scales := self.ctx.store.get_scales(v)) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if scales is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"the trainer recomputes the rollout's FP8 attention with the QKV "
                        f"scales of weight version {v}, and none were published within {wait_s:.0f} s (calibrate it)")
        self.trainer.load_qkv_scales(scales)
        self.scales_version = v

    def _resume_path(self, resume: str | None):
        """The checkpoint ``--resume`` names; ``auto``: the newest in ``--checkpoint-dir``, or none (a fresh start —
        what a rank group restarted by torchrun before its first checkpoint gets)."""
        if not resume:
            return None
        if resume == "auto":
            found = self.checkpoints.automatic()
            return found[-1] if found else None
        return resolve_checkpoint(resume)

    def stop(self) -> None:
        self.publisher.close()  # shared-memory files go; held shards stay servable until the server stops
        if isinstance(self.trainer, LeaderTrainer):
            self.trainer.close()  # the followers exit

    def servicers(self):
        return [(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainerServicer(self)),
                (weights_pb2_grpc.add_WeightStoreServicer_to_server, self.weight_store)]

    def start(self, ctx: Context) -> None:
        self.publisher.endpoint = ctx.endpoint  # the port is known only now; manifests name it
        start_broadcaster(self.publisher, ctx.job.refit, ctx.endpoint)
        v, latest = self.trainer.version, ctx.store.latest()
        if latest is not None and latest >= v:
            if not ctx.args.resume:
                raise StartupError(
                    f"job {ctx.job_id!r} already has weights:latest={latest} in Redis, but this trainer starts from "
                    f"the initial weights (version {v}): restart it with --resume pointing at the job's checkpoints "
                    f"(it then republishes them as version {latest + 1}), or use a fresh --job-id")
            # Crash recovery: versions only increase, so the checkpoint's weights are republished under the next
            # free version, marked as restored from v; the controller rewinds the job to the checkpoint's step.
            try:
                self.trainer.relabel_version(latest + 1)
            except NotImplementedError as exc:
                raise StartupError(f"cannot resume version {v} behind weights:latest={latest}: {exc}") from None
            ctx.store.mark_restored(latest + 1, v)
            log.warning("checkpoint version %d is behind weights:latest=%d: republishing its weights as version %d",
                        v, latest, latest + 1)
        self.publish()
        self.ready = True
        ctx.set_serving(True)

    def _put_pending_scales(self) -> None:
        """The held version's QKV scales this trainer calibrated, into the refit store once its manifest is there
        (a put the calibrator service made first is the same set, or refused: the stored set stands)."""
        pending = self.pending_scales
        if pending is None or pending.version != self.published:
            return
        try:
            self.ctx.store.put_scales(pending)
        except RefitError as exc:
            log.warning("weight version %d already has other QKV scales (%s); those stand", pending.version, exc)
        self.pending_scales = None

    def publish(self) -> float:
        """Publish the held version unless already done (on the compute thread); returns the seconds it took."""
        return self.ctx.compute(self._publish_held)

    def _publish_held(self) -> float:
        v = self.trainer.version
        if self.published == v:
            self._put_pending_scales()  # its scales, where an earlier put failed (Redis away)
            return 0.0
        t0 = time.perf_counter()
        if v in self.trained_from:  # the lineage first: whoever sees v in weights:latest can read where it came from
            self.ctx.store.mark_trained(v, self.trained_from[v])
        # a LoRA job's versions after the base: the adapters alone (no gather of the frozen base)
        lora_only = not self.publisher.wants_base
        tensors = self.trainer.state_dict(adapters_only=True) if lora_only else self.trainer.state_dict()
        manifest = self.publisher.publish(tensors, v, recipe=self.ctx.job.recipe,
                                          fp8_prefixes=self.fp8_prefixes, pow2_scale=self.pow2,
                                          scaling=self.scaling)
        self.published = v
        self._put_pending_scales()
        took = time.perf_counter() - t0
        log.info("published weight version %d in %.3f s", v, took)
        self.ctx.metrics.observe_refit("publish", v, manifest.total_bytes, took)
        return took


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    """proto ↔ trainer; validation and status codes, nothing else."""

    def __init__(self, service: TrainerService) -> None:
        self.s = service

    def _samples(self, rows, *, need_gen: bool, images=()) -> tuple[list[Sample], bool]:
        """Validated rows as :class:`Sample` (prompt + response + gen_logprobs, a vision-language row's images from
        the request's ``images``); also whether gen_logprobs came."""
        s = self.s
        require(rows, "the batch has no rows")
        has_gen = need_gen or any(len(r.gen_logprobs) for r in rows)
        out = []
        for i, r in enumerate(rows):
            prompt = check_token_ids(r.prompt_ids, s.vocab_size, s.max_len, f"row {i} prompt_ids")
            response = check_token_ids(r.response_ids, s.vocab_size, s.max_len, f"row {i} response_ids")
            require(len(prompt) + len(response) <= s.max_len, f"row {i}: prompt + response is "
                    f"{len(prompt) + len(response)} tokens; the model holds at most {s.max_len} positions")
            gen = list(r.gen_logprobs)
            if has_gen:
                require(len(gen) == len(response),
                        f"row {i}: {len(gen)} gen_logprobs for {len(response)} response_ids (must be equal)")
                bad = next((t for t, x in enumerate(gen)
                            if not (math.isfinite(x) and limits.MIN_GEN_LOGPROB <= x <= limits.MAX_GEN_LOGPROB)), None)
                require(bad is None, f"row {i}: gen_logprobs[{bad}] is {gen[bad] if bad is not None else ''}; a "
                                     f"sampled token's logprob is finite, <= 0 and >= {limits.MIN_GEN_LOGPROB:g}")
            else:
                gen = [0.0] * len(response)
            version = r.weight_version if r.HasField("weight_version") else s.trainer.version
            try:
                routes = routes_from_proto(r.routes, f"row {i}") if r.HasField("routes") else None
            except ValueError as exc:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            mask = None
            if len(r.loss_mask):  # a multi-turn trajectory: the environment's tokens are context, never trained
                require(len(r.loss_mask) == len(response),
                        f"row {i}: {len(r.loss_mask)} loss_mask entries for {len(response)} response_ids (must be "
                        f"equal)")
                mask = tuple(int(m) for m in r.loss_mask)
                require(s.backend == "torch" or all(mask),
                        f"row {i}: loss_mask holds context tokens, which the {s.backend} trainer does not mask "
                        f"(multi-turn trajectories train on policy.training.backend torch)")
            out.append(Sample(prompt_index=i, prompt_ids=tuple(prompt), token_ids=tuple(response),
                              logprobs=tuple(gen), finish_reason="", weight_version=version, routes=routes,
                              token_mask=mask))
        pictures = s.pictures.of_rows(images, [r.image_indices for r in rows], [x.prompt_ids for x in out])
        if pictures is not None:  # rows of one prompt share one object: encoded once per step
            out = [dataclasses.replace(x, images=p) for x, p in zip(out, pictures, strict=True)]
        return out, has_gen

    def _batch(self, samples: list[Sample], advantages: list[float], *, routes_required: bool = True) -> TrainBatch:
        # The controller sends advantages precomputed (GRPO groups are its business, not the trainer's).
        shape = self.s.route_shape
        if not routes_required and not any(x.routes is not None for x in samples):
            shape = None  # ComputeLogprobs of rows without routes: the trainer's own routing
        try:  # routing replay: every row's routes are checked here (missing or malformed: the row is named)
            return build_train_batch(samples, None, 1, self.s.pad_id,
                                     advantages=torch.tensor(advantages, dtype=torch.float32), route_shape=shape)
        except ValueError as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _publish(self) -> float:
        try:
            return self.s.publish()
        except StaleVersionError as exc:  # another trainer published this version: two trainers on one job
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot publish: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - Redis down: the version stays held and is published later
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"the trainer holds weight version {self.s.trainer.version} "
                        f"but could not publish it ({exc}); it is published again before the next call") from None

    def _require_version(self, expected: int) -> None:
        held = self.s.trainer.version
        require(expected == held, f"expected weight version {expected}, but the trainer holds version {held}"
                + (" (a retried step that already applied?)" if expected == held - 1 else ""),
                grpc.StatusCode.FAILED_PRECONDITION)

    def _check_rows(self, rows) -> None:
        limit = self.s.ctx.args.max_rows
        require(len(rows) <= limit, f"rows: {len(rows)} rows; the limit is {limit} (--max-rows)")

    @rpc_method
    def TrainStep(self, request, context):
        s, t0 = self.s, time.perf_counter()
        self._check_rows(request.rows)  # before the lock: an oversize batch never waits for (or holds) it

        def stop() -> bool:  # polled between micro-batches
            return not context.is_active()

        with s.lock:
            self._publish()
            self._require_version(request.expected_version)
            samples, _ = self._samples(request.rows, need_gen=True, images=request.images)
            advantages = [r.advantage for r in request.rows]
            bad = next((i for i, a in enumerate(advantages) if not math.isfinite(a)), None)
            require(bad is None, f"row {bad}: advantage must be finite")
            batch = self._batch(samples, advantages)
            require(0 <= request.max_weight_lag <= 16, f"max_weight_lag must be in 0..16, got {request.max_weight_lag}")
            for key, asked in (("calibrate_scales", request.calibrate_scales),
                               ("scales_from_logprobs", request.scales_from_logprobs)):
                require(not asked or s.calibrator is not None, f"{key}: {s.calibrator_unavailable}",
                        grpc.StatusCode.FAILED_PRECONDITION)
            require(not (request.calibrate_scales and request.scales_from_logprobs),
                    "calibrate_scales and scales_from_logprobs are exclusive: one source of the new version's scales")
            check_memory = getattr(s.trainer, "check_memory", None)
            if check_memory is not None:  # before waiting for any scales: a batch that cannot fit is refused at once
                try:
                    check_memory(*batch.input_ids.shape)
                except MemoryBudgetError as exc:
                    raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"step {request.step}: {exc}") from None
            s.load_held_scales()
            try:  # logprobs → mismatch → optimizer step, as the in-process loop does it
                out = s.ctx.compute(train_on_batch, s.trainer, batch, should_stop=stop,
                                    max_weight_lag=request.max_weight_lag,
                                    record_qkv=s.calibrator if request.scales_from_logprobs else None)
            except StaleSampleError as exc:  # refused before any work: weights and version unchanged
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"step {request.step}: {exc}") from None
            except MemoryBudgetError as exc:  # refused before any work: the batch would not fit this process
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"step {request.step}: {exc}") from None
            except FloatingPointError as exc:  # step skipped, version unchanged: the batch's values overflowed
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"step {request.step}: this batch gives {exc} (e.g. advantages too large)") from None
            except Cancelled as exc:  # the caller is gone; weights and version are unchanged
                raise Abort(grpc.StatusCode.CANCELLED, f"step {request.step}: {exc}") from None
            s.trained_from = {s.trainer.version: request.expected_version}
            s.ctx.metrics.train_steps.inc()
            t_calibrate = 0.0
            if out.qkv_scales is not None:  # recorded in the logprob pass: stored with the manifest below
                s.pending_scales = out.qkv_scales
                s.ctx.metrics.calibrations.inc()
            if request.calibrate_scales:  # v+1's QKV scales where v+1's weights are: no transfer, one forward
                t = time.perf_counter()
                s.pending_scales = s.ctx.compute(s.calibrator.calibrate, s.trainer.version,
                                                 [list(x.prompt_ids) + list(x.token_ids) for x in samples],
                                                 batch.images)
                t_calibrate = time.perf_counter() - t
                s.ctx.metrics.calibrations.inc()
            t_publish = self._publish()
        phases = common_pb2.PhaseTimes(logprobs=out.logprobs_s, train=out.train_s, publish=t_publish,
                                       calibrate=t_calibrate, total=time.perf_counter() - t0)
        log.info("step %d: weight version %d -> %d, loss %.4f, token_mult_prob_error %.4f, max |dlogprob| %.1e",
                 request.step, request.expected_version, s.trainer.version, out.metrics.get("train/loss", float("nan")),
                 out.metrics["token_mult_prob_error"], out.metrics[MAX_ABS_LOGPROB_DIFF])
        mem = memory.step_memory()  # this process's peaks of the step's phases (logprobs, train)
        s.ctx.metrics.observe_memory(mem)
        return trainer_pb2.TrainStepResponse(new_version=s.trainer.version, metrics={**out.metrics, **mem},
                                             phase_times=phases)

    @rpc_method
    def ComputeLogprobs(self, request, context):
        s = self.s
        self._check_rows(request.rows)
        with s.lock:
            if request.HasField("expected_version"):
                self._require_version(request.expected_version)
            samples, has_gen = self._samples(request.rows, need_gen=False, images=request.images)
            batch = self._batch(samples, [0.0] * len(samples), routes_required=False)
            s.load_held_scales()
            try:
                prev = s.ctx.compute(s.trainer.compute_logprobs, batch,  # (B, T)
                                     should_stop=lambda: not context.is_active())
            except Cancelled as exc:
                raise Abort(grpc.StatusCode.CANCELLED, str(exc)) from None
            version = s.trainer.version
        rows = [trainer_pb2.RowLogprobs(logprobs=prev[b, len(x.prompt_ids):len(x.prompt_ids) + len(x.token_ids)]
                                        .tolist()) for b, x in enumerate(samples)]
        metrics = mismatch_metrics(prev, batch.gen_logprobs, batch.loss_mask) if has_gen else {}
        return trainer_pb2.ComputeLogprobsResponse(rows=rows, metrics=metrics, version=version)

    @rpc_method
    def SaveCheckpoint(self, request, context):
        s = self.s
        require(not request.path, "SaveCheckpointRequest.path is refused: the trainer writes checkpoints only into its "
                                  "own --checkpoint-dir; name the checkpoint with `name`, or leave it empty")
        directory = s.checkpoints.directory
        with s.lock:
            version = s.trainer.version
            try:
                file = s.ctx.compute(s.checkpoints.save, s.trainer, request.name)
            except CheckpointNameError as exc:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"name: {exc}") from None
            except CheckpointLimitError as exc:
                raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
            except OSError as exc:
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot write a checkpoint into {directory}: "
                                                                 f"{exc}") from None
        log.info("checkpoint of weight version %d written to %s", version, directory / file)
        return trainer_pb2.SaveCheckpointResponse(path=str(directory), version=version, file=file)

    @rpc_method
    def Status(self, request, context):
        s = self.s
        # a version trained while Redis refused the publish is published (its lineage first) before anyone is told
        # it is held: a controller resuming a job reads that lineage right after this call. A step in flight holds
        # the lock and publishes its own version; Status then answers without waiting.
        if s.published != s.trainer.version and s.lock.acquire(blocking=False):
            try:
                self._publish()
            finally:
                s.lock.release()
        return trainer_pb2.TrainerStatusResponse(version=s.trainer.version, backend=s.backend, recipe=s.ctx.job.recipe,
                                                 weights_endpoint=s.ctx.endpoint, ready=s.ready)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--resume", default=env_default("resume"),
                   help="a checkpoint (trainer-v*.pt file or .dcp directory), a directory of them (the newest is "
                        "used), or 'auto': the newest in --checkpoint-dir if there is one, else a fresh start")
    p.add_argument("--checkpoint-dir", default=env_default("checkpoint_dir"),
                   help="the one directory SaveCheckpoint writes into (default checkpoints/JOB)")
    p.add_argument("--keep-checkpoints", type=int, default=int(env_default("keep_checkpoints", 5)),
                   help="automatic checkpoints kept, newest by version (0 keeps every one: unbounded disk use)")
    p.add_argument("--max-named-checkpoints", type=int, default=int(env_default("max_named_checkpoints", 8)),
                   help="distinct checkpoint names SaveCheckpoint accepts (0 refuses names)")
    p.add_argument("--max-rows", type=int, default=int(env_default("max_rows", limits.MAX_BATCH_ROWS)),
                   help="most rows in one TrainStep or ComputeLogprobs call")
    p.add_argument("--shard-bytes", type=int, default=int(env_default("shard_bytes", 64 * 1024 * 1024)))
    p.add_argument("--chunk-bytes", type=int, default=int(env_default("chunk_bytes", DEFAULT_CHUNK_BYTES)),
                   help="WeightStore stream chunk size, 1-4 MiB")


SPEC = ServiceSpec(name="trainer", default_port=50051, build=TrainerService, add_args=_add_args, compute_thread=True)
