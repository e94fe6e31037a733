"""The front door: HTTP (Ray Serve, OpenAI-compatible), gRPC, client SDK, auth, metrics."""
