"""Calibrator: pulls a weight version, records Q/K/V amax over sequences, publishes FP32 QKV scales.

Invariant: scales published for version v were measured on the weights of v (the pass holds the refit lock).
"""
