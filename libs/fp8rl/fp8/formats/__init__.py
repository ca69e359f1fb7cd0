"""FP8 scaling formats as plug-ins (``fp8_recipe``): one module per format, registered by name.

Every format answers the same questions (:class:`~.base.LinearFormat`: its weight's forward form and scale, each
training GEMM operand, what it refuses), so the linears (:mod:`fp8rl.fp8.linear`), the refit payload
(:mod:`fp8rl.fp8.payload`), the manifest (:mod:`fp8rl.refit.manifest`), the job file's choices, the observatory's
and the benches' labels, and the engines' refusals all read this registry and never list format names:

==================  ==========================  ===========================  ==========================
operand             blockwise (default)         mxfp8                        tensorwise
==================  ==========================  ===========================  ==========================
weight (forward)    128x128 tiles, FP32 scales  1x32 along K, E8M0 scales     one FP32 scale
weight (dgrad)      the same tiles              1x32 along N, from the        the same scale
                                                high-precision weight
x (forward)         1x128 along K               1x32 along K                  one scale (per token with
                                                                              batch-invariant numerics)
dy (dgrad)          1x128 along N               1x32 along N                  one scale
x, dy (wgrad)       1x128 along T               1x32 along T                  one scale
==================  ==========================  ===========================  ==========================

Adding a format: a module here defining a :class:`~.base.LinearFormat` subclass and calling :func:`register`, and
its import below (``docs/ARCHITECTURE.md``, "How to add a numeric format").
"""

from __future__ import annotations

from . import blockwise, mxfp8, tensorwise  # noqa: F401  (each registers itself on import)
from .base import LinearFormat
from .registry import DEFAULT_SCALING, format_names, linear_format, register

SCALINGS: tuple[str, ...] = tuple(format_names())  # every registered format, the default first

__all__ = ["DEFAULT_SCALING", "SCALINGS", "LinearFormat", "format_names", "linear_format", "register"]
