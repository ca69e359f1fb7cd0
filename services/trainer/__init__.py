"""Trainer: owns the policy's master weights and optimizer; serves TrainerService and the WeightStore."""
