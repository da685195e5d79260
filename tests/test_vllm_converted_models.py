"""The vLLM engine's converted GGUF folders (``slake.engines.vllm.converted``): each is its own file's conversion.

Before, the folder was keyed by the GGUF file's stem and dtype only: another ``model.gguf`` elsewhere, or a file
replaced at the same path, was served the first file's conversion (the tests marked "before" failed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import slake.engines.transformers.models as models
from slake.engines.vllm.converted import SOURCE_FILE, local_model_dir
from tiny_models import tiny_model


class _Tokenizer:
    def save_pretrained(self, folder) -> None:
        Path(folder, "tokenizer.json").write_text("{}")


@pytest.fixture
def conversions(tmp_path, monkeypatch):
    """Two GGUF files named model.gguf in two folders; ``load_model`` stands in for the dequantisation and counts
    its calls, marking each converted config with the file it loaded."""
    monkeypatch.setenv("SLAKE_CACHE_DIR", str(tmp_path / "cache"))
    loaded: list[str] = []

    def load_model(model, device=None, dtype=None, gguf_file=None):
        loaded.append(str(model))
        m = tiny_model("llama-gqa")
        m.config.loaded_from = str(model)
        return m, _Tokenizer()

    monkeypatch.setattr(models, "load_model", load_model)
    files = []
    for name in ("finetune-a", "finetune-b"):
        f = tmp_path / name / "model.gguf"
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + name.encode())
        files.append(f)
    return files, loaded


def _made_from(folder: str) -> str:
    return json.loads(Path(folder, "config.json").read_text())["loaded_from"]


def test_another_file_of_the_same_name_gets_its_own_conversion(conversions):
    (a, b), loaded = conversions
    dir_a = local_model_dir(str(a))
    dir_b = local_model_dir(str(b))
    assert dir_a != dir_b  # before: b was served a's folder
    assert _made_from(dir_a) == str(a) and _made_from(dir_b) == str(b)
    assert Path(dir_a).name == "model-float32" and Path(dir_b).name.startswith("model-float32-")
    assert local_model_dir(str(a)) == dir_a and local_model_dir(str(b)) == dir_b
    assert loaded == [str(a), str(b)]  # each converted once


def test_a_file_replaced_at_the_same_path_is_converted_again(conversions):
    (a, _), loaded = conversions
    first = local_model_dir(str(a))
    a.write_bytes(b"GGUF a new fine-tune")
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))
    assert local_model_dir(str(a)) == first
    assert loaded == [str(a), str(a)]  # before: once, the old conversion served
    assert json.loads(Path(first, SOURCE_FILE).read_text())["size"] == a.stat().st_size
    assert not [p for p in Path(first).parent.iterdir() if ".part-" in p.name or ".stale-" in p.name]


def test_a_folder_without_a_record_is_converted_again_once(conversions):
    (a, _), loaded = conversions
    folder = Path(local_model_dir(str(a)))
    (folder / SOURCE_FILE).unlink()  # as a slake before records left it
    assert local_model_dir(str(a)) == str(folder)
    assert local_model_dir(str(a)) == str(folder)
    assert loaded == [str(a), str(a)]


def test_a_read_only_cache_keeps_a_conversion_made_before_records(conversions, monkeypatch):
    import tempfile

    (a, _), loaded = conversions
    folder = Path(local_model_dir(str(a)))
    (folder / SOURCE_FILE).unlink()  # as a slake before records left it, in a cache since made read-only

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert local_model_dir(str(a)) == str(folder)  # before the fallback: OSError after loading the whole model
    assert loaded == [str(a)]


def test_a_conversion_never_replaces_another_files_put_in_place_meanwhile(conversions):
    from slake.engines.vllm import converted

    (a, b), _ = conversions
    dir_b = Path(local_model_dir(str(b)))  # b converted first: it holds the plain folder
    tmp = dir_b.parent / "model-float32.part-test"
    tmp.mkdir()
    for f in dir_b.iterdir():
        (tmp / f.name).write_bytes(f.read_bytes())
    source_a = converted._source(str(a.parent), a.name)
    (tmp / SOURCE_FILE).write_text(json.dumps(source_a))
    placed = converted._put_in_place(tmp, "model", "float32", source_a)
    assert placed != dir_b and json.loads((dir_b / SOURCE_FILE).read_text())["gguf"] == str(b.resolve())
    assert json.loads((placed / SOURCE_FILE).read_text()) == source_a
