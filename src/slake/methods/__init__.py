"""Compression methods, one file each; importing this package registers them all."""

from slake.methods import full, streamingllm, h2o, tova, snapkv, pyramidkv, cake, slake  # noqa: F401  (registration)
from slake.methods import ada_snapkv, ada_pyramidkv, lava, ahakv, sagekv  # noqa: F401  (registration)
from slake.methods.base import DecodeInputs, Method, PrefillInputs, PrefillScores, available_methods, make_method, register
from slake.methods.base import canonical_method_spec, parse_method_list
from slake.methods.spec import format_method_spec, parse_method_spec, split_method_list

__all__ = ["DecodeInputs", "Method", "PrefillInputs", "PrefillScores", "available_methods", "make_method", "register",
           "canonical_method_spec", "format_method_spec", "parse_method_list", "parse_method_spec",
           "split_method_list"]
