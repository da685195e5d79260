"""The copies of preempted compressed requests' kept caches are capped by the bytes they hold together
(``PluginState.save_max_bytes``), not only by their count: at up to 269 MB each (docs/vllm.md), 64 of them could take
17 GB of host memory. Beyond the cap a preempted request is compressed afresh when recomputed; every copy's bytes
are given back when it is restored."""

from __future__ import annotations

import pytest
import torch

from conftest import preempting_run
from slake.engines.vllm.plugin.state import PluginState, _copy_bytes


def test_copy_bytes_counts_every_tensor_of_a_copy():
    copy = {
        "meta": {"pos": torch.zeros(3, 4, dtype=torch.int32), "widths": [4, 4], "seen": 7, "lin": None},
        "kv": {0: (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16))},
    }
    assert _copy_bytes(copy) == 3 * 4 * 4 + 2 * (2 * 8 * 2)


@pytest.mark.parametrize("cap", [None, 1], ids=["default-cap", "one-byte-cap"])
def test_saved_copies_are_capped_by_bytes(tiny_dir, monkeypatch, caplog, cap):
    if cap is not None:
        monkeypatch.setattr(PluginState, "save_max_bytes", cap)
    _, run = preempting_run(tiny_dir, "snapkv")
    assert run.preemptions[1] >= 1, "the KV memory was not small enough to preempt the compressed request"
    assert run.plugin is not None and len(run.tokens[1]) == 150
    counters = run.plugin["counters"]
    assert run.plugin["saved"] == 0 and run.plugin["saved_bytes"] == 0  # every copy restored and given back
    if cap is None:
        assert counters["saved"] >= 1 and counters["restored"] == counters["saved"]
    else:
        assert counters["saved"] == 0 and counters["restored"] == 0
        assert "would take the saved copies past" in caplog.text


def test_a_request_past_the_count_cap_is_told_which_cap(tiny_dir, monkeypatch, caplog):
    """Past ``save_max`` copies the warning said only that the request would be compressed afresh; the byte cap's
    said why. Now both name their cap."""
    monkeypatch.setattr(PluginState, "save_max", 0)
    _, run = preempting_run(tiny_dir, "snapkv")
    assert run.preemptions[1] >= 1, "the KV memory was not small enough to preempt the compressed request"
    assert run.plugin is not None and run.plugin["counters"]["saved"] == 0
    assert "0 saved copies are the most kept (PluginState.save_max)" in caplog.text
