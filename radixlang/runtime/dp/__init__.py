"""Data parallelism: the cache-aware ``Router`` that picks a replica per request, and
merging the replicas' reported states. Pure Python: imports nothing of the runtime."""
