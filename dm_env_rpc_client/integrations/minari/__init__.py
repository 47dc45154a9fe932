"""Minari datasets from recorded runs: ``MinariWriter``, an ``EpisodeWriter`` for ``Recording``."""

from ._api import (
    DEFAULT_ALGORITHM,
    MinariWriter,
    default_dataset_id,
)

__all__ = [
    "DEFAULT_ALGORITHM",
    "MinariWriter",
    "default_dataset_id",
]
