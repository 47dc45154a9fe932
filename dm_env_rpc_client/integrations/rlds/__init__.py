"""RLDS datasets from recorded runs: ``RldsWriter``, an ``EpisodeWriter`` for ``Recording``."""

from ._api import (
    RldsWriter,
)

__all__ = [
    "RldsWriter",
]
