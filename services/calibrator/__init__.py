"""Calibrator: pulls a weight version, records Q/K/V amax over sequences, publishes FP32 QKV scales."""
