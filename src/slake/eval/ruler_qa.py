"""RULER question answering (qa_1: SQuAD, qa_2: HotpotQA): gold paragraphs among distractors."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from slake.eval.data_sources import QARecord
from slake.eval.sample import Draft

__all__ = ["qa_renderer"]


def qa_renderer(records: Sequence[QARecord], seed: int | str) -> Callable[[int], Draft]:
    """Draw one QA sample; the renderer's size is the number of distractor words.

    A record is drawn; all of its own paragraphs are the gold documents (for HotpotQA these
    include its in-sample distractors, as in RULER).  Distractor documents are paragraphs of
    other records, drawn without replacement; the last one is cut at a word boundary so that
    the prompt can hit the target length.  Gold documents sit at random positions.

    Parameters
    ----------
    records : sequence of QARecord
        SQuAD or HotpotQA records from :mod:`slake.eval.data_sources`.
    seed : int or str
        Sample seed.

    Returns
    -------
    callable
        ``render(size)`` gives the :class:`Draft` with ``size`` words of distractor text.
    """
    if not records:
        raise ValueError("no QA records")
    rng = random.Random(f"qa:{seed}")
    record = records[rng.randrange(len(records))]
    gold = list(record.paragraphs)
    gold_slots = [rng.random() for _ in gold]
    pool: list[str] = []
    order: list[int] = []
    split_cache: dict[int, list[str]] = {}
    pooled = False

    def build_pool() -> None:
        # on first use: render(0), the record's own paragraphs alone, needs no pool (a caller may redraw then)
        nonlocal pooled
        if not pooled:
            own = set(gold)
            pool.extend(dict.fromkeys(p for r in records for p in r.paragraphs if p not in own))
            order.extend(range(len(pool)))
            random.Random(f"qa-pool:{seed}").shuffle(order)
            pooled = True

    def distractor_words(k: int) -> list[str]:
        if k not in split_cache:
            split_cache[k] = pool[order[k]].split()
        return split_cache[k]

    instruction = (
        "Answer the question using the documents below. Reply with the answer only, without "
        "any other words.\n\nThe documents:\n\n"
    )
    question = (
        "Answer the question using the documents above. Reply with the answer only, without "
        f"any other words.\n\nQuestion: {record.question}"
    )

    def render(n: int) -> Draft:
        docs: list[str] = []
        left = n
        k = 0
        if n > 0:
            build_pool()
        while left > 0 and k < len(order):
            words = distractor_words(k)
            docs.append(pool[order[k]] if len(words) <= left else " ".join(words[:left]))
            left -= len(words)
            k += 1
        slots = [round(s * len(docs)) for s in gold_slots]
        for slot, para in sorted(zip(slots, gold), key=lambda x: x[0], reverse=True):
            docs.insert(slot, para)
        text = "\n\n".join(f"Document {i}:\n{d}" for i, d in enumerate(docs, 1))
        return Draft(
            context=instruction + text + "\n\n",
            question=question,
            answers=list(record.answers),
            answer_prefix=" Answer:",
            metadata={"record_id": record.id, "source": record.source, "num_documents": len(docs)},
        )

    return render
