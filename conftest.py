"""Loaded before every test module: settings that must be in place before grpc is first imported."""
from prefixcache.rpc.fork_handlers import turn_off_grpc_fork_handlers

# The e2e harness restarts service processes (fork, then exec) while this process has gRPC calls in flight.
turn_off_grpc_fork_handlers()
