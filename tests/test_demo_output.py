"""``slake demo`` prints answers as text a person reads, not as Python reprs."""

from slake.cli.demo import answer_excerpt
from test_bench_honesty import fake_demo


def test_answer_excerpt_collapses_line_breaks_and_the_leading_colon():
    assert answer_excerpt(":\n\n1. 4680899\n2. 4680899") == "1. 4680899 2. 4680899"
    assert "\\n" not in answer_excerpt("a\nb") and answer_excerpt("a\nb") == "a b"


def test_answer_excerpt_cuts_long_answers_at_a_word_boundary():
    text = " ".join(["word"] * 40)
    out = answer_excerpt(text, width=30)
    assert out.endswith(" ...") and len(out) <= 34 and " wor ..." not in out


def test_answer_excerpt_says_when_the_answer_is_empty():
    assert answer_excerpt("") == "(empty answer)"
    assert answer_excerpt(" \n: ") == "(empty answer)"


# 2026-11-30 audit of the CLI: a decode time of 0 where none was timed, --method full accepted, --depth accepted and
# ignored for tasks without a needle, and an error that named a --allow-long-context flag the demo did not have


def test_demo_says_na_where_no_decode_step_was_timed(monkeypatch, capsys):
    import json

    from slake.cli import main

    fake_demo(monkeypatch, {"full": 10, "kept": 10}, {"full": 10, "kept": 5}, decode_ms=0.0)
    argv = ["demo", "--length", "1024", "--budget", "64", "--max-new-tokens", "1"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["full"]["decode_ms_per_token"] is None and out["compressed"]["decode_ms_per_token"] is None
    assert main(argv) == 0
    assert "decode n/a ms/token" in capsys.readouterr().out


def test_demo_depth_only_where_a_needle_is_and_long_context_on_request(monkeypatch, capsys):
    from slake.cli import main

    seen = fake_demo(monkeypatch, {"full": 10, "kept": 10}, {"full": 10, "kept": 5}).options
    assert main(["demo", "--task", "niah_single_1", "--length", "1024", "--json"]) == 0
    assert seen["depth"] == 50.0 and seen["allow_long_context"] is False
    assert main(["demo", "--task", "cwe", "--length", "1024", "--json", "--allow-long-context"]) == 0
    assert seen["depth"] is None and seen["allow_long_context"] is True
    capsys.readouterr()
    assert main(["demo", "--task", "cwe", "--depth", "10", "--length", "1024"]) == 2
    assert "--depth places a needle: task cwe has none" in capsys.readouterr().err
    assert main(["demo", "--method", "full", "--length", "1024"]) == 2
    assert "--method full" in capsys.readouterr().err


def _answers(monkeypatch, engine, texts: dict) -> None:
    """The fake engine answers ``texts[method]``."""
    generate = engine.generate

    def answer(prompt, *, method, **kw):
        result = generate(prompt, method=method, **kw)
        result.texts = [texts[method]]
        return result

    monkeypatch.setattr(engine, "generate", answer)


def test_demo_advises_a_larger_budget_only_when_the_full_cache_answered(monkeypatch, capsys):
    """A larger budget cannot beat the full cache: where it also missed, the demo said "try a larger --budget"."""
    from slake.cli import main

    engine = fake_demo(monkeypatch, {"full": 10, "kept": 10}, {"full": 10, "kept": 5})
    argv = ["demo", "--length", "1024", "--budget", "64", "--max-new-tokens", "4"]
    _answers(monkeypatch, engine, {"full": "1234567", "slake": "7654321"})
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "full cache did not answer correctly either" in err and "larger --budget" not in err
    _answers(monkeypatch, engine, {"full": "4680899", "slake": "7654321"})
    assert main(argv) == 0
    assert "try a larger --budget" in capsys.readouterr().err


def test_demo_says_a_hidden_fact_only_where_one_is_hidden(monkeypatch, capsys):
    """ "with one hidden fact" was printed for cwe (count words), vt and the multi-needle tasks."""
    from slake.cli import main

    fake_demo(monkeypatch, {"full": 10, "kept": 10}, {"full": 10, "kept": 5})
    said_for = {
        "niah_single_1": " with one hidden fact (niah",
        "niah_multikey_2": " with hidden facts (niah",
        "cwe": "tokens (cwe)",
    }
    for task, said in said_for.items():
        assert main(["demo", "--task", task, "--length", "1024", "--max-new-tokens", "4"]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert said in first, first
