"""The one refit payload lifecycle of every engine: create → process after loading → apply.

A refit payload is what arrives with a new weight version: Hugging Face-named tensors (master weights
in high precision, or an FP8 linear's E4M3 ``X.weight`` plus its FP32 ``X.weight_scale`` as the trainer
ships it) and, for an FP8 KV cache, the :class:`QKVScales` of that same version. The torch rollout
engine, the vLLM rollout engine and the calibrator's model all run it through the same three steps:

1. **create** — :meth:`RefitPayload.create` checks the payload against a :class:`PayloadSpec` (what the
   engine holds: names, shapes, dtypes): the version is not older than the held one, the QKV scales are
   of this version and cover every FP8-KV attention layer, every expected tensor is there and nothing
   else, shapes match, high-precision tensors are high-precision floats with no NaN/Inf, shipped FP8
   weights come with a scale of their format's shape and dtype (:mod:`fp8rl.fp8.formats`: FP32 per 128×128 block,
   uint8 E8M0 per 1×32, or one FP32) that is finite and > 0 — for E8M0, not 0xFF (its NaN).
2. **process after loading** — :meth:`RefitPayload.process` puts every tensor in the form the engine
   computes with: an FP8 linear's master weight is quantized to E4M3 in its format's forward form
   (blockwise: :func:`quantize_blockwise`, pow2 per the recipe — exactly as the trainer rounds it; its NaN/Inf
   check happens here), a shipped E4M3 weight is taken as
   it is; every other tensor (the linears the recipe keeps in high precision — the first/last BF16
   layers, ``lm_head`` — embeddings, norms) is cast to the engine's dtype and device. With
   ``PayloadSpec.dequantize_fp8`` an E4M3 weight of a linear kept in high precision is dequantized
   (``x ≈ q.float() * scale``: the weights the rollout computes with).
3. **apply** — :meth:`ProcessedPayload.apply` swaps everything into an fp8rl model in place (``copy_``,
   so tensor identity and any pointer a kernel captured survive) together with the QKV scales of the
   same version. The vLLM engine instead ships :meth:`ProcessedPayload.checkpoint` to its workers,
   which reload weights and scales in one call.

Invariant: a bad payload raises :class:`WeightLoadError` naming the tensor in step 1 or 2, before a
single live tensor is touched, so the engine keeps serving the version it held.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .formats import LinearFormat, linear_format
from .kv import QKVQuantizer, QKVScales
from .linear import Fp8InferenceLinear
from .quant import E4M3, check_finite

__all__ = [
    "WeightLoadError", "TensorSpec", "Fp8LinearSpec", "PayloadSpec", "RefitPayload", "ProcessedPayload",
    "check_qkv_scales", "load_qkv_scales", "qkv_quantizers",
]

_CPU = torch.device("cpu")


# A LoRA adapter matrix's name ends so (PEFT's state-dict names, fp8rl.model.lora): a refit payload after a LoRA job's
# base holds these alone; every other tensor is the frozen base's
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter(name: str) -> bool:
    """Whether tensor ``name`` is a LoRA adapter matrix (else it belongs to the model's base)."""
    return name.endswith(ADAPTER_SUFFIXES)


class WeightLoadError(ValueError):
    """A refit payload was refused (missing/unknown tensor, wrong shape/dtype, NaN, stale version).

    The engine keeps serving the weights it held before the failed load.
    """


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the engine holds in high precision: its shape and the dtype/device it is kept in."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device = _CPU


@dataclass(frozen=True)
class Fp8LinearSpec:
    """A linear the engine runs in FP8: E4M3 ``(out_features, in_features)`` + its format's scales.

    Attributes:
        pow2_scale: quantize master weights with power-of-two scales (the recipe's
            ``pow2_weight_scaling_factors``).
        device: where the engine keeps the weight and its scale.
        scaling: the format (:mod:`fp8rl.fp8.formats`): ``blockwise``, ``mxfp8`` or ``tensorwise``.
    """

    out_features: int
    in_features: int
    pow2_scale: bool = False
    device: torch.device = _CPU
    scaling: str = "blockwise"

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def fmt(self) -> LinearFormat:
        return linear_format(self.scaling)

    @property
    def scale_shape(self) -> tuple[int, int]:
        return self.fmt.scale_shape(self.out_features, self.in_features)


@dataclass(frozen=True)
class PayloadSpec:
    """What a full refit payload of one engine holds.

    Attributes:
        tensors: HF name → :class:`TensorSpec` of every tensor kept in high precision (an FP8
            linear's bias included).
        fp8_linears: HF prefix (``model.layers.3.self_attn.q_proj``) → :class:`Fp8LinearSpec` of
            every linear run in FP8; the payload holds ``{prefix}.weight`` in high precision, or in
            E4M3 together with ``{prefix}.weight_scale``.
        num_kv_layers: attention layers of an FP8 KV cache (each version needs its QKV scales), or
            None when the KV cache is not FP8 (scales are then not used).
        dequantize_fp8: accept a high-precision ``X.weight`` as E4M3 + ``X.weight_scale`` and
            dequantize it (the calibrator, whose recipe may keep linears the rollout runs in FP8
            in high precision).
        scaling: the format such an E4M3 ``X.weight`` arrives in (the job's ``fp8_recipe``).
        adapters: the names of a LoRA model's adapter matrices (:mod:`fp8rl.model.lora`; in ``tensors`` too): a
            payload of exactly these is a refit after the base (:meth:`for_payload`).
    """

    tensors: Mapping[str, TensorSpec]
    fp8_linears: Mapping[str, Fp8LinearSpec] = field(default_factory=dict)
    num_kv_layers: int | None = None
    dequantize_fp8: bool = False
    scaling: str = "blockwise"
    adapters: frozenset[str] = frozenset()

    @classmethod
    def for_model(cls, model: nn.Module, *, dequantize_fp8: bool = False) -> PayloadSpec:
        """The spec of a model converted with ``convert_model(..., mode="inference")``: its parameters
        (a tied ``lm_head`` counted once), its :class:`Fp8InferenceLinear` layers and its QKV quantizers."""
        fp8 = {n: m for n, m in model.named_modules() if isinstance(m, Fp8InferenceLinear)}
        tensors = {n: TensorSpec(tuple(p.shape), p.dtype, p.device) for n, p in _weights(model)}
        for prefix, mod in fp8.items():
            if mod.bias is not None:
                tensors[f"{prefix}.bias"] = TensorSpec(tuple(mod.bias.shape), mod.bias.dtype, mod.bias.device)
        linears = {p: Fp8LinearSpec(m.out_features, m.in_features, m.pow2_weight_scale, m.weight.device, m.scaling)
                   for p, m in fp8.items()}
        recipe = getattr(model, "fp8_recipe", None)
        return cls(tensors, linears, len(qkv_quantizers(model)) or None, dequantize_fp8,
                   getattr(recipe, "scaling", "blockwise"), frozenset(n for n in tensors if is_adapter(n)))

    def adapters_only(self) -> PayloadSpec | None:
        """The spec of a payload holding a LoRA model's adapters alone (a refit after the base: the engine keeps its
        base), or None for a model without adapters."""
        if not self.adapters:
            return None
        return PayloadSpec({n: self.tensors[n] for n in sorted(self.adapters)}, {}, self.num_kv_layers,
                           self.dequantize_fp8, self.scaling, self.adapters)

    def for_payload(self, tensors: Mapping[str, torch.Tensor], held: int | None) -> PayloadSpec:
        """This spec, or its :meth:`adapters_only` one when ``tensors`` are exactly a LoRA model's adapters.

        Raises:
            WeightLoadError: adapters alone, but the engine holds no version yet (its base came from no refit).
        """
        part = self.adapters_only()
        if part is None or set(tensors) != set(part.tensors):
            return self
        if held is None:
            raise WeightLoadError("refit payload holds LoRA adapters only, but this engine holds no weight version "
                                  "yet: the first refit must carry the base")
        return part

    def expected_names(self) -> set[str]:
        """The tensor names a full payload must provide (block scales of shipped FP8 weights come on top)."""
        return set(self.tensors) | {f"{p}.weight" for p in self.fp8_linears}


def qkv_quantizers(model: nn.Module) -> list[QKVQuantizer]:
    """The model's :class:`QKVQuantizer` modules in layer order (empty when its KV cache is not FP8)."""
    return [m for m in model.modules() if isinstance(m, QKVQuantizer)]


def check_qkv_scales(
    qkv_scales: QKVScales | None, version: int | None, num_layers: int | None, *, holder: str = "the weights are"
) -> QKVScales | None:
    """The QKV scales to install with ``version``, or None when there is no FP8 KV cache (``num_layers`` None).

    Raises:
        WeightLoadError: scales missing, of another version than ``version`` (``holder`` words the
            message: "the weights are", "the engine holds"), or not one per layer.
    """
    if num_layers is None:
        return None
    if qkv_scales is None:
        raise WeightLoadError(f"kv_cache_dtype=fp8 needs the QKV scales of version {version}; none were given")
    if qkv_scales.version != version:
        raise WeightLoadError(f"QKV scales are for version {qkv_scales.version} but {holder} version {version}")
    if qkv_scales.num_layers != num_layers:
        raise WeightLoadError(f"QKV scales cover {qkv_scales.num_layers} layers, model has {num_layers}")
    return qkv_scales


def load_qkv_scales(model: nn.Module, qkv_scales: QKVScales) -> None:
    """Write ``qkv_scales`` into the model's quantizers in place, tagged with their version."""
    quantizers = qkv_quantizers(model)
    if qkv_scales.num_layers != len(quantizers):
        raise WeightLoadError(f"QKV scales cover {qkv_scales.num_layers} layers, model has {len(quantizers)}")
    for i, qz in enumerate(quantizers):
        qz.set_scales(qkv_scales.q[i], qkv_scales.k[i], qkv_scales.v[i], qkv_scales.version)


def _scale_name(weight_name: str) -> str:
    return f"{weight_name.removesuffix('.weight')}.weight_scale"


def _check_scale(fmt: LinearFormat, name: str, s: torch.Tensor, weight_shape: tuple[int, ...]) -> None:
    try:
        fmt.check_scale(name, s, tuple(weight_shape))
    except ValueError as e:
        raise WeightLoadError(str(e)) from None


def _weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a version holds besides the FP8 linears: every parameter, and every persistent float buffer that is model
    state (a DeepSeek router's ``e_score_correction_bias``: not trained by gradient, but part of the weights), not the
    runtime state of an FP8 layer or of the QKV quantizers (their scales come with the version separately)."""
    out = list(model.named_parameters())
    skip = {f"{n}.{b}" for n, m in model.named_modules() if isinstance(m, Fp8InferenceLinear | QKVQuantizer)
            for b, _ in m.named_buffers(recurse=False)}
    persistent = set(model.state_dict())
    out += [(n, b) for n, b in model.named_buffers()
            if n in persistent and n not in skip and b.is_floating_point() and b.dtype != E4M3]
    return out


@dataclass(frozen=True)
class RefitPayload:
    """A payload that passed :meth:`create`'s checks (step 1); :meth:`process` is step 2."""

    spec: PayloadSpec
    version: int
    tensors: Mapping[str, torch.Tensor]
    qkv_scales: QKVScales | None
    dequantized: frozenset[str] = frozenset()  # high-precision names that arrived as E4M3 + weight_scale

    @classmethod
    def create(
        cls,
        spec: PayloadSpec,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        qkv_scales: QKVScales | None = None,
        *,
        held: int | None = None,
    ) -> RefitPayload:
        """Check ``tensors`` (and ``qkv_scales``) against ``spec``; nothing is converted or applied yet.

        Args:
            held: the version the engine holds; an older ``version`` is refused. None skips the check.

        Raises:
            WeightLoadError: naming the first bad tensor (or the version / scales problem).
        """
        if held is not None and version < held:
            raise WeightLoadError(f"refusing weight version {version}: this engine already holds {held}")
        scales = check_qkv_scales(qkv_scales, version, spec.num_kv_layers)
        dequantized = frozenset(
            n for n, ts in spec.tensors.items() if spec.dequantize_fp8 and n.endswith(".weight")
            and len(ts.shape) == 2 and n in tensors and tensors[n].dtype == E4M3 and _scale_name(n) in tensors
        )
        allowed_scales = {f"{p}.weight_scale" for p in spec.fp8_linears} | {_scale_name(n) for n in dequantized}
        expected = spec.expected_names()
        missing = sorted(expected - set(tensors))
        unknown = sorted(set(tensors) - expected - allowed_scales)
        if missing:
            raise WeightLoadError(f"refit payload is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        if unknown:
            raise WeightLoadError(f"refit payload has {len(unknown)} unknown tensor(s), e.g. {unknown[:3]}")
        try:
            for name, ts in spec.tensors.items():
                t = tensors[name]
                if tuple(t.shape) != tuple(ts.shape):
                    raise WeightLoadError(f"{name}: shape {tuple(t.shape)} != expected {tuple(ts.shape)}")
                if name in dequantized:  # E4M3 + its scale; finiteness is checked once dequantized
                    _check_scale(linear_format(spec.scaling), _scale_name(name), tensors[_scale_name(name)], t.shape)
                    continue
                if not t.is_floating_point() or t.dtype == E4M3:
                    raise WeightLoadError(f"{name}: dtype {t.dtype} is not a high-precision float")
                check_finite(t, name)
            for prefix, lin in spec.fp8_linears.items():
                w = tensors[f"{prefix}.weight"]
                if tuple(w.shape) != lin.shape:
                    raise WeightLoadError(f"{prefix}.weight: shape {tuple(w.shape)} != expected {lin.shape}")
                if w.dtype == E4M3:
                    s = tensors.get(f"{prefix}.weight_scale")
                    if s is None:
                        raise WeightLoadError(f"{prefix}.weight is E4M3 but {prefix}.weight_scale is missing")
                    _check_scale(lin.fmt, f"{prefix}.weight_scale", s, lin.shape)
                elif not w.is_floating_point():
                    raise WeightLoadError(f"{prefix}.weight: dtype {w.dtype} is not a float")
                # a master weight's NaN/Inf check comes with its quantization (process)
        except WeightLoadError:
            raise
        except ValueError as e:  # check_finite names the tensor
            raise WeightLoadError(str(e)) from e
        return cls(spec, version, tensors, scales, dequantized)

    def process(self) -> ProcessedPayload:
        """Step 2: every tensor in the form and place the engine computes with (see the module docstring).

        Raises:
            WeightLoadError: a master weight (or a dequantized one) holds NaN/Inf, naming it.
        """
        out: dict[str, torch.Tensor] = {}
        fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        try:
            for name, ts in self.spec.tensors.items():
                t = self.tensors[name]
                if name in self.dequantized:
                    t = linear_format(self.spec.scaling).dequantize_weight(t, self.tensors[_scale_name(name)])
                    check_finite(t, name)
                out[name] = t.to(device=ts.device, dtype=ts.dtype)
            for prefix, lin in self.spec.fp8_linears.items():
                w = self.tensors[f"{prefix}.weight"]
                if w.dtype == E4M3:  # shipped quantized: copied as it arrived
                    q, s = w, self.tensors[f"{prefix}.weight_scale"]
                else:  # master weight: rounded exactly as the trainer rounds it
                    q, s = lin.fmt.quantize_weight(w, pow2=lin.pow2_scale, name=f"{prefix}.weight")
                fp8[prefix] = (q.to(lin.device), s.to(lin.device, lin.fmt.scale_dtype))
        except ValueError as e:  # check_finite and the format's quantizers name the tensor
            raise WeightLoadError(str(e)) from e
        return ProcessedPayload(self.version, out, fp8, self.qkv_scales)


@dataclass(frozen=True)
class ProcessedPayload:
    """A checked payload in the engine's form (step 2's result); :meth:`apply` is step 3.

    Attributes:
        version: the weight version.
        tensors: HF name → high-precision tensor in the engine's dtype and device.
        fp8: FP8 linear prefix → ``(E4M3 weight, its format's scale)``.
        qkv_scales: the scales of ``version`` (None without an FP8 KV cache).
    """

    version: int
    tensors: Mapping[str, torch.Tensor]
    fp8: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    qkv_scales: QKVScales | None

    def checkpoint(self, scale_suffix: str = "weight_scale") -> dict[str, torch.Tensor]:
        """Flat HF-named, contiguous tensors: ``X.weight`` (E4M3) + ``X.<scale_suffix>`` per FP8 linear
        (vLLM's checkpoint calls the block scale ``weight_scale_inv``)."""
        out = {n: t.contiguous() for n, t in self.tensors.items()}
        for prefix, (q, s) in self.fp8.items():
            out[f"{prefix}.weight"] = q.contiguous()
            out[f"{prefix}.{scale_suffix}"] = s.contiguous()
        return out

    @torch.no_grad()
    def apply(self, model: nn.Module) -> None:
        """Step 3: copy everything into ``model``'s live tensors in place (never rebinding a parameter or
        buffer), the QKV scales of the same version last. Callers hold the lock their forward passes take.

        Raises:
            WeightLoadError: ``model`` is not the one the spec was made for (checked before any copy).
        """
        params = dict(_weights(model))
        modules = dict(model.named_modules())
        linears = {p: modules.get(p) for p in self.fp8}
        wrong = sorted(p for p, m in linears.items() if not isinstance(m, Fp8InferenceLinear))
        wrong += sorted(n for n in self.tensors if n not in params and n.removesuffix(".bias") not in self.fp8)
        if wrong:
            raise WeightLoadError(f"payload of version {self.version} does not fit this model: {wrong[:3]}")
        quantizers = qkv_quantizers(model)
        if self.qkv_scales is not None and self.qkv_scales.num_layers != len(quantizers):
            raise WeightLoadError(f"QKV scales cover {self.qkv_scales.num_layers} layers, model has {len(quantizers)}")
        for name, t in self.tensors.items():
            if name in params:
                params[name].copy_(t)
        for prefix, (q, s) in self.fp8.items():
            linears[prefix].load_quantized(q, s, self.tensors.get(f"{prefix}.bias"), name=f"{prefix}.weight")
        if self.qkv_scales is not None:
            load_qkv_scales(model, self.qkv_scales)
