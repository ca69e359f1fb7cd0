"""What every fp8rl service shares: the skeleton in :mod:`services.common.runtime` (flags, config, server,
health, graceful stop, the replica lease and refit follower). Roles import it; roles never import each other."""
