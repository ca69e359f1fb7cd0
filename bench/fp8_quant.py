"""Quantize throughput vs a plain copy of the same tensor, measured side by side in one run.

    python bench/fp8_quant.py [--rows 4096 --cols 4096 --dtype float32 --repeats 5]

Prints GB/s of *input* bytes for ``quantize_blockwise`` (weights, 128×128) and
``quantize_per_token_group`` (activations, 1×128) next to ``dst.copy_(src)`` on the same tensor,
and their ratio (target on CPU: ≥ 0.25× copy bandwidth). Times are the median of ``--repeats``
runs after a warm-up, because these machines are noisy. On a CUDA device (``--device cuda``) it
also times the FP8 GEMM against a BF16 GEMM.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp8rl.fp8 import fp8_gemm, quantize_blockwise, quantize_per_token_group, select_backend


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(args.rows, args.cols, dtype=getattr(torch, args.dtype), device=dev)
    dst = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    t_copy = _median_time(lambda: dst.copy_(x), args.repeats, sync)
    t_block = _median_time(lambda: quantize_blockwise(x), args.repeats, sync)
    t_group = _median_time(lambda: quantize_per_token_group(x), args.repeats, sync)
    res = {
        "copy_GBps": nbytes / t_copy / 1e9,
        "blockwise_GBps": nbytes / t_block / 1e9,
        "per_token_group_GBps": nbytes / t_group / 1e9,
    }
    res["blockwise_vs_copy"] = res["blockwise_GBps"] / res["copy_GBps"]
    res["per_token_group_vs_copy"] = res["per_token_group_GBps"] / res["copy_GBps"]
    print(f"fp8 quantize on {dev} ({select_backend(dev)} backend), {args.rows}x{args.cols} {args.dtype}, "
          f"torch {torch.__version__}, threads={torch.get_num_threads()}")
    print(f"  copy                : {res['copy_GBps']:7.2f} GB/s")
    print(f"  blockwise 128x128   : {res['blockwise_GBps']:7.2f} GB/s  = {res['blockwise_vs_copy']:.2f}x copy")
    print(f"  per_token_group 1x128: {res['per_token_group_GBps']:6.2f} GB/s"
          f"  = {res['per_token_group_vs_copy']:.2f}x copy")
    if dev.type == "cuda":
        m, k, n = 4096, 4096, 14336
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        aq, as_ = quantize_per_token_group(a)
        bq, bs = quantize_blockwise(b)
        t_bf16 = _median_time(lambda: a @ b.t(), args.repeats, sync)
        t_fp8 = _median_time(lambda: fp8_gemm(aq, as_, bq, bs, torch.bfloat16), args.repeats, sync)
        res["gemm_fp8_vs_bf16"] = t_bf16 / t_fp8
        print(f"  GEMM {m}x{k}x{n}: bf16 {2 * m * n * k / t_bf16 / 1e12:.0f} TFLOP/s, fp8 "
              f"{2 * m * n * k / t_fp8 / 1e12:.0f} TFLOP/s = {res['gemm_fp8_vs_bf16']:.2f}x")
    return res


if __name__ == "__main__":
    main()
