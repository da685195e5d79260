"""Randomly initialised models with the exact config shapes of well-known checkpoints (no download).

``slake bench --random-model llama3-8b`` measures latency and memory at the papers' 8B scale on any GPU without
fetching weights: latency and memory do not depend on the weight values. The configs below are copied from the
checkpoints' ``config.json`` (layers, hidden size, heads, KV heads, head dim, MLP width, vocabulary, RoPE base; for
Gemma 3, its sliding window, with the five-to-one pattern of sliding-window and full-attention layers that
``Gemma3TextConfig`` makes, and without the 4B's RoPE scaling of its global layers, on which latency does not depend).

Initialisation: the model is built directly on the target device (``with torch.device(device)``) in the target dtype
(no fp32 copy on the CPU first) and its weights are filled with the model's own ``_init_weights`` (normal, std
``initializer_range``). A shape can be shrunk for tests with overrides: ``"llama3-8b:num_hidden_layers=2"``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SHAPES", "parse_shape", "random_model"]

_LLAMA = "llama"
_MISTRAL = "mistral"
_QWEN2 = "qwen2"
_GEMMA3 = "gemma3"  # hybrid: five sliding-window layers to a full-attention one (Gemma3TextConfig's layer_types)

#: name -> (architecture, config keyword arguments)
SHAPES: dict[str, tuple[str, dict]] = {
    "llama3-8b": (
        _LLAMA,
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "llama2-7b": (
        _LLAMA,
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "mistral-7b": (
        _MISTRAL,
        dict(
            vocab_size=32768,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2.5-7b": (
        _QWEN2,
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            tie_word_embeddings=False,
        ),
    ),
    "smollm2-135m": (
        _LLAMA,
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-270m": (
        _GEMMA3,
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            query_pre_attn_scalar=256,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3-4b": (
        _GEMMA3,
        dict(
            vocab_size=262208,
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=1024,
            query_pre_attn_scalar=256,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
        ),
    ),
    # tiny shapes for tests and smoke runs
    "tiny-hybrid": (
        _GEMMA3,
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=32,
            query_pre_attn_scalar=16,
            max_position_embeddings=65536,
            tie_word_embeddings=True,
        ),
    ),
    "tiny": (
        _LLAMA,
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=65536,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
    ),
}


#: config keys that must be integers >= 1 where a shape sets them (``sliding_window`` may also be None: no window)
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "query_pre_attn_scalar",
)  # fmt: skip
#: config keys that must be finite numbers > 0
_POSITIVE_NUMBERS = ("rope_theta", "rms_norm_eps")


def parse_shape(spec: str) -> tuple[str, dict]:
    """``"name[:key=value,...]"`` -> ``(architecture, config kwargs)`` with the overrides applied.

    Every override is checked before any weight is allocated: it must name a key of the architecture's config, have
    the type of that key's value (an integer where the config holds one, a number for a float, ``true``/``false``
    for a flag), sizes and counts must be >= 1 and ``rope_theta``, ``rms_norm_eps`` finite and > 0, the attention
    heads a multiple of the KV heads, the head dimension even (rotary embeddings rotate pairs); the config is then
    built once (no weights), so what transformers' own validation refuses is refused here too.

    Raises
    ------
    ValueError
        For an unknown name (listing the known ones), a malformed override, a config key given twice, or a shape no
        model can be built of; the message is one line.
    """
    name, _, rest = spec.partition(":")
    key = name.strip().lower()
    if key not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    arch, kwargs = SHAPES[key]
    kwargs = dict(kwargs)
    given: dict[str, int | float | bool | str | None] = {}
    for item in filter(None, (t.strip() for t in rest.split(","))):
        if "=" not in item:
            raise ValueError(f"--random-model {spec!r}: a shape override must be key=value, got {item!r}")
        k, v = (t.strip() for t in item.split("=", 1))
        if k in given:  # refused, as --set refuses a name given twice, never settled by which came last
            raise ValueError(f"--random-model {spec!r}: {k} is given twice; give each config key once")
        given[k] = kwargs[k] = _parse_value(v)
    defaults = _config_defaults(arch)
    unknown = sorted(set(kwargs) - set(SHAPES[key][1]) - set(defaults))
    if unknown:
        raise ValueError(
            f"--random-model {spec!r}: unknown config key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)} for the {arch} architecture"
        )
    for option, value in given.items():
        _check_override(spec, option, value, SHAPES[key][1].get(option, defaults.get(option)))
    _check_dimensions(spec, arch, kwargs, defaults)
    # long benchmark prompts must fit the RoPE table of the shape; the shape is not limited by it
    kwargs["max_position_embeddings"] = max(int(kwargs.get("max_position_embeddings", 0)), 131072)
    try:
        _config_class(arch)(**kwargs)
    except Exception as e:  # transformers' validators raise their own error classes, several lines long
        raise ValueError(f"--random-model {spec!r}: {' '.join(str(e).split())}") from None
    return arch, kwargs


def _check_override(spec: str, key: str, value: object, default: object) -> None:
    """Refuse an override whose type differs from the config's value for ``key`` (``default``), or a size, count or
    constant out of its range (:data:`_POSITIVE_INTS`, :data:`_POSITIVE_NUMBERS`)."""

    def bad(expected: str) -> ValueError:
        return ValueError(f"--random-model {spec!r}: {key} must be {expected}, got {value!r}")

    integer = value if isinstance(value, int) and not isinstance(value, bool) else None
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if key in _POSITIVE_INTS:
        if value is None and key == "sliding_window":
            return
        if integer is None or integer < 1:
            raise bad("an integer >= 1")
    elif key in _POSITIVE_NUMBERS:
        if number is None or not math.isfinite(number) or number <= 0:
            raise bad("a finite number > 0")
    elif isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad("true or false")
    elif isinstance(default, int):
        if integer is None:
            raise bad("an integer")
    elif isinstance(default, float) and (number is None or not math.isfinite(number)):
        raise bad("a finite number")


def _check_dimensions(spec: str, arch: str, kwargs: dict, defaults: dict) -> None:
    """Refuse attention shapes no model has: heads not a multiple of the KV heads, an odd or fractional head
    dimension."""

    def get(k: str) -> int:
        return int(kwargs.get(k, defaults.get(k)) or 0)

    heads, hidden = get("num_attention_heads"), get("hidden_size")
    kv_heads = get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(
            f"--random-model {spec!r}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
            f"({kv_heads})"
        )
    head_dim = kwargs.get("head_dim")  # None: hidden_size // num_attention_heads, as the config derives it
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"--random-model {spec!r}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})"
            )
        head_dim = hidden // heads
    if int(head_dim) % 2:
        raise ValueError(f"--random-model {spec!r}: the head dimension must be even (rotary embeddings): {head_dim}")


def _config_class(arch: str) -> type:
    """The architecture's transformers config class."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    return {_LLAMA: LlamaConfig, _MISTRAL: MistralConfig, _QWEN2: Qwen2Config, _GEMMA3: Gemma3TextConfig}[arch]


