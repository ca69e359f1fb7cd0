"""What every fp8rl service shares: the skeleton in :mod:`services.common.runtime` (flags, config, server,
health, graceful stop, the replica lease and refit follower). Roles import it; roles never import each other.

Invariant: a service listens off loopback only with a token per scope (or ``--insecure``), and holds a role
lease in Redis naming its endpoint while it serves.
"""
