"""Beneath environment and aio_environment: the non-I/O core, the world requests, and decoding many steps at once."""
