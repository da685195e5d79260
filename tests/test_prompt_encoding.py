"""How a prompt becomes token ids: in the chat template when the tokenizer has one, else as plain text after the
tokenizer's special tokens (its BOS)."""

from __future__ import annotations

import slake
from slake.engines.transformers.generate import uses_chat_template
from test_eval_runner import TinyTokenizer
from tiny_models import tiny_model


class PlainTokenizer(TinyTokenizer):
    """TinyTokenizer without a chat template (as Gemma 3 270M's): BOS (id 1) comes from ``add_special_tokens``."""

    def __init__(self) -> None:
        super().__init__()
        self.chat = False
        self.chat_template = None


def test_a_prompt_without_a_chat_template_keeps_the_tokenizers_bos(monkeypatch):
    """slake.generate encoded with ``add_special_tokens=not chat_template``: with the default ``chat_template=True``
    and a tokenizer without a template, the prompt lost its BOS (Gemma 3 270M then answered "France. The The The
    ..." to "The capital of France is")."""
    model = tiny_model("llama-gqa", layers=2)
    seen = []
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: seen.append(k.get("input_ids")) or real_forward(*a, **k))
    plain = PlainTokenizer()
    assert not uses_chat_template(plain) and uses_chat_template(TinyTokenizer())
    res = slake.generate(model, plain, "w1 w2 w3", method="snapkv", budget=32, max_new_tokens=2)
    prompt = next(ids for ids in seen if ids is not None)
    assert res.prompt_tokens == [6] and prompt[0, 0].item() == 1  # BOS, then "w1", " ", "w2", " ", "w3"
    seen.clear()
    chat = slake.generate(model, TinyTokenizer(), "w1 w2 w3", method="snapkv", budget=32, max_new_tokens=2)
    prompt = next(ids for ids in seen if ids is not None)
    assert 1 not in prompt[0].tolist() and chat.prompt_tokens[0] > 6  # the template's tokens, no BOS added


def test_chat_template_false_still_adds_the_special_tokens():
    model = tiny_model("llama-gqa", layers=2)
    res = slake.generate(
        model, TinyTokenizer(), "w1 w2 w3", method="snapkv", budget=32, max_new_tokens=2, chat_template=False
    )
    assert res.prompt_tokens == [6]  # BOS and the five pieces, without a template
