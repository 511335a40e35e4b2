"""The ports the stack's containers listen on.

Every service serves Prometheus metrics (scheduler :9090, worker :9091, tokenizer :9092); each pod's
scrape annotations name its first service's port, and every metrics port is a named container port
(`metrics`, `worker-metrics`) for a PodMonitor or a scrape job that follows container ports.
"""
ENGINE_PORT = 50051
TOKENIZER_PORT = 50053  # the services' own default ports
WORKER_PORT = 50052
WORKER_HEALTH_PORT = 50054  # plaintext health only, for the probes: the worker itself listens on loopback
SCHEDULER_HEALTH_PORT = 50055  # plaintext health only, for the probes: the Engine API may serve TLS
METRICS_PORT = 9090  # the scheduler's Prometheus endpoint (prefix-cache counters)
WORKER_METRICS_PORT = 9091
TOKENIZER_METRICS_PORT = 9092
