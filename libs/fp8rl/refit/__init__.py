"""Redis-coordinated refit protocol (DESIGN §3)."""
