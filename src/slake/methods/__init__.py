"""Compression methods, one file each; importing this package registers them all."""

from . import full, streamingllm, h2o, tova, snapkv, pyramidkv  # noqa: F401  (registration)
from .base import DecodeInputs, Method, PrefillInputs, PrefillScores, available_methods, make_method, register

try:  # methods added by later modules register themselves the same way
    from . import cake, slake  # noqa: F401
except ImportError:  # pragma: no cover - only while a method file is missing from a partial checkout
    pass

__all__ = ["DecodeInputs", "Method", "PrefillInputs", "PrefillScores", "available_methods", "make_method", "register"]
