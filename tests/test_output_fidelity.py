"""Output-level fidelity (teacher-forced next-token distributions vs the full cache) and its continuations."""

from __future__ import annotations

import math

import pytest
import torch

from slake.quality.output_fidelity import (
    Continuation,
    distances,
    mean_distance,
    measure_outputs,
    prepare_reference,
    summary_table,
    teacher_forced_logprobs,
)
from tiny_models import random_ids


def _continuations(lengths=(120, 90), T=8):
    out = []
    for i, n in enumerate(lengths):
        ids = random_ids(n + T, seed=40 + i)[0].tolist()
        out.append(Continuation("text" if i % 2 == 0 else "answer", f"s{i}", ids[:n], ids[n:]))
    return out


def test_full_cache_logprobs_equal_one_forward_over_prompt_and_continuation(llama_gqa):
    model = llama_gqa
    conts = _continuations()
    ref = prepare_reference(model, conts)
    for b, c in enumerate(conts):
        ids = torch.tensor([c.prompt_ids + c.target_ids])
        with torch.no_grad():
            exact = torch.log_softmax(model(ids).logits[0].float(), -1)
        n, T = len(c.prompt_ids), len(c.target_ids)
        torch.testing.assert_close(ref.full_lp[b, :T], exact[n - 1 : n - 1 + T], rtol=1e-4, atol=1e-4)


def test_full_and_uncompressed_methods_have_zero_distance_and_evicting_ones_do_not(llama_gqa):
    model = llama_gqa
    ref = prepare_reference(model, _continuations())
    for method, budget in (("full", 16), ("snapkv", 4096), ("slake", 4096)):
        rows = measure_outputs(model, ref, method, budget)
        assert len(rows) == 2 and [r["kind"] for r in rows] == ["text", "answer"]
        assert mean_distance(rows) < 1e-6 and abs(mean_distance(rows, "delta_nll")) < 1e-5
        assert mean_distance(rows, "top1") == 1.0
    rows = measure_outputs(model, ref, "streamingllm", 12)
    assert mean_distance(rows) > 1e-4
    assert all(r["tokens"] == 7 for r in rows)  # the first continuation token is predicted exactly: left out
    assert "streamingllm" in summary_table(rows)


def test_batched_rows_equal_single_rows(llama_gqa):
    model = llama_gqa
    conts = _continuations()
    both = measure_outputs(model, prepare_reference(model, conts), "snapkv[window=8]", 24)
    for b, c in enumerate(conts):
        single = measure_outputs(model, prepare_reference(model, [c]), "snapkv[window=8]", 24)[0]
        assert math.isclose(single["kl"], both[b]["kl"], rel_tol=1e-3, abs_tol=1e-6)
        assert math.isclose(single["delta_nll"], both[b]["delta_nll"], rel_tol=1e-3, abs_tol=1e-5)


def test_distances_by_hand():
    p = torch.tensor([[[0.5, 0.5], [0.9, 0.1]]]).log()
    q = torch.tensor([[[0.25, 0.75], [0.9, 0.1]]]).log()
    targets = torch.tensor([[1, 0]])
    d = distances(p, q, targets, torch.tensor([[True, False]]))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert math.isclose(d["kl"][0], kl, rel_tol=1e-6)
    assert math.isclose(d["delta_nll"][0], -math.log(0.75) + math.log(0.5), rel_tol=1e-6)
    assert d["top1"] == [0.0] and d["tokens"] == [1]
    assert math.isnan(distances(p, q, targets, torch.zeros(1, 2, dtype=torch.bool))["kl"][0])


def test_distances_at_a_token_the_full_cache_gives_probability_zero():
    # 0 * log(0 / q) is 0: a token the full cache rules out adds nothing to KL(full || method), not NaN
    p = torch.tensor([[[1.0, 0.0]]]).log()
    q = torch.tensor([[[0.5, 0.5]]]).log()
    d = distances(p, q, torch.tensor([[0]]), torch.tensor([[True]]))
    assert math.isclose(d["kl"][0], math.log(2.0), rel_tol=1e-6)


def test_distances_ignore_what_lies_past_a_rows_end():
    # a position that does not count never reaches the means, even where its values are not finite
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]).log()
    q = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]).log()
    q[0, 1] = float("nan")
    d = distances(p, q, torch.tensor([[1, 0]]), torch.tensor([[True, False]]))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert math.isclose(d["kl"][0], kl, rel_tol=1e-6)
    assert math.isclose(d["delta_nll"][0], -math.log(0.75) + math.log(0.5), rel_tol=1e-6)
    assert d["top1"] == [0.0]


def test_bad_continuations_raise(llama_gqa):
    with pytest.raises(ValueError, match="at least 2"):
        prepare_reference(llama_gqa, [Continuation("text", "x", [5, 6, 7], [8])])
    with pytest.raises(ValueError, match="no continuation"):
        prepare_reference(llama_gqa, [])


def test_teacher_forcing_feeds_the_given_tokens(llama_gqa):
    """A different continuation gives different log-probabilities after the first position."""
    model = llama_gqa
    conts = _continuations(lengths=(60,))
    ref = prepare_reference(model, conts)
    other = ref.targets.clone()
    other[0, 0] = (other[0, 0] + 1) % 250
    lp = teacher_forced_logprobs(model, ref.capture, ref.capture.replay("full", 1), other)
    torch.testing.assert_close(lp[:, 0], ref.full_lp[:, 0])
    assert not torch.allclose(lp[:, 1], ref.full_lp[:, 1])
