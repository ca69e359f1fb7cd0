"""Rollout replica: samples responses at one pinned weight version; refitted through Redis + WeightStore.

Invariant: a sample is produced at exactly one version, with the QKV scales of that version (FP8 KV).
"""
