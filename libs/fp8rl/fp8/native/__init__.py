"""Fused CPU kernels, built on first use with the machine's C compiler: the E4M3 quantizers (``e4m3_cpu.c``) and
the softmax of the batch-invariant attention (``softmax_cpu.c``).

The torch paths in :mod:`fp8rl.fp8.quant` and :mod:`fp8rl.model.invariant` are the definition of every number; these
kernels compute the same numbers (bitwise: ``tests/unit/fp8/test_native.py``) in one pass over a group's values
instead of five to ten torch ops, each a pass over memory and a dispatch. They are a speed-up with an exact fallback:
where there is no compiler (a slim container image), the source cannot be built, ``FP8RL_NATIVE=0`` is set, or a
tensor is not a contiguous FP32 CPU tensor, each function returns None (or False) and the caller takes the torch
path — the same numbers either way, so a rollout with the kernels and a trainer without them still agree bitwise.

The library is built once per source set, compiler and CPU into ``$FP8RL_CACHE/native`` (``~/.cache/fp8rl/native``)
with ``-O3 -march=native -ffp-contract=off`` (never ``-ffast-math``: IEEE single-precision division and no fused
multiply-add, so the division ``x / scale`` and the product ``value * scale`` are the torch path's); building takes
about a second and happens in a temporary file renamed into place, so processes that start together do not see a
half-written library.

One thread by default (``FP8RL_NATIVE_THREADS``: more): the calls come between GEMMs, whose OpenMP workers keep
spinning for a while after each one, and a second thread of ours then fights them for the core — measured on a
2-core VM, a linear's forward + backward took 1.6x its FP32 time with 2 threads here, 1.25x with 1. The numbers do
not depend on the thread count (each thread writes its own rows or columns).

Measured (``bench/RESULTS.md``, 2026-12-07): one pass instead of 5-8 cut SmolLM2-135M's fp8_e2e step from 1.38x the
bf16 step to 1.07x.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["available", "disabled", "fake_rows", "quant_rows", "fake_cols", "quant_cols", "dequant_cols",
           "quant_blocks", "dequant_blocks", "quant_tensor", "dequant_tensor", "round_e4m3", "softmax_prep",
           "softmax_finish", "softmax_backward"]

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in ("e4m3_cpu.c", "softmax_cpu.c")]
# IEEE arithmetic (no -ffast-math, no FMA contraction); -fno-trapping-math only lets GCC turn the clamps' compares
# into vector selects (it assumes no one reads the FP exception flags), which changes no value
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fPIC", "-shared",
          "-std=c11"]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_OFF = 0  # > 0 inside disabled()
_I64, _INT, _P = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "fp8rl_fake_rows": [_P, _P, _I64, _I64, _I64, _INT],
    "fp8rl_quant_rows": [_P, _P, _P, _I64, _I64, _I64, _INT],
    "fp8rl_fake_cols": [_P, _P, _I64, _I64, _I64, _INT],
    "fp8rl_quant_cols": [_P, _P, _P, _I64, _I64, _I64, _INT],
    "fp8rl_dequant_cols": [_P, _P, _P, _I64, _I64, _I64, _INT],
    "fp8rl_quant_blocks": [_P, _P, _P, _I64, _I64, _I64, _I64],
    "fp8rl_dequant_blocks": [_P, _P, _P, _I64, _I64, _I64, _I64],
    "fp8rl_quant_tensor": [_P, _P, _I64, ctypes.c_float],
    "fp8rl_dequant_tensor": [_P, _P, _I64, ctypes.c_float],
    "fp8rl_round_e4m3": [_P, _P, _I64],
    "fp8rl_softmax_prep": [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float],
    "fp8rl_softmax_finish": [_P, _P, _I64, _I64, _I64, _I64, _I64, _I64],
    "fp8rl_softmax_backward": [_P, _P, _I64, _I64],
}
_MAX_CHUNK = 4096  # softmax_cpu.c's MAX_CHUNK
_RESTYPES = {"fp8rl_quant_blocks": ctypes.c_int}


def _cpu_tag() -> str:
    """What ``-march=native`` sees: the CPU's model and flags (a cache shared by machines keeps one build each)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        log.info("fp8rl.fp8.native: no C compiler; the torch paths are used")
        return None
    try:
        source = b"\0".join(path.read_bytes() for path in _SOURCES)
    except OSError as exc:  # an install without the package's C source
        log.info("fp8rl.fp8.native: no kernel source (%s); the torch paths are used", exc)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), cc.encode(), version.encode(),
                                     _cpu_tag().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("FP8RL_CACHE", Path.home() / ".cache" / "fp8rl")) / "native"
    lib = root / f"fp8rl_cpu-{key}.so"
    if not lib.exists():
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
            os.close(fd)
            proc = subprocess.run([cc, *_FLAGS, "-o", tmp, *map(str, _SOURCES), "-lpthread"], capture_output=True,
                                  text=True, timeout=120)
            if proc.returncode:
                os.unlink(tmp)
                log.warning("fp8rl.fp8.native: building the kernels failed (the torch paths are used): %s",
                            proc.stderr.strip()[-500:])
                return None
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("fp8rl.fp8.native: cannot build in %s (the torch path is used): %s", root, exc)
            return None
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as exc:
        log.warning("fp8rl.fp8.native: cannot load %s (the torch path is used): %s", lib, exc)
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(handle, name)
        fn.argtypes, fn.restype = args, _RESTYPES.get(name)
    return handle


