"""Sample building for ``slake eval``: lengths reachable with a coarse haystack unit, errors that name the sample,
needle seeds independent of the grid's lists, ``--depths`` refused where a suite cannot honour it."""

from __future__ import annotations

import pytest

from slake.eval.fitting import LengthFitError, fit_to_length
from slake.eval.needle import needle_sample
from slake.eval.ruler import RULER_TASKS, ruler_sample
from slake.eval.suites import DEFAULT_LENGTHS, DEFAULT_SAMPLES, build_samples, plan_suite
from test_eval_support import WordTokenizer, fake_essays, fake_qa_records

ESSAYS = fake_essays(n_essays=4, sentences=60)


def _unit_tokens(tok, sample) -> int:
    """Tokens one more distractor needle adds to a needle-haystack RULER sample: the most it may fall short by."""
    from slake.eval.ruler_niah import NIAH_TASKS, niah_renderer

    cfg = NIAH_TASKS[sample.task]
    render = niah_renderer(cfg, f"{sample.task}:{sample.metadata['seed']}")
    size = sample.context.count("Remember that") - cfg.num_keys * cfg.num_values  # the fitted haystack size
    assert render(size).context == sample.context
    return len(tok.encode(render(size + 1).text())) - len(tok.encode(render(size).text()))


# ----------------------------------------------------------------------------- 1. coarse haystack units


def test_a_shortfall_under_one_coarse_unit_is_accepted():
    tok = WordTokenizer()  # "u " is two tokens: a unit of 30 of them is 60 tokens, 6% of the target
    fit = fit_to_length(lambda n: "head " * 10 + "u " * (30 * n), str, tok, 1030, 100)
    assert (fit.size, fit.length) == (16, 980)  # 17 units would be 1040 > 1030: as close as the unit allows
    with pytest.raises(LengthFitError, match="largest haystack allowed"):
        fit_to_length(lambda n: "head " * 10 + "u " * (30 * n), str, tok, 1030, 10)  # the source ends first


@pytest.mark.parametrize("length", [600, 1024])
def test_niah_multikey_3_builds_where_a_needle_is_coarser_than_the_tolerance(length):
    tok = WordTokenizer()  # a UUID key-value needle is ~50 tokens here, more than 2% of these lengths
    for seed in range(6):
        s = ruler_sample("niah_multikey_3", tok, length, seed=seed)
        assert 0 <= length - s.length < _unit_tokens(tok, s)
        assert s.answers[0] in s.context


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from slake.engines.transformers.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.mark.integration  # the packaged default model's tokenizer: the unit tier reads no model package
def test_the_default_ruler_command_builds_with_the_default_tokenizer(smollm2_tokenizer):
    """``slake eval --suite ruler`` without --lengths/--samples/--seed: every task, 2048 tokens, seeds 0-4."""
    tok = smollm2_tokenizer
    plan = plan_suite("ruler")
    assert plan.lengths == list(DEFAULT_LENGTHS["ruler"]) == [2048] and plan.samples == DEFAULT_SAMPLES["ruler"] == 5
    samples = build_samples(plan, tok)
    assert [(s.task, s.metadata["seed"]) for s in samples] == [(t, k) for t in RULER_TASKS for k in range(5)]
    for s in samples:
        slack = _unit_tokens(tok, s) if s.task == "niah_multikey_3" else 0.02 * 2048
        assert 0 <= 2048 - s.length <= slack, (s.sample_id, s.length)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("task", "length", "seeds"), [("niah_multikey_3", 1024, range(6)), ("qa_2", 2048, [5, 6]), ("qa_2", 1024, range(6))]
)
def test_the_audited_failures_build_with_the_default_tokenizer(smollm2_tokenizer, task, length, seeds):
    """niah_multikey_3 failed at 1024 for every seed; a qa_2 record's own ten paragraphs overflowed 2048 for seeds
    5 and 6, and 1024 for most seeds."""
    for seed in seeds:
        s = ruler_sample(task, smollm2_tokenizer, length, seed=seed)
        assert s.length <= length
        if task == "qa_2":
            assert length - s.length <= 0.02 * length  # distractor words fill the rest
        else:
            assert 0 <= length - s.length < _unit_tokens(smollm2_tokenizer, s)


