"""Typed gRPC client SDK and the `fp8rl` CLI."""
