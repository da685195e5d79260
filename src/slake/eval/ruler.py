"""RULER: the 13 synthetic tasks, generated to a target length in the model's tokens.

Our own generators and wording, following the task definitions of the RULER paper
(Hsieh et al., 2024): a task instruction first, the long input, the question last, and an answer
prefix that the prompt builder places after the chat template's generation prompt.

========================  =========================================================  ========  =====
task                      what it is                                                 metric    max
========================  =========================================================  ========  =====
niah_single_1             one needle (word key, 7-digit value) in repeated noise     all       128
niah_single_2             one needle in essays                                       all       128
niah_single_3             one needle with a UUID value in essays                     all       128
niah_multikey_1           the asked needle plus 3 distractor needles in essays       all       128
niah_multikey_2           one needle in a haystack made of distractor needles        all       128
niah_multikey_3           as multikey_2 with UUID keys and values                    all       128
niah_multivalue           4 values for the asked key, in essays                      all       128
niah_multiquery           4 keys asked, in essays                                    all       128
vt                        variable tracking: a 4-hop assignment chain in noise       all       30
cwe                       the 10 most common words of a numbered word list           all       120
fwe                       the 3 most frequent coded words of Zipf-sampled text       all       50
qa_1                      SQuAD: gold paragraph among distractor paragraphs          part      32
qa_2                      HotpotQA: gold paragraphs among distractor paragraphs      part      32
========================  =========================================================  ========  =====

Deviations from the reference implementation (NVIDIA/RULER, checked against its scripts on
2026-11-29):

* no few-shot example is prepended to vt/cwe/fwe;
* cwe words come from the essays' vocabulary (or a given list) and lower their repetition counts
  for short targets;
* lengths count the plain prompt (``context + question + answer_prefix``) without chat-template
  tokens, and not the tokens to generate: RULER's ``max_seq_length`` counts those too (it keeps a
  haystack whose prompt plus ``tokens_to_generate`` fits), so at a given length these prompts are
  up to the task's ``max`` (128 tokens for niah) longer than RULER's;
* our own wording, with RULER's structure: one-answer needle tasks ask in the singular and the
  others ask for all values, as RULER's do; vt's prefix says how many variables to list (since
  2026-11-29; before, every needle task asked in the plural and vt's prefix gave no count);
* haystack layout: units are joined by spaces where RULER puts each on its own line, the noise
  unit is one sentence (RULER's is a five-sentence block), vt's statements end with a full stop,
  and the essay haystack starts at a random sentence (RULER's at the essays' beginning);
* qa_1 draws its distractor paragraphs from every other SQuAD paragraph; RULER takes them first
  from the gold paragraph's own article (at 4K nearly all of them), which makes its distractors
  harder; the last distractor is cut to fit where RULER keeps whole documents;
* fwe samples Zipf frequencies over 1,000 ranks of 3-6-letter coded words (redrawing ties), with
  ``....`` as noise; RULER sets each word's count to ``int(N k^-alpha / zeta(alpha))`` over
  ``(L - 50) // 50`` ranks of 6-letter words, with ``...`` as noise.

Lengths: the target is a maximum, as RULER's ``max_seq_length`` (but for the tokens to generate,
above).  RULER searches the haystack's size in whole units and keeps the largest whose prompt stays
within the maximum; here the step is one unit (:func:`slake.eval.fitting.fit_to_length`), and a
prompt ends within 2% below the target or, when one unit is coarser than that (the ~60-token UUID distractor needles of
niah_multikey_3 at up to ~3,000 tokens), less than one unit below it.  A qa record whose own paragraphs
alone exceed the target (HotpotQA's ten, over 1,024 tokens for most records) is redrawn from the
sample's seed (``metadata["attempt"]``), so at short lengths qa_2 draws from the shorter records;
RULER keeps every record's ten paragraphs too, and has no such case to handle at its 4K and longer
lengths, where nearly every record fits.
A :class:`~slake.eval.fitting.LengthFitError` names the task, length and seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slake.eval.data_sources import QARecord, hotpotqa_samples, squad_samples
from slake.eval.fitting import DEFAULT_TOLERANCE, Fit, LengthFitError, fit_to_length
from slake.eval.haystack import default_essays
from slake.eval.metrics import ruler_score, string_match_all, string_match_part
from slake.eval.ruler_niah import NIAH_TASKS, niah_renderer
from slake.eval.ruler_qa import qa_renderer
from slake.eval.ruler_vt import vt_renderer
from slake.eval.ruler_words import cwe_renderer, fwe_renderer, vocabulary_from_texts
from slake.eval.sample import Draft, Sample, TokenizerLike, count_tokens, depth_label

__all__ = [
    "RULER_TASKS",
    "RulerTaskSpec",
    "TASK_SPECS",
    "ruler_sample",
    "ruler_samples",
    "ruler_score",
    "string_match_all",
    "string_match_part",
]


@dataclass(frozen=True)
class RulerTaskSpec:
    """Scoring and generation settings of a RULER task."""

    name: str
    category: str
    metric: str
    max_new_tokens: int


_CATEGORY = {"vt": "multi_hop_tracing", "cwe": "aggregation", "fwe": "aggregation", "qa_1": "qa", "qa_2": "qa"}

RULER_TASKS: tuple[str, ...] = (*NIAH_TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2")

TASK_SPECS: dict[str, RulerTaskSpec] = {
    **{t: RulerTaskSpec(t, "retrieval", "all", 128) for t in NIAH_TASKS},
    "vt": RulerTaskSpec("vt", _CATEGORY["vt"], "all", 30),
    "cwe": RulerTaskSpec("cwe", _CATEGORY["cwe"], "all", 120),
    "fwe": RulerTaskSpec("fwe", _CATEGORY["fwe"], "all", 50),
    "qa_1": RulerTaskSpec("qa_1", "qa", "part", 32),
    "qa_2": RulerTaskSpec("qa_2", "qa", "part", 32),
}

#: (freq_common, freq_uncommon) tried in order for cwe; the first whose common-word block fits
#: in half the target length is used.
_CWE_FREQS: tuple[tuple[int, int], ...] = ((30, 3), (20, 3), (10, 2), (5, 1), (2, 1))


def _default_max_size(length: int) -> int:
    return 4 * length + 1000


def _fit(
    render: Callable[[int], Draft], tokenizer: TokenizerLike, length: int, max_size: int, tolerance: float
) -> Fit[Draft]:
    return fit_to_length(render, Draft.text, tokenizer, length, max_size, tolerance=tolerance)


def _fit_cwe(seed: str, vocab: list[str], tokenizer: TokenizerLike, length: int, tolerance: float) -> Fit[Draft]:
    """Use the highest repetition counts whose common-word block fits in half the target."""
    for freq_c, freq_u in _CWE_FREQS:
        render, max_words = cwe_renderer(seed, vocab, freq_common=freq_c, freq_uncommon=freq_u)
        if count_tokens(tokenizer, render(0).text()) <= length // 2 or (freq_c, freq_u) == _CWE_FREQS[-1]:
            break
    return _fit(render, tokenizer, length, max_words, tolerance)


def _fit_fwe(seed: str, tokenizer: TokenizerLike, length: int, max_size: int, tolerance: float) -> Fit[Draft]:
    """Redraw (up to 20 times) until the top words are not tied with the next one."""
    for attempt in range(20):
        fit = _fit(fwe_renderer(f"{seed}:{attempt}"), tokenizer, length, max_size, tolerance)
        if not fit.value.metadata["tie"]:
            fit.value.metadata["attempt"] = attempt
            return fit
    raise LengthFitError("could not draw a text without ties in 20 attempts")


#: Records drawn (from the sample's seed) for qa_1/qa_2 before giving up on finding one whose own
#: paragraphs fit the target length.
_QA_DRAWS = 500


def _fit_qa(
    records: Sequence[QARecord], seed: str, tokenizer: TokenizerLike, length: int, max_size: int, tolerance: float
) -> Fit[Draft]:
    """Redraw the record (up to :data:`_QA_DRAWS` times) until its own paragraphs fit ``length``."""
    shortest: int | None = None
    for attempt in range(_QA_DRAWS):
        render = qa_renderer(records, seed if attempt == 0 else f"{seed}:{attempt}")
        base = count_tokens(tokenizer, render(0).text())
        if base <= length:
            fit = _fit(render, tokenizer, length, max_size, tolerance)
            fit.value.metadata["attempt"] = attempt
            return fit
        shortest = base if shortest is None else min(shortest, base)
    raise LengthFitError(
        f"target length {length} is too small: in {_QA_DRAWS} records drawn, the shortest prompt with only a "
        f"record's own paragraphs (no distractors) has {shortest} tokens"
    )


def ruler_sample(
    task: str,
    tokenizer: TokenizerLike,
    length: int,
    *,
    seed: int = 0,
    essays: Sequence[str] | None = None,
    qa_records: Sequence[QARecord] | None = None,
    vocabulary: Sequence[str] | None = None,
    depth: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Sample:
    """Generate one RULER sample whose plain prompt has at most ``length`` tokens, as close as its haystack allows.

    The prompt ends within ``tolerance`` below ``length``, or less than one haystack unit below it when a
    unit is coarser than that (module docstring).

    Parameters
    ----------
    task : str
        One of :data:`RULER_TASKS`.
    tokenizer : TokenizerLike
        The model's tokenizer (``encode(text, add_special_tokens=False)``).
    length : int
        Target length in tokens.
    seed : int
        Sample seed; the same seed gives the same sample.
    essays : sequence of str, optional
        Essay haystack source (essay NIAH tasks; cwe vocabulary); Paul Graham essays by default.
    qa_records : sequence of QARecord, optional
        Records for qa_1/qa_2; SQuAD / HotpotQA from the installed data by default.
    vocabulary : sequence of str, optional
        Word list for cwe; the essays' vocabulary by default.
    depth : float, optional
        NIAH tasks only (the ``niah_*`` tasks, which have a needle): depth in percent, in ``[0, 100]``, of the
        (first) asked needle; random when None.
    tolerance : float
        Allowed relative shortfall of the achieved length.

    Returns
    -------
    Sample

    Raises
    ------
    KeyError
        For an unknown task (the message lists the known ones).
    ValueError
        For a ``depth`` given to a task without a needle (vt, cwe, fwe, qa_1, qa_2), which would ignore it, or a
        ``depth`` outside ``[0, 100]``.
    LengthFitError
        When no sample fits ``length``; the message names the task, length and seed, and the cause.
    """
    if task not in TASK_SPECS:
        raise KeyError(f"unknown RULER task {task!r}; expected one of {RULER_TASKS}")
    if depth is not None and task not in NIAH_TASKS:
        raise ValueError(f"depth places a needle: RULER task {task} has none (the niah_* tasks do), got depth={depth}")
    spec = TASK_SPECS[task]
    extra: dict[str, object] = {"seed": seed, "target_length": length}
    try:
        fit = _fit_task(task, tokenizer, length, seed, essays, qa_records, vocabulary, depth, tolerance)
    except LengthFitError as e:
        raise LengthFitError(f"RULER task {task}, length {length}, seed {seed}: {e}") from e
    draft = fit.value
    depth_value = draft.metadata.get("depth") if task in NIAH_TASKS else None
    return draft.to_sample(
        task=task,
        metric=spec.metric,
        max_new_tokens=spec.max_new_tokens,
        length=fit.length,
        # a depth asked for is a prompt of its own (make-prompt --depth): its id says so
        sample_id=f"{task}-{length}-{seed}" + ("" if depth is None else f"-d{depth_label(depth)}"),
        depth=depth_value,
        extra=extra,
    )


def _fit_task(
    task: str,
    tokenizer: TokenizerLike,
    length: int,
    seed: int,
    essays: Sequence[str] | None,
    qa_records: Sequence[QARecord] | None,
    vocabulary: Sequence[str] | None,
    depth: float | None,
    tolerance: float,
) -> Fit[Draft]:
    """The fitted draft of one sample (arguments as in :func:`ruler_sample`)."""
    task_seed = f"{task}:{seed}"
    max_size = _default_max_size(length)
    if task in NIAH_TASKS:
        cfg = NIAH_TASKS[task]
        render = niah_renderer(cfg, task_seed, default_essays(essays) if cfg.haystack == "essay" else None, depth)
        return _fit(render, tokenizer, length, max_size, tolerance)
    if task == "vt":
        return _fit(vt_renderer(task_seed), tokenizer, length, max_size, tolerance)
    if task == "cwe":
        vocab = list(vocabulary) if vocabulary is not None else vocabulary_from_texts(default_essays(essays))
        return _fit_cwe(task_seed, vocab, tokenizer, length, tolerance)
    if task == "fwe":
        return _fit_fwe(task_seed, tokenizer, length, max_size, tolerance)
    records = qa_records
    if records is None:
        records = squad_samples() if task == "qa_1" else hotpotqa_samples()
    return _fit_qa(records, task_seed, tokenizer, length, max_size, tolerance)


def ruler_samples(
    task: str,
    tokenizer: TokenizerLike,
    length: int,
    num_samples: int,
    *,
    seed: int = 0,
    **kwargs: object,
) -> list[Sample]:
    """``num_samples`` samples with seeds ``seed, seed + 1, ...``.  Data files are loaded once and shared.

    Parameters
    ----------
    task : str
        One of :data:`RULER_TASKS`.
    tokenizer : TokenizerLike
        The model's tokenizer.
    length : int
        Target length in tokens.
    num_samples : int
        How many samples.
    seed : int
        Seed of the first sample.
    **kwargs
        ``essays``, ``qa_records``, ``vocabulary``, ``depth``, ``tolerance``, as in :func:`ruler_sample`.

    Returns
    -------
    list of Sample

    Raises
    ------
    KeyError, ValueError, LengthFitError
        As :func:`ruler_sample`.
    """
    if task in ("qa_1", "qa_2") and kwargs.get("qa_records") is None:
        kwargs["qa_records"] = squad_samples() if task == "qa_1" else hotpotqa_samples()
    if task == "cwe" and kwargs.get("vocabulary") is None:
        kwargs["vocabulary"] = vocabulary_from_texts(default_essays(kwargs.get("essays")))  # type: ignore[arg-type]
    if task in NIAH_TASKS and NIAH_TASKS[task].haystack == "essay" and kwargs.get("essays") is None:
        kwargs["essays"] = default_essays(None)
    return [ruler_sample(task, tokenizer, length, seed=seed + i, **kwargs) for i in range(num_samples)]  # type: ignore[arg-type]
