"""Triton's cache key for the device, computed without it, and the re-keying of a warm cache for another build of
the same Triton (:mod:`benchmarks.warm_cache`).

Triton's key begins with a hash of its own installation, libtriton's binary included (:func:`device_triton_key`
puts the device's wheel's in place of this machine's); each compilation's key goes on with hashes that do not depend
on that binary, recorded at build time (:func:`record_key_suffixes`), so that an archive built for one libtriton can
be renamed, entry by entry, for another (:func:`rekey_refusal`, :func:`rekeyed`, :func:`rekey_entries`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any


def _record_hashes(record: str) -> dict[str, str]:
    """A wheel's ``RECORD`` (or an installation's) as ``{path: sha256=...}``."""
    return {row[0]: row[1] for row in csv.reader(io.StringIO(record)) if len(row) >= 2}


def device_triton_key(wheel: Path) -> str:
    """``triton.runtime.cache.triton_key()`` as the device computes it, from its Triton ``wheel``: this machine's
    key with the wheel's libtriton in place of the one installed here. Raises ``ValueError`` if the wheel is not
    the installed version or any Python file of the two differs (the key hashes them too)."""
    import triton
    from triton.runtime.cache import triton_key

    here = Path(triton.__file__).parent
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record_name = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record_name is None or f"triton-{triton.__version__}.dist-info/RECORD" != record_name:
            raise ValueError(f"{wheel}: not a wheel of triton {triton.__version__} ({record_name})")
        theirs = _record_hashes(z.read(record_name).decode())
        lib = z.read("triton/_C/libtriton.so")
    installed = next(here.parent.glob(f"triton-{triton.__version__}.dist-info/RECORD"), None)
    if installed is None:
        raise ValueError(f"no RECORD of triton {triton.__version__} beside {here}")
    ours = _record_hashes(installed.read_text())
    differ = sorted(
        p
        for p in set(theirs) | set(ours)
        if p.startswith("triton/") and p.endswith(".py") and theirs.get(p) != ours.get(p)
    )
    if differ:
        raise ValueError(f"{wheel}: {len(differ)} Python files differ from the installed triton's, e.g. {differ[:3]}")
    local_lib = libtriton_hash()
    key = triton_key()
    if local_lib not in key:
        raise ValueError("the installed libtriton's hash is not in triton_key(): this Triton builds its key otherwise")
    return key.replace(local_lib, hashlib.sha256(lib).hexdigest())


def invalidating_env() -> dict[str, str]:
    """The environment variables that enter Triton's cache key (compiler debug switches), as set now."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return dict(get_cache_invalidating_env_vars())


def key_digest(key: str) -> str:
    """A short, comparable form of a Triton key (the manifest's ``triton_key_sha256``)."""
    return hashlib.sha256(key.encode()).hexdigest()


