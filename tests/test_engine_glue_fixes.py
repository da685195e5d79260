"""``slake.generate``'s glue around the model and the tokenizer: a multimodal Gemma 3 (its text decoder's shapes and
layers live under the wrapper), all-sliding-window models refused before any work, and the caller's tokenizer left
as it was."""

from __future__ import annotations

import pytest
import torch

import slake
from hybrid_models import WINDOW, hybrid_model
from slake.engines.transformers.layer_facts import layer_contexts
from slake.engines.transformers.layer_layout import attention_layout
from tiny_models import random_ids, tiny_model, word_tokenizer


def _words(ids: torch.Tensor) -> str:
    return " ".join(f"w{i}" for i in ids.tolist())


@pytest.fixture(scope="module")
def gemma3_mm():
    """A tiny multimodal Gemma 3 (``Gemma3ForConditionalGeneration``, the class ``AutoModelForCausalLM`` gives the
    4B/12B/27B checkpoints): its config keeps the text shapes in ``text_config`` and its text decoder sits at
    ``model.language_model``."""
    import transformers as tf

    torch.manual_seed(0)
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    cfg = tf.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=299,
        boi_token_index=297,
        eoi_token_index=298,
    )
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    slake.prepare_model(model)
    return model


@pytest.mark.parametrize("method", ["full", "snapkv", "criticalkv", "expected-attention"])
def test_generate_on_a_multimodal_gemma3_runs_and_reports_kv_bytes(gemma3_mm, method):
    """The byte accounting read ``hidden_size``/``num_key_value_heads`` off the top-level ``Gemma3Config`` (which has
    none: AttributeError after generating), and CriticalKV / Expected Attention were refused for want of the output
    projections and the rotary embedding, which the layer lookup did not find under ``language_model``."""
    prompt = _words(random_ids(40, seed=1)[0])
    kw = {"budget": 10000} if method == "full" else {"budget": 24, "window": 8}
    res = slake.generate(
        gemma3_mm, word_tokenizer(), prompt, method=method, max_new_tokens=4, chat_template=False, **kw
    )
    assert res.new_tokens == [4]
    text = gemma3_mm.config.get_text_config()
    n_full = sum(t == "full_attention" for t in text.layer_types)
    fed = res.prompt_tokens[0] + res.new_tokens[0] - 1  # the last new token is never fed back
    full = 2 * n_full * text.num_key_value_heads * text.head_dim * 4 * fed  # keys + values, fp32
    assert res.kv_bytes["full"] == full + res.kv_bytes["sliding"]
    assert res.kv_bytes["sliding"] > 0
    if method == "full":
        assert res.kv_bytes["kept"] == full
    else:
        assert res.compressed and res.kv_bytes["kept"] < full


def test_layer_contexts_read_the_text_decoder_of_a_multimodal_model(gemma3_mm):
    """The rotary embedding (one per layer type) and the ``o_proj`` weights come from ``model.language_model``, for
    the model and for its base model (what the input check binds)."""
    decoder = gemma3_mm.model.language_model
    layout = attention_layout(gemma3_mm.config)
    for model in (gemma3_mm, gemma3_mm.model):
        contexts = layer_contexts(model, layout.compressed, layout.layer_types)
        assert len(contexts) == len(layout.compressed) == 2
        for i, ctx in zip(layout.compressed, contexts):
            assert ctx.out_proj is not None
            assert ctx.out_proj.data_ptr() == decoder.layers[i].self_attn.o_proj.weight.data_ptr()
            assert ctx.rotary is not None


def test_an_all_sliding_model_is_refused_before_any_forward_when_the_sequence_outgrows_the_window():
    """Every layer of the Mistral slides: the refusal used to come from the attention function at the step crossing
    the window, after the prefill and several decode steps. Now it comes before the model runs at all, with the
    attention function's wording; a sequence that fits (the cache ends with prompt + max_new_tokens - 1 tokens)
    still runs."""
    model = hybrid_model("mistral-swa")
    tok = word_tokenizer()
    calls: list[int] = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        prompt = _words(random_ids(10, seed=1)[0])
        with pytest.raises(ValueError, match="sliding-window attention .* slake compresses full-attention layers only"):
            slake.generate(
                model, tok, prompt, method="snapkv", budget=12, window=4, max_new_tokens=20, chat_template=False
            )
        assert calls == []

        def run(new_tokens: int):
            return slake.generate(
                model, tok, prompt, method="snapkv", budget=12, window=4, max_new_tokens=new_tokens,
                chat_template=False,
            )  # fmt: skip

        # the longest sequence that fits: 10 prompt tokens and 7 new ones, of which 6 are fed back (16 cached)
        assert run(WINDOW - 10 + 1).new_tokens == [WINDOW - 10 + 1]
        calls.clear()
        with pytest.raises(ValueError, match="sliding-window attention"):
            run(WINDOW - 10 + 2)
        assert calls == []
    finally:
        hook.remove()


