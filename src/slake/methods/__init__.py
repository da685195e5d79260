"""Compression methods, one file each; importing this package registers them all."""

from slake.methods import (  # noqa: F401  (registration)  # noqa: F401  (registration)
    ada_pyramidkv,
    ada_snapkv,
    ahakv,
    cake,
    criticalkv,
    expected_attention,
    full,
    h2o,
    keydiff,
    kvzip,
    lava,
    pyramidkv,
    sagekv,
    slake,
    snapkv,
    streamingllm,
    tova,
)
from slake.methods.base import (
    DecodeInputs,
    LayerContext,
    Method,
    PrefillInputs,
    PrefillScores,
    available_methods,
    canonical_method_spec,
    make_method,
    parse_method_list,
    register,
)
from slake.methods.spec import format_method_spec, parse_method_spec, split_method_list

__all__ = [
    "DecodeInputs",
    "LayerContext",
    "Method",
    "PrefillInputs",
    "PrefillScores",
    "available_methods",
    "make_method",
    "register",
    "canonical_method_spec",
    "format_method_spec",
    "parse_method_list",
    "parse_method_spec",
    "split_method_list",
]
