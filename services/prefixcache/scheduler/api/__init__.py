"""The public Engine gRPC API over the engine: the servicer, each call's response stream, and the
codec between the API's messages and the engine's types."""