def _lib() -> ctypes.CDLL | None:
    global _LIB, _TRIED
    if _OFF:
        return None
    if _TRIED:
        return _LIB
    with _LOCK:
        if not _TRIED:
            _LIB = None if os.environ.get("FP8RL_NATIVE", "1") == "0" else _build()
            _TRIED = True
    return _LIB


def available() -> bool:
    """Whether the kernels are built and loaded in this process (``FP8RL_NATIVE=0`` turns them off)."""
    return _lib() is not None


@contextlib.contextmanager
def disabled():
    """The torch path for every quantizer while inside (the tests compare the two; not thread-local)."""
    global _OFF
    _OFF += 1
    try:
        yield
    finally:
        _OFF -= 1


def _recording(t: torch.Tensor) -> bool:
    """Whether autograd records ops on ``t`` now (the torch path then runs, keeping its graph)."""
    return t.requires_grad and torch.is_grad_enabled()


def _usable(x: torch.Tensor) -> bool:
    """A contiguous FP32 CPU tensor that autograd is not recording."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() and x.dim() >= 1
            and not _recording(x))


def _codes(q: torch.Tensor) -> bool:
    """A contiguous, non-empty E4M3 CPU tensor that autograd is not recording."""
    return (q.device.type == "cpu" and q.dtype == torch.float8_e4m3fn and q.is_contiguous() and q.numel() > 0
            and not _recording(q))


def _threads() -> int:
    return int(os.environ.get("FP8RL_NATIVE_THREADS", "1"))


def fake_rows(x: torch.Tensor, group: int) -> torch.Tensor | None:
    """``fake_quantize_per_token_group(x, group)`` (pow2 off), or None where the kernels do not apply."""
    lib = _lib()
    if lib is None or not _usable(x) or x.numel() == 0:
        return None
    k = x.shape[-1]
    out = torch.empty_like(x)
    lib.fp8rl_fake_rows(x.data_ptr(), out.data_ptr(), x.numel() // k, k, group, _threads())
    return out


def quant_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantize_per_token_group(x, group)`` (pow2 off): E4M3 codes of ``x``'s shape, FP32 scales
    ``(..., ceil(K / group))``; or None."""
    lib = _lib()
    if lib is None or not _usable(x) or x.numel() == 0:
        return None
    k = x.shape[-1]
    g = -(-k // group)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(*x.shape[:-1], g, dtype=torch.float32)
    lib.fp8rl_quant_rows(x.data_ptr(), q.data_ptr(), scale.data_ptr(), x.numel() // k, k, group, _threads())
    return q, scale


def fake_cols(x: torch.Tensor, group: int) -> torch.Tensor | None:
    """``fake_quantize_columnwise(x, group)`` of a ``(T, K)`` tensor (pow2 off), or None."""
    lib = _lib()
    if lib is None or not _usable(x) or x.dim() != 2 or x.numel() == 0:
        return None
    out = torch.empty_like(x)
    lib.fp8rl_fake_cols(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], group, _threads())
    return out


def quant_cols(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``quantize_columnwise(x, group)`` of a ``(T, K)`` tensor (pow2 off): codes ``(T, K)``, scales
    ``(ceil(T / group), K)``; or None."""
    lib = _lib()
    if lib is None or not _usable(x) or x.dim() != 2 or x.numel() == 0:
        return None
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-t // group), k, dtype=torch.float32)
    lib.fp8rl_quant_cols(x.data_ptr(), q.data_ptr(), scale.data_ptr(), t, k, group, _threads())
    return q, scale


def dequant_cols(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor | None:
    """``dequantize_columnwise(q, scale, group)``: FP32 ``(T, K)``; or None."""
    lib = _lib()
    if (lib is None or not _codes(q) or q.dim() != 2 or not _usable(scale)
            or tuple(scale.shape) != (-(-q.shape[0] // group), q.shape[1])):
        return None
    out = torch.empty(q.shape, dtype=torch.float32)
    lib.fp8rl_dequant_cols(q.data_ptr(), scale.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], group,
                           _threads())
    return out


def quant_blocks(w: torch.Tensor, bm: int, bn: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """``quantize_blockwise(w, (bm, bn))`` (pow2 off) of a 2-D tensor, into ``out`` when given (contiguous E4M3 and
    FP32 tensors of the result's shapes, checked by the caller): ``(codes, scales, every value finite)``; or None.
    A BF16 / FP16 weight is upcast first, as the torch path does."""
    lib = _lib()
    if (lib is None or w.device.type != "cpu" or w.dim() != 2 or w.numel() == 0 or not w.is_floating_point()
            or _recording(w)):
        return None
    w = w.float().contiguous()
    m, n = w.shape
    if out is None:
        q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
        scale = torch.empty(-(-m // bm), -(-n // bn), dtype=torch.float32)
    else:
        q, scale = out
    finite = lib.fp8rl_quant_blocks(w.data_ptr(), q.data_ptr(), scale.data_ptr(), m, n, bm, bn)
    if out is not None:  # written through their pointers
        torch.autograd.graph.increment_version([q, scale])
    return q, scale, bool(finite)


def dequant_blocks(q: torch.Tensor, scale: torch.Tensor, bm: int, bn: int, out: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
    """``dequantize_blockwise(q, scale, (bm, bn))``: FP32, into ``out`` when given (contiguous FP32 of ``q``'s
    shape: the caller checks); or None (shapes are the caller's to check)."""
    lib = _lib()
    if (lib is None or not _codes(q) or q.dim() != 2 or not _usable(scale)
            or out is not None and not _usable(out)):
        return None
    target = torch.empty(q.shape, dtype=torch.float32) if out is None else out
    lib.fp8rl_dequant_blocks(q.data_ptr(), scale.data_ptr(), target.data_ptr(), q.shape[0], q.shape[1], bm, bn)
    if out is not None:  # written through its pointer: tell autograd, which checks saved tensors' versions
        torch.autograd.graph.increment_version(out)
    return target


def quant_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """The E4M3 codes of ``x / scale`` clamped to ±448 (``quantize_per_tensor`` with a given FP32 scale); or None."""
    lib = _lib()
    if (lib is None or not _usable(x) or x.numel() == 0 or scale.numel() != 1 or scale.dtype != torch.float32
            or _recording(scale)):
        return None
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    lib.fp8rl_quant_tensor(x.data_ptr(), q.data_ptr(), x.numel(), float(scale))
    return q


def dequant_tensor(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """FP32 ``q.float() * scale`` for one FP32 scale; or None."""
    lib = _lib()
    if lib is None or not _codes(q) or scale.numel() != 1 or scale.dtype != torch.float32 or _recording(scale):
        return None
    out = torch.empty(q.shape, dtype=torch.float32)
    lib.fp8rl_dequant_tensor(q.data_ptr(), out.data_ptr(), q.numel(), float(scale))
    return out


def round_e4m3(x: torch.Tensor) -> torch.Tensor | None:
    """``x.to(float8_e4m3fn).float()`` of an FP32 tensor (no scale, no clamp: torch's cast exactly); or None."""
    lib = _lib()
    if lib is None or not _usable(x) or x.numel() == 0:
        return None
    out = torch.empty_like(x)
    lib.fp8rl_round_e4m3(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def _softmax_shapes(rows: torch.Tensor, visible: torch.Tensor, hkv: int, rep: int) -> bool:
    """``rows`` ``(B·Hkv, ≥ rep·T, Sc)`` contiguous FP32 and ``visible`` ``(B, T, Sc)`` contiguous bool."""
    return (_usable(rows) and rows.dim() == 3 and visible.device.type == "cpu" and visible.dtype == torch.bool
            and visible.is_contiguous() and visible.dim() == 3 and rows.shape[0] == visible.shape[0] * hkv
            and rows.shape[1] >= rep * visible.shape[1] and rows.shape[2] == visible.shape[2] and rows.numel() > 0)


def softmax_prep(s: torch.Tensor, visible: torch.Tensor, hkv: int, rep: int, scale: float) -> torch.Tensor | None:
    """The split-KV softmax's shifted scores ``d`` ``(B·Hkv, rep·T, Sc)`` (``softmax_cpu.c``) from the scores GEMM's
    output ``s`` ``(B·Hkv, Mp, Sc)`` (its first ``rep·T`` rows of each group used) and ``visible`` ``(B, T, Sc)``;
    or None."""
    lib = _lib()
    if lib is None or not _softmax_shapes(s, visible, hkv, rep):
        return None
    g, mp, sc = s.shape
    t = visible.shape[1]
    d = torch.empty(g, rep * t, sc, dtype=torch.float32)
    lib.fp8rl_softmax_prep(s.data_ptr(), d.data_ptr(), visible.data_ptr(), g, hkv, rep, t, mp, sc, scale)
    return d


def softmax_finish(e: torch.Tensor, visible: torch.Tensor, hkv: int, rep: int, chunk: int) -> bool:
    """``exp(d)`` ``(B·Hkv, rep·T, Sc)`` into the probabilities, in place (``softmax_cpu.c``); False (nothing
    written) where the kernels do not apply."""
    lib = _lib()
    if (lib is None or not _softmax_shapes(e, visible, hkv, rep) or e.shape[1] != rep * visible.shape[1]
            or not 1 <= chunk <= _MAX_CHUNK or e.shape[2] % chunk):
        return False
    lib.fp8rl_softmax_finish(e.data_ptr(), visible.data_ptr(), e.shape[0], hkv, rep, visible.shape[1], e.shape[2],
                             chunk)
    torch.autograd.graph.increment_version(e)
    return True


def softmax_backward(dp: torch.Tensor, p: torch.Tensor) -> bool:
    """``dp ← p ∘ (dp − rowsum(dp ∘ p))`` in place over the last dimension (softmax's backward); False (nothing
    written) where the kernels do not apply."""
    lib = _lib()
    if lib is None or not _usable(dp) or not _usable(p) or dp.shape != p.shape or dp.numel() == 0:
        return False
    n = dp.shape[-1]
    lib.fp8rl_softmax_backward(dp.data_ptr(), p.data_ptr(), dp.numel() // n, n)
    torch.autograd.graph.increment_version(dp)
    return True
