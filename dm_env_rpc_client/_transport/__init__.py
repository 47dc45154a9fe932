"""Beneath connection and aio: gRPC channels, readiness, the background loop, and what stands where a connection goes."""
