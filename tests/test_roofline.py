"""The memory roofline of a decode step (:mod:`slake.engines.transformers.roofline`): the bytes a step must read
and the device's copy bandwidth, as ``slake bench`` reports them beside each decode time."""

from __future__ import annotations

import pytest
import torch

from slake.engines.transformers.memory import MemoryMeter
from slake.engines.transformers.roofline import (
    COPY_BYTES,
    copy_bandwidth,
    decode_weight_bytes,
    roofline_fields,
    step_kv_bytes,
)
from tiny_models import tiny_model


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("tied", [False, True])
def test_a_step_reads_every_weight_once_and_only_its_rows_of_the_input_embedding(tied):
    model = tiny_model("llama-gqa", layers=2, tie_word_embeddings=tied)
    emb = model.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()) == tied
    everything = sum(_bytes(p) for p in model.parameters()) + sum(_bytes(b) for b in model.buffers())
    row = emb.shape[1] * emb.element_size()
    if tied:  # the shared matrix is read whole, as the output head, and counted once
        assert decode_weight_bytes(model, batch=3) == everything
    else:
        assert decode_weight_bytes(model, batch=3) == everything - _bytes(emb) + 3 * row
        assert decode_weight_bytes(model, batch=1) == everything - _bytes(emb) + row


def test_the_kv_a_step_reads_is_the_kept_entries_the_linear_state_and_the_sliding_layers():
    detail = {"kept": 1000, "padding": 7, "slack": 50, "metadata": 300, "linear_state": 20, "sliding": 5}
    assert step_kv_bytes(detail) == 1025
    assert step_kv_bytes({"kept": 8}) == 8


def test_roofline_fields_put_the_bytes_at_the_bandwidth():
    f = roofline_fields(3.0, weight_bytes=1_000_000, kv_bytes_detail={"kept": 500_000, "metadata": 99}, bandwidth=1e9)
    assert f == {"roofline_bytes": 1_500_000, "bandwidth_gbs": 1.0, "roofline_ms": 1.5, "vs_roofline": 2.0}
    with pytest.raises(ValueError, match="bandwidth"):
        roofline_fields(1.0, 1, {}, 0.0)


def test_copy_bandwidth_is_positive_and_refuses_an_empty_copy():
    assert copy_bandwidth("cpu", nbytes=1 << 20, repeats=2) > 0
    with pytest.raises(ValueError):
        copy_bandwidth("cpu", nbytes=0)


@pytest.mark.skipif(not MemoryMeter.available(), reason="needs Linux's resettable high-water mark to see the copy")
def test_bench_measures_the_bandwidth_apart_where_the_peak_cannot_be_reset(monkeypatch):
    """Where the high-water mark cannot be reset per configuration (macOS, Windows), the roofline's 2 x 256 MiB copy
    in the bench's process raised every row's peak memory to at least weights + 512 MiB (the 2026-11-30 audit of
    ``slake bench``); it runs in a child process there. Linux's reset shows the difference here."""
    from slake.engines.transformers import bench

    meter = MemoryMeter("cpu")
    meter.reset()
    monkeypatch.setattr(MemoryMeter, "available", staticmethod(lambda: False))
    assert bench.device_bandwidth(torch.device("cpu")) > 0
    assert meter.peak() - meter.baseline < COPY_BYTES["cpu"] // 2  # the child's buffers are not ours
    monkeypatch.setattr(MemoryMeter, "available", staticmethod(lambda: True))
    meter.reset()
    assert bench.device_bandwidth(torch.device("cpu")) > 0  # resettable: in this process, and it shows
    assert meter.peak() - meter.baseline >= COPY_BYTES["cpu"]
