"""Compiled decoding on the real default model (SmolLM2-135M-Instruct, CPU): the same greedy tokens, bytes and kept
counts as eager decoding (``docs/compile.md``). Inductor compiles the 30-layer step once per method (minutes)."""

from __future__ import annotations

import pytest

import slake

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def default_model():
    try:
        return slake.load_model()
    except FileNotFoundError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize(
    "method", ["slake"]
)  # cake: tests/test_compile.py on tiny models (compiling 30 layers costs minutes)
def test_compiled_generate_equals_eager_on_the_default_model(default_model, method):
    model, tokenizer = default_model
    prompt = (
        "Here is a short story. "
        + "The quick brown fox jumps over the lazy dog. " * 20
        + "Question: what does the fox jump over?"
    )
    kw = dict(method=method, budget=64, max_new_tokens=12)
    eager = slake.generate(model, tokenizer, prompt, **kw)
    compiled = slake.generate(model, tokenizer, prompt, compile=True, **kw)
    assert compiled.compressed and compiled.texts == eager.texts and compiled.new_tokens == eager.new_tokens
    assert compiled.kept_tokens_per_layer == eager.kept_tokens_per_layer
    assert compiled.kv_bytes == eager.kv_bytes
