"""Shared fixtures of the unit tests."""

import pytest


@pytest.fixture(params=["fused", "torch"])
def native_path(request):
    """Each test on both paths of the CPU kernels: the fused ones (``fp8rl.fp8.native``: the E4M3 quantizers, the
    invariant attention's softmax; skipped where they are not built) and the torch ops that define their numbers."""
    from fp8rl.fp8 import native

    if request.param == "fused":
        if not native.available():
            pytest.skip("no C compiler: the fused kernels are not built")
        yield request.param
    else:
        with native.disabled():
            yield request.param
