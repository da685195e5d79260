"""LongBench v1: load the official JSONL data, format prompts, truncate, make samples.

Data come from a local directory holding the official files (``<dir>/<dataset>.jsonl``, as in
the ``data.zip`` of the ``THUDM/LongBench`` dataset repository) or, where a network exists,
from that ``data.zip`` itself, downloaded once into the Hugging Face cache with ``huggingface_hub`` and read
without unpacking. Deviation from LongBench's README, which loads through ``datasets.load_dataset``: that path runs
the repository's loading script, which ``datasets`` 4.0 and later refuse to run.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from slake.eval.longbench_config import (
    CLASSIFICATION_DATASETS,
    DATASET2MAXLEN,
    DATASET2PROMPT,
    NO_CHAT_TEMPLATE_DATASETS,
    base_dataset,
)
from slake.eval.sample import Sample, count_tokens

__all__ = [
    "LongBenchRecord",
    "LONGBENCH_DIR_ENV",
    "HUB_REPO",
    "HUB_ARCHIVE",
    "read_longbench_archive",
    "load_longbench",
    "read_longbench_jsonl",
    "format_longbench_prompt",
    "split_longbench_prompt",
    "truncate_middle",
    "longbench_sample",
    "longbench_samples",
]

LONGBENCH_DIR_ENV = "SLAKE_LONGBENCH_DIR"
HUB_REPO = "THUDM/LongBench"
#: The archive of the official JSONL files in :data:`HUB_REPO` (``data/<dataset>.jsonl`` inside).
HUB_ARCHIVE = "data.zip"


@dataclass(frozen=True)
class LongBenchRecord:
    """One LongBench example in the official format.

    Attributes
    ----------
    input : str
        The question/instruction (may be empty, e.g. summarisation, lcc).
    context : str
        The long context.
    answers : list of str
        Ground truths.
    length : int
        Official length (words for English/code, characters for Chinese).
    dataset : str
        Dataset name (``"qasper"``, ``"qasper_e"`` ...).
    language : str
        ``"en"``, ``"zh"`` or ``"code"``.
    all_classes : list of str or None
        Class names for classification datasets.
    id : str
        The record's ``_id``.
    """

    input: str
    context: str
    answers: list[str]
    length: int
    dataset: str
    language: str
    all_classes: list[str] | None = None
    id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: dict[str, Any], dataset: str | None = None) -> LongBenchRecord:
        """Build from one official JSON object (unknown keys are kept in ``extra``).

        Parameters
        ----------
        obj : dict
            One record: ``context`` and ``input`` texts (either may be empty or missing, not both), ``answers`` (a
            list of texts, or one text; numbers are read as their text), ``all_classes`` (a list of class names, or
            null), ``_id`` (a text or an integer; null is no id), ``length``, ``dataset``, ``language``.
        dataset : str, optional
            The dataset the record is read for, where the record does not name its own.

        Returns
        -------
        LongBenchRecord

        Raises
        ------
        ValueError
            For a record that would be scored or prompted wrongly without a word: no answer, or only empty ones; no
            text; a field of another type than the official format's (``answers`` as a SQuAD-style object, which
            would be read as its keys; ``all_classes`` as one text, which would be read as its characters; a
            ``context`` that is a list of passages); a classification record (trec, lsht) without ``all_classes``.
        """
        known = {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}
        if not isinstance(obj, dict):
            raise ValueError(f"a LongBench record is a JSON object, got {type(obj).__name__}")
        answers = _texts(obj.get("answers"), "answers", obj)
        for key in ("context", "input", "dataset", "language"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise ValueError(
                    f"a LongBench record's {key!r} must be a text, got {type(obj[key]).__name__} "
                    f"(keys given: {sorted(obj)})"
                )
        if not any(answers) or not (obj.get("context") or obj.get("input")):
            # a record without answers scored 0 and counted in every average; one without text measured nothing
            raise ValueError(
                "a LongBench record needs a non-empty 'answers' and a 'context' or an 'input' "
                f"(keys given: {sorted(obj)})"
            )
        name = obj.get("dataset") or dataset or ""
        classes = _texts(obj.get("all_classes"), "all_classes", obj, one_text=False)
        if not classes and name and _base_of(name) in CLASSIFICATION_DATASETS:
            # LongBench scores these by the class names found in the prediction: without them every answer scores 0
            raise ValueError(
                f"a record of {name} needs a non-empty 'all_classes' (its metric matches class names; "
                f"keys given: {sorted(obj)})"
            )
        record_id = obj.get("_id")
        if record_id is not None and (isinstance(record_id, bool) or not isinstance(record_id, (str, int))):
            raise ValueError(f"a LongBench record's '_id' must be a text, got {type(record_id).__name__}")
        return cls(
            input=obj.get("input") or "",
            context=obj.get("context") or "",
            answers=answers,
            length=int(obj.get("length") or 0),
            dataset=name,
            language=obj.get("language") or "",
            all_classes=classes or None,
            id="" if record_id is None else str(record_id),  # null is no id (was "None", one id for them all)
            extra={k: v for k, v in obj.items() if k not in known},
        )


def _texts(value: Any, key: str, obj: dict[str, Any], *, one_text: bool = True) -> list[str]:
    """``value`` of field ``key`` as a list of texts: None is none, a text is one (where ``one_text``), a list's
    numbers are their text; ValueError for anything else (an object, a list holding null, lists or objects), which
    ``str`` or ``list`` would turn into other texts without a word."""
    if value is None:
        return []
    if isinstance(value, str) and one_text:
        return [value]
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    raise ValueError(
        f"a LongBench record's {key!r} must be a list of texts{' or one text' if one_text else ''}, got "
        f"{json.dumps(value, ensure_ascii=False)[:80]} (keys given: {sorted(obj)})"
    )


def read_longbench_jsonl(path: str | os.PathLike[str], dataset: str | None = None) -> list[LongBenchRecord]:
    """Read an official LongBench JSONL file.

    Parameters
    ----------
    path : path-like
        The file.
    dataset : str, optional
        The dataset it holds, for records that do not name theirs.

    Returns
    -------
    list of LongBenchRecord

    Raises
    ------
    ValueError
        Naming the file and line: a line that is not UTF-8, not JSON or not a valid record
        (:meth:`LongBenchRecord.from_json`); a file without any record.
    """
    with open(path, "rb") as fh:
        return _parse_lines(fh, str(path), dataset)


def read_longbench_archive(path: str | os.PathLike[str], dataset: str) -> list[LongBenchRecord]:
    """Read ``<dataset>.jsonl`` from the official ``data.zip`` without unpacking it.

    Parameters
    ----------
    path : path-like
        The archive.
    dataset : str
        The dataset to read.

    Returns
    -------
    list of LongBenchRecord

    Raises
    ------
    FileNotFoundError
        When the archive has no member named ``<dataset>.jsonl`` (in any folder).
    ValueError
        As :func:`read_longbench_jsonl`, naming the archive's member and line.
    """
    name = f"{dataset}.jsonl"
    with zipfile.ZipFile(path) as archive:
        members = [m for m in archive.namelist() if m.rsplit("/", 1)[-1] == name]
        if not members:
            raise FileNotFoundError(f"{path} has no {name}")
        member = sorted(members, key=len)[0]
        with archive.open(member) as fh:
            return _parse_lines(fh, f"{path}:{member}", dataset)


def _parse_lines(lines: Iterable[bytes], source: str, dataset: str | None) -> list[LongBenchRecord]:
    """The records of a JSONL file's ``lines`` (blank lines skipped), repeated ids made distinct
    (:func:`_distinct_ids`); ValueError naming ``source`` and the line for a bad line or a file without a record."""
    out = []
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
            if line.strip():
                out.append(LongBenchRecord.from_json(json.loads(line), dataset))
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}, line {number}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{source}, line {number}: not a LongBench record ({type(e).__name__}: {e})") from None
    if not out:
        raise ValueError(f"{source} holds no LongBench record")
    return _distinct_ids(out, source)


def _base_of(name: str) -> str:
    """The base dataset of ``name`` (``"trec_e"`` -> ``"trec"``), or ``name`` itself when it is not LongBench's."""
    try:
        return base_dataset(name)
    except KeyError:
        return name