def _config_defaults(arch: str) -> dict:
    """The attributes of the architecture's default transformers config and their values (what an override may
    set, and the type it must have)."""
    cfg = _config_class(arch)()
    return {**cfg.to_dict(), **vars(cfg)}


def _parse_value(v: str) -> int | float | bool | None | str:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def random_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A randomly initialised causal LM of a named shape, in eval mode, with slake's attention installed.

    Parameters
    ----------
    spec : str
        A key of :data:`SHAPES`, optionally with config overrides (``"llama3-8b:num_hidden_layers=4"``).
    device : str
        Where the weights are allocated and initialised (no CPU copy for a CUDA model).
    dtype : torch.dtype
        Parameter dtype.
    seed : int
        Seed of the weight initialisation.
    """
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    from slake.engines.transformers.attention import prepare_model

    arch, kwargs = parse_shape(spec)
    model_cls = {
        _LLAMA: LlamaForCausalLM,
        _MISTRAL: MistralForCausalLM,
        _QWEN2: Qwen2ForCausalLM,
        _GEMMA3: Gemma3ForCausalLM,
    }[arch]
    config = _config_class(arch)(**kwargs, attn_implementation="sdpa")
    config.name_or_path = f"random:{spec}"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype).eval()
    prepare_model(model)
    return model
