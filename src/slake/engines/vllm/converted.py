"""GGUF models converted once to a safetensors folder that vLLM loads (vLLM's own GGUF loading needs the hub).

:func:`local_model_dir` loads a GGUF model with :func:`slake.engines.transformers.models.load_model`, dequantised,
and saves it with its tokenizer under :func:`cache_dir`, in ``vllm-models/<GGUF file stem>-<dtype>``; later calls
reuse that folder. Each folder records the GGUF file it was made from (:data:`SOURCE_FILE`: a local file's absolute
path, size and modification time; a hub repository's file by repository and name) and the name the model's
profile is looked up by (:func:`slake.engines.transformers.models.profile_name`, in the copy's ``config.json`` as
``slake_model_name``), so that

* a file replaced at the same path (a new download, a new fine-tune) is converted again, into the same folder;
* another file with the same name elsewhere (``model.gguf`` of two fine-tunes, ``ggml-model-Q4_K_M.gguf`` of two
  repositories) gets a folder of its own, ``<stem>-<dtype>-<8 hex digits of its path>``, instead of the first one's
  conversion;
* a folder without a record (made by a slake before records existed) is converted again once, as is one converted
  under another name (the packaged model's file given by path, before such a path was named after its package).

A conversion is written to a fresh temporary folder beside its target and renamed into place, so two processes
converting at once never write into one folder, and a killed conversion leaves only a ``.part-*`` folder behind;
where another process has put a matching conversion in place first, its folder is used, and one of another file of
the same name is never replaced. In a read-only cache, a complete folder without a record is used as it is (with a
warning), as before records existed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("slake")

__all__ = ["CACHE_ENV", "SOURCE_FILE", "cache_dir", "local_model_dir", "save_dequantized"]

CACHE_ENV = "SLAKE_CACHE_DIR"
#: the record of the GGUF file a converted folder was made from
SOURCE_FILE = "slake-source.json"


def cache_dir() -> Path:
    """Folder for converted models: ``$SLAKE_CACHE_DIR`` or ``~/.cache/slake``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "slake")


def local_model_dir(model: str | None, gguf_file: str | None = None, dtype: str = "float32") -> str:
    """A directory vLLM can load for ``model``.

    Parameters
    ----------
    model : str | None
        ``"smollm2"`` / None (the packaged GGUF), a ``.gguf`` file, a hub id or a local directory. GGUF models are
        loaded with :func:`slake.engines.transformers.models.load_model` and saved once as safetensors (with the
        tokenizer) under :func:`cache_dir` (see the module for how a conversion is matched to its file); anything
        else is returned as is.
    gguf_file : str | None
        GGUF file name inside ``model`` (a directory).
    dtype : str
        Weights dtype of the converted copy.
    """
    from slake.engines.transformers.models import profile_name, resolve_model

    path, gguf = resolve_model(model, gguf_file)
    if gguf is None:
        return path
    source = {**_source(path, gguf), "name": profile_name(model, path, gguf)}
    stem = Path(gguf).stem
    out = _folder_for(stem, dtype, source)
    if _same_conversion(out, source):
        return str(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.part-", dir=out.parent))
    except OSError as e:  # a read-only cache: keep a complete conversion made without a record, if there is one
        if _complete(out) and not (out / SOURCE_FILE).exists():
            logger.warning("%s is read-only (%s): using %s, which records no source file", out.parent, e, out)
            return str(out)
        raise
    from slake.engines.transformers.models import load_model

    try:
        hf_model, tokenizer = load_model(model, device="cpu", dtype=dtype, gguf_file=gguf_file)
        save_dequantized(hf_model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(source, sort_keys=True), encoding="utf-8")
        return str(_put_in_place(tmp, stem, dtype, source))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _source(path: str, gguf: str) -> dict[str, Any]:
    """What identifies the GGUF file ``gguf`` of ``path`` (a folder, or a hub repository) without reading it: a local
    file's absolute path, size and modification time; a hub repository's file by repository and name."""
    local = Path(path) / gguf
    if not local.is_file():
        return {"gguf": f"{path}/{gguf}"}
    stat = local.resolve().stat()
    return {"gguf": str(local.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (a configuration and weights)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _record(folder: Path) -> dict[str, Any] | None:
    """The source recorded in a complete converted folder (None: no folder, an incomplete one, or no record)."""
    if not _complete(folder):
        return None
    try:
        record = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _same_conversion(folder: Path, source: dict[str, Any]) -> bool:
    """Whether ``folder`` holds the conversion of ``source``: the same GGUF file, converted under the same profile
    name (``source["name"]``, :func:`slake.engines.transformers.models.profile_name`, which its ``config.json``
    carries as ``slake_model_name`` for the plugin's profile lookup). A record from before names were recorded
    counts when its configuration carries the name; a conversion made under another name (the packaged model's
    file given by path, before such a path was named after the package) is converted again."""
    record = _record(folder)
    if record is None:
        return False
    if "name" in record:
        return record == source
    if record != {k: v for k, v in source.items() if k != "name"}:
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("slake_model_name") == source.get("name")


def _folder_for(stem: str, dtype: str, source: dict[str, Any]) -> Path:
    """The folder of ``source``'s conversion: ``<stem>-<dtype>``, unless a complete conversion of a file at another
    path holds that name; then ``<stem>-<dtype>-<8 hex digits of the path>``."""
    base = cache_dir() / "vllm-models"
    plain = base / f"{stem}-{dtype}"
    held = _record(plain)
    if held is None or held.get("gguf") == source["gguf"]:
        return plain
    return base / f"{stem}-{dtype}-{hashlib.sha256(source['gguf'].encode()).hexdigest()[:8]}"


def _put_in_place(tmp: Path, stem: str, dtype: str, source: dict[str, Any]) -> Path:
    """Rename the finished conversion ``tmp`` to its folder (:func:`_folder_for`, asked again at each try) and return
    the folder. A conversion of the same source already there (another process's) is kept; a stale one (of an
    earlier version of the same file, without a record, or unfinished) is replaced; one of another file of the same
    name (put there meanwhile by another process) is left alone, and ``tmp`` goes to this file's own folder."""
    for _ in range(4):
        out = _folder_for(stem, dtype, source)
        try:
            tmp.rename(out)
            return out
        except OSError:  # ``out`` exists
            held = _record(out)
            if _same_conversion(out, source):
                return out
            if held is not None and held.get("gguf") != source["gguf"]:
                continue  # another file's conversion: _folder_for now names this file's own folder
            stale = Path(tempfile.mkdtemp(prefix=f"{out.name}.stale-", dir=out.parent))
            try:
                out.rename(stale / "old")
            except OSError:
                pass  # another process moved it first: try again
            shutil.rmtree(stale, ignore_errors=True)
    raise OSError(f"could not put the converted model in place in {cache_dir() / 'vllm-models'}")


def save_dequantized(hf_model, folder: Path) -> None:
    """Save a (GGUF-dequantized) transformers model as a plain safetensors checkpoint that vLLM loads.

    ``save_pretrained`` refuses GGUF-loaded models (their config still names the GGUF quantization), although the
    weights are already dequantized; the config is written without it and tied output weights are left to
    ``tie_word_embeddings``.
    """
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(hf_model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config._attn_implementation = "sdpa"  # do not write slake's attention name into config.json
    config.architectures = [type(hf_model).__name__]  # vLLM picks the model class from this field
    config.save_pretrained(folder)
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(folder)
    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