def _distinct_ids(records: list[LongBenchRecord], source: str) -> list[LongBenchRecord]:
    """``records`` with each repeated ``_id`` made distinct: its k-th occurrence (k >= 2) becomes ``"<_id>#k"``.

    A sample's id is its key in the results store (with the method, budget and length), so two records sharing one
    would be one sample: the second's row was dropped as already written, and a rerun was refused as "made from
    another prompt". Records without an id are left to the caller (which numbers them by position). Warns when it
    renames any.
    """
    seen: dict[str, int] = {}
    out = []
    renamed = []
    for record in records:
        if record.id:
            seen[record.id] = seen.get(record.id, 0) + 1
            if seen[record.id] > 1:
                new_id = f"{record.id}#{seen[record.id]}"
                renamed.append(new_id)
                record = replace(record, id=new_id)
        out.append(record)
    if renamed:
        warnings.warn(
            f"{source}: {len(renamed)} record(s) repeat an earlier record's _id; evaluated as "
            f"{', '.join(renamed[:3])}{' ...' if len(renamed) > 3 else ''}",
            stacklevel=3,
        )
    return out


def _download_archive() -> str:
    """Path of :data:`HUB_ARCHIVE` in the Hugging Face cache, downloaded on first use."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(HUB_REPO, HUB_ARCHIVE, repo_type="dataset")
    except Exception as exc:  # offline, proxy, gated: one clear message, the cause chained
        raise ConnectionError(
            f"could not download {HUB_ARCHIVE} of the {HUB_REPO} dataset from the Hugging Face hub ({exc}). "
            f"Download it by hand, unzip it and pass its data directory (--longbench-dir, data_dir=...) or set "
            f"{LONGBENCH_DIR_ENV}"
        ) from exc


def _load_from_hub(dataset: str) -> list[LongBenchRecord]:
    return read_longbench_archive(_download_archive(), dataset)


def load_longbench(
    dataset: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    use_hub: bool = False,
    limit: int | None = None,
) -> list[LongBenchRecord]:
    """Load one LongBench dataset.

    Parameters
    ----------
    dataset : str
        A LongBench v1 dataset, or its LongBench-E variant (``"<name>_e"``).
    data_dir : path-like, optional
        Directory with ``<dataset>.jsonl``; defaults to ``$SLAKE_LONGBENCH_DIR``.
    use_hub : bool
        When no local file exists, read it from the ``data.zip`` of ``THUDM/LongBench`` (downloaded once into
        the Hugging Face cache; needs network the first time).
    limit : int, optional
        Keep only the first ``limit`` records.

    Returns
    -------
    list of LongBenchRecord

    Raises
    ------
    KeyError
        For an unknown dataset name.
    FileNotFoundError
        When no local file exists and ``use_hub`` is False.
    ConnectionError
        When ``use_hub`` is True and the archive cannot be downloaded (the message says how to get it by hand).
    """
    base_dataset(dataset)  # validate the name
    directory = data_dir if data_dir is not None else os.environ.get(LONGBENCH_DIR_ENV)
    records: list[LongBenchRecord] | None = None
    if directory is not None:
        for candidate in (Path(directory) / f"{dataset}.jsonl", Path(directory) / "data" / f"{dataset}.jsonl"):
            if candidate.is_file():
                records = read_longbench_jsonl(candidate, dataset)
                break
    if records is None:
        if not use_hub:
            raise FileNotFoundError(
                f"no {dataset}.jsonl found (data_dir={directory!r}); pass data_dir=<dir with the official "
                f"LongBench JSONL files>, set {LONGBENCH_DIR_ENV}, or use use_hub=True with network access"
            )
        records = _load_from_hub(dataset)
    return records[:limit] if limit is not None else records


def format_longbench_prompt(record: LongBenchRecord, dataset: str | None = None) -> str:
    """The official prompt: ``dataset2prompt[dataset].format(context=..., input=...)``."""
    template = DATASET2PROMPT[base_dataset(dataset or record.dataset)]
    return template.format(context=record.context, input=record.input)


def split_longbench_prompt(record: LongBenchRecord, dataset: str | None = None) -> tuple[str, str]:
    """The official prompt split right after the context: ``(context_part, question_part)``."""
    template = DATASET2PROMPT[base_dataset(dataset or record.dataset)]
    head, tail = template.split("{context}", 1)
    return head.format(input=record.input) + record.context, tail.format(input=record.input)


def truncate_middle(text: str, tokenizer: Any, max_length: int) -> str:
    """Official LongBench truncation: keep the first and last ``max_length // 2`` tokens.

    Texts of at most ``max_length`` tokens are returned unchanged.  The tokenizer needs
    ``encode(text, add_special_tokens=False)`` and ``decode(ids, skip_special_tokens=True)``.

    Deviation, on purpose: ``max_length`` counts the text's tokens only, as every length in slake does
    (:func:`slake.eval.sample.count_tokens`). The official ``pred.py`` encodes with the tokenizer's special tokens
    and drops them when decoding, so where the tokenizer adds a BOS (Llama, Mistral, Gemma) the BOS takes one of
    the ``max_length`` places: it truncates prompts of exactly ``max_length`` text tokens too, and its head keeps
    ``max_length // 2 - 1`` text tokens where this keeps ``max_length // 2`` (the tails are the same unless the
    tokenizer also appends an end token). With a tokenizer that adds no special token (Qwen) the texts are the same.

    Parameters
    ----------
    text : str
        The text to truncate.
    tokenizer : Any
        The model's tokenizer (``encode`` and ``decode`` as above).
    max_length : int
        Maximum length in tokens.

    Returns
    -------
    str
        ``text``, or its first and last ``max_length // 2`` tokens decoded and joined.
    """
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_length:
        return text
    half = max_length // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[len(ids) - half :], skip_special_tokens=True
    )


def longbench_sample(
    record: LongBenchRecord,
    tokenizer: Any = None,
    max_length: int | None = None,
    dataset: str | None = None,
) -> Sample:
    """Turn a record into a :class:`Sample` (official prompt, optional middle truncation).

    The whole formatted prompt is truncated as in the official ``pred.py``; it is then split
    back into context and question after the context.  If truncation cut into the text after
    the context (a question longer than ``max_length // 2`` tokens), the whole prompt becomes
    the context and the question is empty.

    Parameters
    ----------
    record : LongBenchRecord
        The record.
    tokenizer : optional
        Needed for truncation and for ``length``; ``length`` is 0 without one.
    max_length : int, optional
        Maximum prompt length in tokens (the official per-model ``model2maxlen``).
    dataset : str, optional
        Overrides ``record.dataset``.

    Returns
    -------
    Sample
        ``metric`` is the dataset name (see :func:`slake.eval.metrics.score_sample`);
        ``metadata`` holds ``all_classes``, ``language``, ``official_length`` and ``truncated``.
    """
    name = dataset or record.dataset
    base = base_dataset(name)
    context, question = split_longbench_prompt(record, name)
    full = context + question
    truncated = False
    if tokenizer is not None and max_length is not None:
        cut = truncate_middle(full, tokenizer, max_length)
        if cut != full:
            truncated = True
            if question and cut.endswith(question):
                context = cut[: len(cut) - len(question)]
            else:
                context, question = cut, ""
    length = count_tokens(tokenizer, context + question) if tokenizer is not None else 0
    return Sample(
        task=name,
        context=context,
        question=question,
        answers=list(record.answers),
        metric=name,
        max_new_tokens=DATASET2MAXLEN[base],
        length=length,
        sample_id=record.id,
        use_chat_template=base not in NO_CHAT_TEMPLATE_DATASETS,
        metadata={
            "all_classes": record.all_classes,
            "language": record.language,
            "official_length": record.length,
            "truncated": truncated,
        },
    )


def longbench_samples(
    records: Iterable[LongBenchRecord],
    tokenizer: Any = None,
    max_length: int | None = None,
    dataset: str | None = None,
) -> list[Sample]:
    """:func:`longbench_sample` for each record; a record without an ``_id`` gets ``"<dataset>-<i>"``, its position.

    A sample's id is its key in the results (with its task, length, method and budget), so records without one must
    not share the empty id: the runner would refuse them as one sample asking different things
    (:func:`slake.eval.runner.evaluate_suite`). ``slake eval`` numbers them the same way.

    Parameters
    ----------
    records : iterable of LongBenchRecord
        The records (:func:`load_longbench`).
    tokenizer : Any, optional
        As in :func:`longbench_sample`.
    max_length : int, optional
        As in :func:`longbench_sample`.
    dataset : str, optional
        As in :func:`longbench_sample`.

    Returns
    -------
    list of Sample
    """
    out = []
    for i, record in enumerate(records):
        sample = longbench_sample(record, tokenizer, max_length, dataset)
        sample.sample_id = sample.sample_id or f"{sample.task}-{i}"
        out.append(sample)
    return out
