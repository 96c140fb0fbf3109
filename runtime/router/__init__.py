"""Data parallelism: one API in front of several runtime replicas."""

POLICIES = ("cache_aware", "round_robin")  # how the router picks a replica (light here: the CLI lists them)
