"""Controller: accepts GRPO jobs (JobService) and drives them one step at a time over gRPC (DESIGN §1-§3)."""
