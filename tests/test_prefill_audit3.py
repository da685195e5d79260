"""Prefill audit (third pass): inputs a compressor's prefill took without a word and then stored wrongly.

* An integer padding mask (``attention_mask.long()``, or a 0/1 padding mask) was read with ``~``, a bitwise not:
  every row's real length came out negative and the layer's ``valid`` mask held -1/-2, so the cache reported negative
  kept counts and compressed nothing. The mask must be bool (True = padded): anything else is refused.
* A second prefill of a layer already prefilled (a cache reused for another prompt, or a later chunk fed through
  ``prefill_layer`` instead of ``append``) replaced the layer's entries but kept the first prompt's per-sequence facts
  (real lengths, compress decisions, budgets): a row the first prompt left uncompressed kept every token of the second.
* A chunk that reaches past the prompt given to ``begin_chunked_prefill`` was refused only when it overlapped some row's
  left padding: with no padding, a prompt declared at 50 tokens and fed 200 kept all 200 (its compress decision was
  the declared length's), and a first chunk longer than the declared prompt was taken too.
* Keys and values of different lengths failed with an ``IndexError`` deep inside the scoring; they are refused with a
  message naming the shapes.
"""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV

B, HQ, HKV, D = 2, 4, 2, 8


def _qkv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, HQ, n, D, generator=g),
        torch.randn(B, HKV, n, D, generator=g),
        torch.randn(B, HKV, n, D, generator=g),
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32])
def test_a_padding_mask_that_is_not_bool_is_refused(dtype: torch.dtype) -> None:
    q, k, v = _qkv(100)
    eng = CompressedKV("snapkv[window=4]", 32, 1, kernels="torch")
    with pytest.raises(ValueError, match="bool"):
        eng.prefill_layer(0, q, k, v, torch.zeros(B, 100, dtype=dtype), D**-0.5)
    assert eng.info is None and eng.layers == [None]  # refused before anything is stored
    eng.prefill_layer(0, q, k, v, torch.zeros(B, 100, dtype=torch.bool), D**-0.5)
    assert eng.layers[0] is not None and eng.layers[0].counts().tolist() == [[32, 32], [32, 32]]


def test_a_padding_mask_of_another_shape_is_refused_with_its_shape() -> None:
    q, k, v = _qkv(100)
    eng = CompressedKV("snapkv[window=4]", 32, 1, kernels="torch")
    with pytest.raises(ValueError, match=r"\(2, 97\)"):
        eng.prefill_layer(0, q, k, v, torch.zeros(B, 97, dtype=torch.bool), D**-0.5)


def test_keys_and_values_of_other_lengths_are_refused_with_their_shapes() -> None:
    q, k, v = _qkv(100)
    eng = CompressedKV("snapkv[window=4]", 32, 1, kernels="torch")
    with pytest.raises(ValueError, match=r"values.*\(2, 2, 50, 8\)"):
        eng.prefill_layer(0, q, k, v[:, :, :50], None, D**-0.5)
    with pytest.raises(ValueError, match=r"queries.*\(2, 3, 100, 8\)"):
        eng.prefill_layer(0, q[:, :3], k, v, None, D**-0.5)  # 3 query heads over 2 KV heads
    assert eng.info is None and eng.layers == [None]


def test_a_second_prefill_of_a_layer_is_refused() -> None:
    """The second prompt's row 1 (unpadded, 100 tokens, budget 50) would have kept all 100 tokens under the first
    prompt's facts (40 real tokens: not compressed)."""
    q, k, v = _qkv(100)
    pad = torch.zeros(B, 100, dtype=torch.bool)
    pad[1, :60] = True
    eng = CompressedKV("snapkv[window=4]", 50, 2, kernels="torch")
    eng.prefill_layer(0, q, k, v, pad, D**-0.5)
    eng.prefill_layer(1, q, k, v, pad, D**-0.5)
    with pytest.raises(RuntimeError, match="layer 0 is prefilled already"):
        eng.prefill_layer(0, q, k, v, torch.zeros(B, 100, dtype=torch.bool), D**-0.5)
    assert eng.layers[0].counts().tolist() == [[50, 50], [40, 40]]  # the first prompt's cache, untouched


def test_a_later_chunk_fed_through_prefill_layer_is_refused() -> None:
    """During a chunked prefill a later chunk is appended (``append`` + ``decode_attention``); fed to
    ``prefill_layer`` it replaced the layer with that chunk alone, at positions 0 .. n - 1."""
    q, k, v = _qkv(120)
    eng = CompressedKV("snapkv[window=4]", 32, 1, kernels="torch")
    eng.begin_chunked_prefill(torch.zeros(B, 120, dtype=torch.bool))
    eng.prefill_layer(0, q[:, :, :60], k[:, :, :60], v[:, :, :60], None, D**-0.5)
    with pytest.raises(RuntimeError, match="prefilled already"):
        eng.prefill_layer(0, q[:, :, 60:], k[:, :, 60:], v[:, :, 60:], None, D**-0.5)


def test_a_chunk_past_the_declared_prompt_is_refused_without_padding() -> None:
    q, k, v = _qkv(200)
    eng = CompressedKV("snapkv[window=4]", 64, 1, kernels="torch")
    eng.begin_chunked_prefill(torch.zeros(B, 50, dtype=torch.bool))
    eng.prefill_layer(0, q[:, :, :40], k[:, :, :40], v[:, :, :40], None, D**-0.5)
    with pytest.raises(RuntimeError, match="past the 50-token prompt"):
        eng.append(0, k[:, :, 40:80], v[:, :, 40:80])
    assert eng.seen[0] == 40 and eng.layers[0].counts().tolist() == [[40, 40], [40, 40]]
    eng.append(0, k[:, :, 40:50], v[:, :, 40:50])  # the rest of the declared prompt is taken
    eng.decode_attention(0, q[:, :, 40:50], D**-0.5)
    eng.end_chunked_prefill()
    assert eng.seen[0] == 50


def test_a_first_chunk_longer_than_the_declared_prompt_is_refused() -> None:
    q, k, v = _qkv(80)
    eng = CompressedKV("snapkv[window=4]", 32, 1, kernels="torch")
    eng.begin_chunked_prefill(torch.zeros(B, 50, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="past the 50-token prompt"):
        eng.prefill_layer(0, q, k, v, None, D**-0.5)
    assert eng.info is None and eng.layers == [None]
