"""Trainer: owns the policy's master weights and optimizer; serves TrainerService and the WeightStore.

Invariant: a version is published (with its lineage, ``trained_from`` / ``restored_from``) before any caller
learns of it, and versions only increase.
"""
