"""Loaded before every test module: settings that must be in place before grpc is first imported."""
import os

# The e2e harness restarts service processes while this process has gRPC client calls in flight.
# subprocess forks for that (the services are started with a preexec_fn), and gRPC's fork handlers,
# run then, could leave the child hung before it reached exec. The child only execs: it needs none.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
