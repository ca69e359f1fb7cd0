"""Routing-replay routes on the wire: a ``(tokens, layers, top_k)`` tensor of expert ids ↔ ``common_pb2.Routes``.

Raw little-endian bytes plus their shape and dtype (no pickles, DESIGN §1); uint8 while a model has at most 256
experts, int16 beyond. :func:`routes_from_proto` checks the bytes against the shape before building a tensor,
so a truncated or padded message is a clear error naming its row, never a silently misaligned route.
"""

from __future__ import annotations

import torch

from .common_pb2 import Routes

__all__ = ["routes_from_proto", "routes_to_proto"]

_DTYPES = {"uint8": torch.uint8, "int16": torch.int16}


def routes_to_proto(routes: torch.Tensor) -> Routes:
    """``routes`` ``(tokens, L, K)`` (uint8 or int16) as a :class:`Routes` message."""
    name = str(routes.dtype).removeprefix("torch.")
    if name not in _DTYPES or routes.dim() != 3:
        raise ValueError(f"routes must be a (tokens, layers, top_k) uint8 or int16 tensor, got {routes.dtype} "
                         f"{tuple(routes.shape)}")
    data = routes.contiguous().cpu()
    raw = data.view(torch.uint8).numpy().tobytes() if name == "uint8" else data.numpy().astype("<i2").tobytes()
    return Routes(ids=raw, dtype=name, layers=routes.shape[1], top_k=routes.shape[2])


def routes_from_proto(msg: Routes, what: str) -> torch.Tensor:
    """The ``(tokens, L, K)`` tensor of a :class:`Routes` message.

    Raises:
        ValueError: an unknown dtype, non-positive axes, or bytes that are not whole ``(L, K)`` rows (the message
            names ``what``, e.g. ``"row 3"``).
    """
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"{what}: routes dtype {msg.dtype[:20]!r} is not uint8 or int16")
    if msg.layers < 1 or msg.top_k < 1:
        raise ValueError(f"{what}: routes need layers >= 1 and top_k >= 1, got {msg.layers} and {msg.top_k}")
    row = msg.layers * msg.top_k * (1 if dtype == torch.uint8 else 2)
    if len(msg.ids) % row:
        raise ValueError(f"{what}: routes hold {len(msg.ids)} bytes, not a whole number of {msg.layers} x "
                         f"{msg.top_k} {msg.dtype} rows")
    if not msg.ids:
        return torch.empty(0, msg.layers, msg.top_k, dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.ids), dtype=torch.uint8)
    if dtype == torch.int16:
        flat = flat.view(torch.int16)  # little-endian on every host fp8rl runs on (x86-64, aarch64)
    return flat.view(-1, msg.layers, msg.top_k).clone()
