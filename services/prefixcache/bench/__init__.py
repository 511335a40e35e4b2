"""`prefixcache bench`: seeded workloads, a streaming driver over the Engine API, and the report."""
