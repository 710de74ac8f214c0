"""Backends. Importing this package registers every backend that ships with portable_mx."""

from ..registry import register
from .reference import ReferenceBackend

register(ReferenceBackend(), replace=True)

__all__ = ["ReferenceBackend"]
