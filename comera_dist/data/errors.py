"""The errors the data pipeline raises on bad input (each message names the path, key or value)."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data input: a missing file, an empty corpus, an incompatible model, a bad column."""


class CacheError(DataError):
    """A cache entry exists but cannot be read; the message names the directory to delete."""
