"""CalibratorService: QKV amax calibration of a published weight version → FP32 scales in Redis.

Wiring only — the model is the trainer's model code converted with ``job.fp8_recipe("calibrator")``
(forward only, DESIGN §5) as a :class:`fp8rl.engines.CalibrationModel`, refitted like a replica;
:class:`QKVCalibrator` does the work:

* The calibrator holds a lease of role ``calibrator`` and follows ``weights:latest`` (a
  :class:`RefitFollower` with ``requires_scales=False``), so a new version is usually pulled — over
  ``WeightStore.StreamShards`` — before its Calibrate call arrives; refit acks are awaited from
  ``rollout`` leases only, so the calibrator never holds up a version.
* ``Calibrate(v, sequences)`` syncs to v if needed, calibrates on at most ``calibration.max_sequences``
  sequences (an evenly spaced, deterministic subset), publishes the set with ``RefitStore.put_scales``
  and returns it, encoded with :func:`fp8rl.refit.encode_scales` (the bytes Redis holds: one wire
  format). Scales are immutable per version: when v's are already published they are returned as
  they are (a retried call is idempotent and cheap).
* The first set, for version 0, is the controller's to trigger: ``Calibrate(0, prompts)`` before the
  first step. FP8-KV rollout replicas do not serve v0 until it exists.
* A call with more than ``--max-rows`` sequences (``fp8rl.limits.MAX_BATCH_ROWS``) is INVALID_ARGUMENT.
"""

from __future__ import annotations

import argparse
import threading
import time

import grpc

from fp8rl import limits, memory
from fp8rl.engines import CalibrationModel, make_calibrator
from fp8rl.presets import load_policy
from fp8rl.refit import (
    RefitError,
    RefitFailedError,
    RefitFollower,
    StaleVersionError,
    UnknownVersionError,
    encode_scales,
)
from fp8rl.rpc import calibrator_pb2, calibrator_pb2_grpc
from services.common.compute import OnComputeThread
from services.common.pictures import RequestPictures
from services.common.refit import build_subscriber
from services.common.runtime import (
    Abort,
    Context,
    Service,
    ServiceSpec,
    check_token_ids,
    env_default,
    require,
    rpc_method,
)

__all__ = ["CalibratorService", "CalibratorServicer", "SPEC"]


class CalibratorService(Service):
    """The calibration model, its refit follower and the CalibratorService servicer."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        policy, tok, path = load_policy(ctx.job.policy.model, language_model_only=ctx.job.policy.language_model_only)
        self.pictures = RequestPictures(policy.config, path)  # a vision-language policy's sequences carry images
        self.vocab_size, self.max_len = policy.config.vocab_size, policy.config.max_position_embeddings
        # the loaded model is the calibrator's own (converted in place): never two copies in this process
        self.target = CalibrationModel(policy, ctx.job.fp8_recipe("calibrator"), take_model=True,
                                       lora=ctx.job.lora_settings())
        del policy
        self.calibrator = make_calibrator(ctx.job, self.target.model, tok.pad_id)
        self.subscriber, self.source = build_subscriber(ctx.store, OnComputeThread(self.target, ctx.compute),
                                                        ctx.replica_id, ctx.job.refit,
                                                        requires_scales=False, metrics=ctx.metrics)
        self.lock = threading.Lock()  # one sync or calibration at a time: weights never change mid-pass
        self.follower = RefitFollower(ctx, self.subscriber, lock=self.lock, in_order=True)

    def servicers(self):
        return [(calibrator_pb2_grpc.add_CalibratorServiceServicer_to_server, CalibratorServicer(self))]

    def start(self, ctx: Context) -> None:
        self.follower.start()
        ctx.set_serving(True)

    def stop(self) -> None:
        self.follower.stop()
        self.source.close()


class CalibratorServicer(calibrator_pb2_grpc.CalibratorServiceServicer):
    """proto ↔ calibrator; validation and status codes, nothing else."""

    def __init__(self, service: CalibratorService) -> None:
        self.s = service

    def _sync(self, version: int) -> None:
        s = self.s
        try:
            s.follower.sync_to(version)
        except StaleVersionError:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                        f"the calibrator already holds weight version {s.target.weight_version}; version {version} "
                        f"is older and its scales were never published") from None
        except UnknownVersionError as exc:
            raise Abort(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except RefitFailedError as exc:
            raise Abort(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    @rpc_method
    def Calibrate(self, request, context):
        s, t0, v = self.s, time.perf_counter(), request.version
        require(v >= 0, f"version must be >= 0, got {v}")
        require(request.sequences, "CalibrateRequest.sequences is empty: calibration needs at least one sequence")
        num, limit = len(request.sequences), s.ctx.args.max_rows
        require(num <= limit, f"CalibrateRequest.sequences: {num} sequences; the limit is {limit} (--max-rows)")
        seqs = [check_token_ids(q.token_ids, s.vocab_size, s.max_len, f"sequence {i}")
                for i, q in enumerate(request.sequences)]
        # a sequence's image-token runs begin with its images' (later ones a response sampled: text)
        images = s.pictures.of_rows(request.images, [q.image_indices for q in request.sequences], seqs,
                                    what="sequence", exact=False)
        stored = s.ctx.store.get_scales(v)
        if stored is None:
            require(s.ctx.store.get_manifest(v) is not None, f"weight version {v} is not published "
                    f"(weights:latest is {s.ctx.store.latest()})", grpc.StatusCode.NOT_FOUND)
            self._sync(v)
            with s.lock:
                if s.target.weight_version != v:  # the follower moved on between the sync and here
                    raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"the calibrator moved on to weight version "
                                f"{s.target.weight_version} before calibrating version {v}")
                with memory.phase("calibrate"):
                    scales = s.ctx.compute(s.calibrator.calibrate, v, seqs, images)
                s.ctx.metrics.calibrations.inc()
                s.ctx.metrics.observe_memory(memory.step_memory())
            try:
                s.ctx.store.put_scales(scales)
                stored = scales
            except RefitError:  # another call published v's scales first: those are the scales of v
                stored = s.ctx.store.get_scales(v)
        return calibrator_pb2.CalibrateResponse(version=v, scales=encode_scales(stored),
                                                seconds=time.perf_counter() - t0)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-rows", type=int, default=int(env_default("max_rows", limits.MAX_BATCH_ROWS)),
                   help="most sequences in one Calibrate call")


SPEC = ServiceSpec(name="calibrator", default_port=50054, build=CalibratorService, add_args=_add_args,
                   follows_refit=True, compute_thread=True)