def libtriton_hash() -> str:
    """The SHA-256 of this machine's libtriton binary (the part of ``triton_key()`` that differs between builds)."""
    import sysconfig

    import triton

    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    digest = hashlib.sha256()
    with open(Path(triton.__file__).parent / "_C" / f"libtriton.{ext}", "rb") as f:
        for chunk in iter(lambda: f.read(2**24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sm90_backend_hash() -> str:
    """What Triton's CUDA backend puts in the cache key for an sm_90 target (ptxas's version and the target)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return make_backend(GPUTarget("cuda", 90, 32)).hash()


#: where :func:`record_key_suffixes` writes, in the cache directory (one JSON line per compilation)
SUFFIXES = "slake-key-suffixes.jsonl"


def entry_of(key: str) -> tuple[str, str]:
    """The cache entry of a compilation whose cache key is ``key``: ``(its directory's name, the hash its metadata
    records)``, as Triton names them (the SHA-256 of the key, in base 32 for the directory)."""
    import base64

    digest = hashlib.sha256(key.encode("utf-8"))
    return base64.b32encode(digest.digest()).decode("utf-8").rstrip("="), digest.hexdigest()


def record_key_suffixes() -> None:
    """From now on each compilation in this process appends ``{"entry", "suffix"}`` to :data:`SUFFIXES` in Triton's
    cache directory: the entry's directory name (the SHA-256 of its cache key) and the key less its first part,
    Triton's own key. Triton's cache key is ``triton_key()`` followed by the hashes of the kernel's source and
    specialization, of the backend (ptxas's version and the target) and of the options, and the compiler switches
    set in the environment, none of which depends on libtriton's binary: with the suffix, an entry's name under
    another Triton key is :func:`entry_of` ``(other_key + suffix)`` (:func:`rekeyed`)."""
    import triton.compiler.compiler as triton_compiler
    import triton.runtime.cache as triton_cache
    from triton import knobs

    original = triton_compiler.get_cache_key

    def recording(src: Any, backend: Any, backend_options: Any, env_vars: Any) -> str:
        key = original(src, backend, backend_options, env_vars)
        prefix = triton_cache.triton_key()
        if not key.startswith(prefix):
            raise RuntimeError("Triton's cache key no longer begins with triton_key(): re-keying cannot work")
        entry = entry_of(key)[0]
        cache = Path(knobs.cache.dir)
        cache.mkdir(parents=True, exist_ok=True)  # before the first compilation, Triton has not made it yet
        with open(cache / SUFFIXES, "a") as f:
            f.write(json.dumps({"entry": entry, "suffix": key[len(prefix) :]}) + "\n")
        return key

    triton_compiler.get_cache_key = recording


def rekey_refusal(manifest: dict, key: str, lib_hash: str, backend_hash: str) -> str | None:
    """Why an archive keyed otherwise cannot be re-keyed for a machine whose Triton key is ``key`` (None: it can).

    It can when the two keys differ only in libtriton's hash, and that is ``lib_hash``, this machine's (the same
    Triton version, every Python file the same: another build of the same release, as PyPI's and PyTorch's indexes
    may serve), and the build's CUDA backend hash (ptxas's version) is ``backend_hash``. The kernels were compiled here
    by yet another build of that release anyway (Python 3.11's; the device's is 3.12's): re-keying adds no
    assumption that the build does not already make."""
    theirs = manifest.get("triton_key")
    if theirs is None or "suffixes" not in manifest:
        return "the archive records no key suffixes (built before re-keying existed)"
    ours_parts, theirs_parts = key.split("-"), theirs.split("-")
    if len(ours_parts) != len(theirs_parts):
        return "Triton's key has another form here (another version)"
    differ = [i for i, (a, b) in enumerate(zip(ours_parts, theirs_parts, strict=True)) if a != b]
    if len(differ) != 1 or ours_parts[differ[0]] != lib_hash:
        return f"Triton's key differs in {len(differ)} of its parts, not only in libtriton's hash"
    if manifest.get("backend_hash") != backend_hash:
        return f"the CUDA backend differs (ptxas {backend_hash} here, {manifest.get('backend_hash')} in the archive)"
    return None


def rekeyed(manifest: dict, key: str) -> dict:
    """The manifest of ``manifest``'s archive re-keyed for Triton key ``key``: each entry's directory renamed to
    :func:`entry_of` ``key`` followed by its key suffix (Triton's own naming, :func:`record_key_suffixes`); an entry
    without a recorded suffix is left out."""
    names = {}
    suffixes = {}
    for entry, name in manifest["entries"].items():
        suffix = manifest["suffixes"].get(entry)
        if suffix is None:
            continue
        new = entry_of(key + suffix)[0]
        names[new] = name
        suffixes[new] = suffix
    return {
        **manifest,
        "triton_key_sha256": key_digest(key),
        "triton_key": key,
        "entries": names,
        "suffixes": suffixes,
        "rekeyed_from": manifest["triton_key_sha256"],
    }


def rekey_entries(cache: Path, old: dict, new: dict) -> None:
    """Rename the entries of ``old`` (extracted in ``cache``) to those of ``new`` (:func:`rekeyed`): each directory,
    the absolute paths its group file lists, and the ``hash`` its metadata records; an entry ``new`` left out is
    removed."""
    key = new["triton_key"]
    for entry in old["entries"]:
        suffix = old["suffixes"].get(entry)
        if suffix is None:
            shutil.rmtree(cache / entry)
            continue
        target, digest = entry_of(key + suffix)
        (cache / entry).rename(cache / target)
        for group in (cache / target).glob("__grp__*.json"):
            data = json.loads(group.read_text())
            paths = {k: str(cache / target / Path(v).name) for k, v in data["child_paths"].items()}
            group.write_text(json.dumps({**data, "child_paths": paths}))
            for child, path in paths.items():
                if child.endswith(".json"):
                    meta = json.loads(Path(path).read_text())
                    if "hash" in meta:
                        meta["hash"] = digest
                        Path(path).write_text(json.dumps(meta))