def _bare_tokenizer():
    """The word tokenizer without a padding token, padding on the right (as many base-model tokenizers ship)."""
    tok = word_tokenizer()
    tok.pad_token = None
    tok.padding_side = "right"
    assert tok.pad_token is None and tok.padding_side == "right"
    return tok


def test_generate_leaves_the_tokenizers_padding_as_it_was():
    """``slake.generate`` pads a batch on the left with the end token where there is no padding token; it used to
    leave the caller's tokenizer so for good (a later right-padded batch elsewhere silently changed)."""
    model = tiny_model("llama-gqa", layers=2)
    tok = _bare_tokenizer()
    prompts = [_words(random_ids(12, seed=2)[0]), _words(random_ids(7, seed=3)[0])]
    res = slake.generate(
        model, tok, prompts, method="snapkv", budget=8, window=4, max_new_tokens=3, chat_template=False
    )
    assert res.prompt_tokens == [12, 7]
    assert res.sequences[1, :5].tolist() == [tok.eos_token_id] * 5  # the short row was left-padded with the end token
    assert tok.padding_side == "right" and tok.pad_token is None and tok.pad_token_id is None
    # a tokenizer with its own settings keeps them too
    tok = word_tokenizer()
    res = slake.generate(
        model, tok, prompts, method="snapkv", budget=8, window=4, max_new_tokens=3, chat_template=False
    )
    assert res.sequences[1, :5].tolist() == [tok.pad_token_id] * 5
    assert tok.padding_side == "right" and tok.pad_token == "<pad>"


def test_generate_leaves_the_tokenizers_padding_as_it_was_when_it_raises():
    """Refusals after the tokenisation (context too long, all-sliding model) leave the tokenizer unchanged too."""
    tok = _bare_tokenizer()
    short_context = tiny_model("llama-gqa", layers=1, max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings|context"):
        slake.generate(
            short_context, tok, [_words(random_ids(20, seed=4)[0]), "w5"], max_new_tokens=2, chat_template=False
        )
    assert tok.padding_side == "right" and tok.pad_token is None
    with pytest.raises(ValueError, match="sliding-window attention"):
        slake.generate(
            hybrid_model("mistral-swa"), tok, _words(random_ids(30, seed=5)[0]), max_new_tokens=2, chat_template=False
        )
    assert tok.padding_side == "right" and tok.pad_token is None


class _Frozen:
    """A tokenizer that may be called and read but not changed, as one shared by threads must be."""

    def __init__(self, tok) -> None:
        object.__setattr__(self, "_tok", tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __setattr__(self, name, value):
        raise AssertionError(f"slake.generate set tokenizer.{name} = {value!r}: another thread would see it")

    def __call__(self, *a, **k):
        return self._tok(*a, **k)


def test_generate_pads_without_changing_the_tokenizer():
    """slake.generate set the shared tokenizer's padding_side and lent it a padding token for the call: a second
    thread tokenising meanwhile padded on the right (refused as right padding) or found no padding token."""
    model = tiny_model("llama-gqa", layers=2)
    prompts = [_words(random_ids(12, seed=2)[0]), _words(random_ids(7, seed=3)[0])]
    kw = dict(method="snapkv", budget=8, window=4, max_new_tokens=3, chat_template=False)
    for tok in (_bare_tokenizer(), word_tokenizer()):
        want = slake.generate(model, tok, prompts, **kw)
        got = slake.generate(model, _Frozen(tok), prompts, **kw)
        assert torch.equal(got.sequences, want.sequences) and got.prompt_tokens == [12, 7]


@pytest.mark.parametrize("prompt", [5, ["w5 w6", 7], None])
def test_generate_refuses_a_prompt_that_is_not_text(prompt):
    with pytest.raises(ValueError, match="the prompt must be a string or a list of strings, got"):
        slake.generate(tiny_model("llama-gqa", layers=1), word_tokenizer(), prompt, max_new_tokens=2)


@pytest.mark.parametrize("method", ["full", "kvzip"])
def test_the_benchmark_measures_a_multimodal_gemma3(gemma3_mm, method):
    """The benchmark's random prompt and KVzip's synthetic reconstruction prompt read the vocabulary off the text
    config (``Gemma3Config`` has none at the top: AttributeError before)."""
    from slake.engines.transformers.measure import BenchConfig, measure

    row = measure(gemma3_mm, BenchConfig(method, 12, 40, decode_steps=2, warmup=1))
    assert row["method"] == method
