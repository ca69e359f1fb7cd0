"""Rollout replica: samples responses at one pinned weight version; refitted through Redis + WeightStore."""
