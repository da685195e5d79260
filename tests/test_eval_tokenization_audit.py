"""How a sample becomes token ids (:func:`slake.eval.encoding.encode_sample`): a question-agnostic prompt spells the
same text as the query-aware one; where encoding the question alone would change that text (a SentencePiece tokenizer's
dummy prefix, as in Llama 2, Mistral and Phi-3), the parts are cut from the whole prompt's encoding instead."""

from __future__ import annotations

import pytest

from slake.eval.runner import encode_sample
from slake.eval.sample import Sample

RULER_LIKE = Sample(
    task="niah_single_1",
    context="The river keeps flowing toward the sea. The river keeps flowing.\n\n",
    question="What is the special magic number mentioned in the text above?",
    answers=["1"],
    metric="all",
    max_new_tokens=4,
    answer_prefix=" The special magic number mentioned in the text above is",
)


def _dummy_prefix_tokenizer():
    """A fast tokenizer that splits and marks words as Llama 2's and Mistral's do: ``Metaspace`` with
    ``prepend_scheme="first"``, so that every ``encode`` call starts with a word boundary (``▁``), newlines as tokens
    of their own (byte fallback there), and BOS added as a special token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(prepend_scheme="first"), pre_tokenizers.Split(Regex("\\n"), "isolated")]
    )
    tk.decoder = decoders.Metaspace(prepend_scheme="first")
    text = RULER_LIKE.context + RULER_LIKE.question + RULER_LIKE.answer_prefix
    tk.train_from_iterator([text] * 8, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_dummy_prefix_does_not_put_a_space_before_the_question():
    tok = _dummy_prefix_tokenizer()
    full, none = encode_sample(RULER_LIKE, tok, chat_template=False)
    ctx, question = encode_sample(RULER_LIKE, tok, query_aware=False, chat_template=False)
    assert none == [] and full[0] == tok.bos_token_id and full.count(tok.bos_token_id) == 1
    # encoded alone, the question would start with "▁What": a space the query-aware prompt does not have
    assert tok.convert_ids_to_tokens(tok.encode(RULER_LIKE.question, add_special_tokens=False))[0].startswith("▁")
    assert ctx + question == full
    assert question and not tok.convert_ids_to_tokens(question)[0].startswith("▁")
    assert tok.decode(ctx, skip_special_tokens=True) == RULER_LIKE.context


class _MergingTokenizer:
    """One id per character of ``"_" + text`` (a dummy prefix), except that ``"a\\n"`` is one id: a token across the
    context/question boundary when the context ends with ``a`` and the question starts with a newline."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        text = "_" + text
        i = 0
        while i < len(text):
            if text.startswith("a\n", i):
                ids.append(1000)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("a\n" if i == 1000 else chr(i) for i in ids).removeprefix("_")


def test_a_token_across_the_split_goes_to_the_question_part():
    tok = _MergingTokenizer()
    sample = Sample(task="t", context="xa", question="\nq?", answers=["1"], metric="all", max_new_tokens=2)
    full, _ = encode_sample(sample, tok, chat_template=False)
    ctx, question = encode_sample(sample, tok, query_aware=False, chat_template=False)
    assert ctx + question == full
    assert ctx == tok.encode("x")  # the compressed part never holds a character of the question
    assert question == [1000, ord("q"), ord("?")]


@pytest.mark.integration  # the packaged default model's tokenizer
def test_smollm2_keeps_the_separate_encoding_of_kvpress_pipeline():
    """SmolLM2 encodes the context's trailing blank line as one token alone and as two before the question: the same
    text, segmented as kvpress's pipeline segments it (context and question encoded separately), so the question-
    agnostic ids stay those of the stored protocol rows."""
    from slake.engines.transformers.models import load_tokenizer

    tok = load_tokenizer("smollm2")
    for chat in (True, False):
        full, _ = encode_sample(RULER_LIKE, tok, chat_template=chat)
        ctx, question = encode_sample(RULER_LIKE, tok, query_aware=False, chat_template=chat)
        assert ctx[-1] == tok.encode("\n\n")[0] and len(ctx) + len(question) == len(full) - 1
        assert tok.decode(ctx + question) == tok.decode(full)


def test_an_empty_chat_template_is_no_template_for_eval_as_for_generate():
    """``chat_template = ""`` counted as a template for ``slake eval`` (has_chat_template: not None) and as none for
    ``slake generate`` (uses_chat_template: falsy), so one tokenizer's prompts were sent two ways."""
    from slake.engines.transformers.generate import uses_chat_template
    from slake.eval.prompts import has_chat_template

    class Tok:
        chat_template = ""

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            raise AssertionError("an empty template is not rendered")

    assert has_chat_template(Tok()) is False is uses_chat_template(Tok())
    Tok.chat_template = "{{ messages }}"
    assert has_chat_template(Tok()) is True is uses_chat_template(Tok())