def test_qa_redraws_a_record_whose_own_paragraphs_exceed_the_length():
    tok = WordTokenizer()
    long_records = fake_qa_records(n=40, paragraphs=12, seed=1)  # ~1,500 tokens each: never fit 1000
    short = fake_qa_records(n=1, paragraphs=2, seed=2)[0]
    s = ruler_sample("qa_2", tok, 1000, seed=0, qa_records=[*long_records, short])
    assert s.metadata["record_id"] == short.id and s.metadata["attempt"] > 0 and 980 <= s.length <= 1000
    again = ruler_sample("qa_2", tok, 1000, seed=0, qa_records=[*long_records, short])
    assert again.context == s.context  # the redraw follows the seed


# ----------------------------------------------------------------------------- 1b. errors name the sample


def test_length_fit_errors_name_the_task_length_seed_and_cause():
    tok = WordTokenizer()
    with pytest.raises(LengthFitError, match=r"RULER task qa_2, length 100, seed 3: .*own paragraphs"):
        ruler_sample("qa_2", tok, 100, seed=3, qa_records=fake_qa_records(n=5))
    with pytest.raises(LengthFitError, match=r"RULER task niah_multikey_1, length 50, seed 2: .*without any haystack"):
        ruler_sample("niah_multikey_1", tok, 50, seed=2, essays=ESSAYS)
    vocabulary = [f"word{c}" for c in "abcdefghijklmnop"]  # 6 uncommon words: far too few for 5,000 tokens
    with pytest.raises(LengthFitError, match=r"RULER task cwe, length 5000, seed 0: .*largest haystack allowed"):
        ruler_sample("cwe", tok, 5000, vocabulary=vocabulary)
    with pytest.raises(LengthFitError, match=r"needle, length 30, depth 50, seed 7: .*without any haystack"):
        needle_sample(tok, 30, 50, seed=7, essays=ESSAYS)
    plan = plan_suite("ruler", ["vt"], [40], 2, seed=4)
    with pytest.raises(LengthFitError, match=r"RULER task vt, length 40, seed 4: "):
        build_samples(plan, tok)


# ----------------------------------------------------------------------------- 2. needle seeds


def test_a_needle_cell_does_not_depend_on_the_other_depths_and_lengths():
    tok = WordTokenizer()

    def cells(lengths, depths):
        plan = plan_suite("needle", None, lengths, 2, 0, depths)
        return {
            (s.metadata["target_length"], s.depth, s.sample_id): s.context
            for s in build_samples(plan, tok, essays=ESSAYS)
        }

    wide, narrow = cells([200, 300], [0, 50, 100]), cells([300], [50, 100])
    assert len(wide) == 12 and len(narrow) == 4
    assert all(wide[key] == context for key, context in narrow.items())  # same ids, same prompts: a rerun resumes
    assert len({(n, d) for n, d, _ in wide}) == 6  # two distinct samples per cell, no more
    from slake.eval.needle import needle_cell_seed

    assert needle_cell_seed(0, 300, 50) == needle_cell_seed(0, 300, 50.0) != needle_cell_seed(1, 300, 50)


# ----------------------------------------------------------------------------- 3. --depths


def test_depths_are_refused_for_suites_that_cannot_honour_them(tmp_path):
    with pytest.raises(ValueError, match="--depths applies to the needle suite only, not to ruler"):
        plan_suite("ruler", None, [2048], 1, 0, [50.0])
    with pytest.raises(ValueError, match="--depths applies to the needle suite only, not to longbench"):
        plan_suite("longbench", ["trec"], None, 1, 0, [50.0], longbench_dir=tmp_path)
    assert plan_suite("ruler", None, [2048], 1, 0, None).tasks == list(RULER_TASKS)
    assert plan_suite("needle", None, [2048], 1, 0, [50.0]).depths == [50.0]


def test_cmd_eval_refuses_depths_for_ruler_before_the_model_loads(tmp_path):
    from slake.cli.eval import cmd_eval
    from slake.engines.transformers import TransformersEngine
    from test_eval_runner import _eval_args

    def loader(args):
        raise AssertionError("the model must not load")

    args = _eval_args(tmp_path)  # --depths 0,100
    args.suite = "ruler"
    with pytest.raises(ValueError, match="--depths applies to the needle suite only"):
        cmd_eval(args, engine=TransformersEngine(loader=loader))
