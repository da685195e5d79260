"""Our side of the reference comparison (issue 22): which slake configuration is compared with which reference
output, how our kept sets are computed on the shared tensors, and the agreement metrics.

Used by ``tests/test_reference_fixtures.py`` (against the committed fixtures) and by
``tools/reference/compare.py`` (which regenerates them). Imports only stable names of slake.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method
from slake.methods.base import LayerContext, PrefillInputs
from slake.methods.kvzip import reconstruction_attention
from slake.methods.rotary import Rotary

FIXTURES = Path(__file__).parent / "fixtures" / "reference"

#: reference output key -> (our method spec, how our per-layer selectable budget is set)
#:   "uniform": the configured budget minus our protected tokens;
#:   "ref": the reference's own per-layer count (kept-set agreement of the scoring alone; the layer budgets are
#:          compared separately);
#:   "ref_heads": the reference's own per-head counts (scoring alone, for methods with adaptive head budgets).
#: A key ``<ref>#<variant>`` compares another configuration with the same reference output ``<ref>``.
PAIRS: dict[str, tuple[str, str]] = {
    "kvpress.snapkv": ("snapkv[window={w},kernel=5,pooling=avg]", "uniform"),
    "kvpress.streamingllm": ("streamingllm[sinks=4]", "uniform"),
    "kvpress.tova": ("tova", "uniform"),
    "kvpress.observed": ("h2o[window=0]", "uniform"),
    "kvpress.pyramidkv": ("pyramidkv[window={w},kernel=5]", "ref"),
    "kvpress.adakv_snapkv": ("ada-snapkv[window={w},kernel=5,pooling=avg]", "uniform"),
    "kvcf.snapkv": ("snapkv[window={w},kernel=5,pooling=avg]", "uniform"),
    "kvcf.snapkv_max7": ("snapkv[window={w},kernel=7,pooling=max,group_first=true]", "uniform"),
    "kvcf.pyramidkv": ("pyramidkv[window={w},kernel=5,exact=false]", "ref"),
    "kvcf.h2o": ("h2o[window={w}]", "uniform"),
    "kvcf.streamingllm": ("streamingllm[sinks=4]", "uniform"),
    "kvcf.snapkv_max7#pool_first": ("snapkv[window={w},kernel=7,pooling=max,group_first=false]", "uniform"),
    "kvcf.adakv": ("ada-snapkv[window={w}]", "uniform"),
    "kvcf.adakv#scoring": ("ada-snapkv[window={w}]", "ref_heads"),
    "kvcf.adakv#reference": ("ada-snapkv[window={w},safeguard=reference]", "uniform"),
    "kvcf.adakv_norm": ("ada-snapkv[window={w}]", "uniform"),
    "adakv.adakv_gqamean": ("ada-snapkv[window={w}]", "uniform"),
    "adakv.adakv_gqamean#scoring": ("ada-snapkv[window={w}]", "ref_heads"),
    "adakv.adakv_gqamean#reference": ("ada-snapkv[window={w},safeguard=reference]", "uniform"),
    "adakv.adakv_gqamax": ("ada-snapkv[window={w},safeguard=reference]", "uniform"),
    "cake": ("cake[window={w}]", "ref"),
    "lava": ("lava[window={w},value_norm=candidates,floor_mode=reference]", "ref"),
    "lava#default": ("lava[window={w}]", "ref"),
    "lava#value_norm_candidates": ("lava[window={w},value_norm=candidates]", "ref"),
    "lava#floor_reference": ("lava[window={w},floor_mode=reference]", "ref"),
    # issue 34: the 2025 presses, as kvpress's registry configures them
    "kvpress.keydiff": ("keydiff", "uniform"),
    "kvpress.expected_attention_plain": ("expected-attention", "uniform"),
    "kvpress.expected_attention": ("ada-expected-attention", "uniform"),
    "kvpress.expected_attention#scoring": ("ada-expected-attention", "ref_heads"),
    "kvpress.critical_snapkv": ("criticalkv[window={w},kernel=5,pooling=avg]", "uniform"),
    "kvpress.critical_adakv_snapkv": ("ada-criticalkv[window={w},kernel=5,pooling=avg,group_first=false]", "uniform"),
    "kvpress.critical_expected_attention": ("criticalkv[scorer=expected-attention,window=0,sinks=4]", "uniform"),
    "kvzip": ("kvzip", "ref"),
    "kvzip#scoring": ("kvzip", "ref_heads"),
}

#: pairs whose method needs the model's layer facts (rotary embedding, output projection) from the case
NEEDS_LAYER = ("expected", "critical")

#: single-layer cases are scored as layer 3 of 8 by pyramid schedules (see tools/reference/reference_side.py)
PYRAMID_SINGLE = (3, 8)


def ref_key(key: str) -> str:
    """The reference output a pair key compares with."""
    return key.split("#")[0]


def pairs_for(ref: str) -> list[str]:
    return [k for k in PAIRS if ref_key(k) == ref]


def spec_for(key: str, window: int) -> str:
    return PAIRS[key][0].format(w=window)


def ours_keep(
    spec: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    selectable,
    budget: int,
    layer_idx: int = 0,
    num_layers: int = 1,
    layer=None,
    pass_scores: torch.Tensor | None = None,
):
    """Our kept set of one layer, the way the engine selects it (``PrefillCompressor.evict_to``): the method's scores,
    protected slots (sinks, window) at ``+inf``, the method's head split of ``selectable`` tokens per head on
    average (an int, or a per-head list that overrides the split), then a stable descending sort per head.

    ``layer``: the :class:`~slake.methods.base.LayerContext` (rotary embedding, output projection) for methods that
    need one; ``pass_scores``: a second pass's ``(L, 1, Hkv, S)`` scores (KVzip).

    Returns ``(mask (Hkv, S) bool, per-head selectable counts (Hkv,) int64, preference or None, scores (Hkv, S)
    with protected slots at +inf)``.
    """
    method = make_method(spec)
    B, Hkv, S, _ = k.shape
    inputs = PrefillInputs(
        queries=q,
        keys=k,
        values=v,
        key_padding=torch.zeros(B, S, dtype=torch.bool),
        scaling=scaling,
        window=method.window,
        layer_idx=layer_idx,
        num_layers=num_layers,
        budget=torch.tensor([budget]),
        layer=layer,
        pass_scores=pass_scores,
    )
    res = method.prefill_scores(inputs)
    s = res.scores.float().clone()
    if method.sinks:
        s[..., : method.sinks] = float("inf")
    recent = method.protected - method.sinks
    if recent > 0:
        s[..., S - recent :] = float("inf")
    protected = torch.isposinf(s).sum(-1)[0]
    if isinstance(selectable, (list, tuple)) or torch.is_tensor(selectable) and selectable.dim() > 0:
        counts = torch.as_tensor(selectable, dtype=torch.int64).view(1, -1)
    else:
        counts = method.head_budgets(s, torch.tensor([int(selectable)]), budget=torch.tensor([budget]), final=True)
    counts = torch.minimum(counts.clamp_min(0), S - protected.view(1, -1))[0]
    order = torch.sort(s[0], dim=-1, descending=True, stable=True).indices
    mask = torch.zeros(Hkv, S, dtype=torch.bool)
    for h in range(Hkv):
        mask[h, order[h, : int(protected[h] + counts[h])]] = True
    return mask, counts, (None if res.preference is None else float(res.preference[0])), s[0]


def layer_context(inv_freq, rope_scaling: float, o_proj=None) -> LayerContext:
    """The :class:`LayerContext` of a captured layer: its RoPE frequencies and scaling, and ``W_o`` when recorded."""
    out = None if o_proj is None else torch.as_tensor(np.asarray(o_proj, dtype=np.float32))
    return LayerContext(
        rotary=Rotary(torch.as_tensor(np.asarray(inv_freq, dtype=np.float32)), rope_scaling), out_proj=out
    )


def kvzip_pass_scores(keys: torch.Tensor, chunks: list[dict], scaling: float) -> torch.Tensor:
    """Our KVzip scores ``(L, 1, Hkv, S)`` of a recorded reconstruction pass: :func:`reconstruction_attention` on
    every (chunk, layer); the template prefix past the sinks keeps 0 (kvpress's and our default)."""
    L, H, S, _ = keys.shape
    out = torch.zeros(L, 1, H, S)
    for ch in chunks:
        s, e = int(ch["start"]), int(ch["end"])
        for layer in range(L):
            q, k = ch["queries"][layer : layer + 1], ch["keys"][layer : layer + 1]
            out[layer, :, :, s:e] = reconstruction_attention(q, k, int(ch["sink"]), s, e, scaling)
    return out


def ours_kvzip(spec: str, keys: torch.Tensor, values: torch.Tensor, pass_scores: torch.Tensor, budget: int, hq: int):
    """Our whole-model KVzip on a recorded pass, through the compressor itself (its cascade and head split): the
    kept masks ``(L, Hkv, S)`` and the per-layer kept counts (protected included)."""
    L, H, S, d = keys.shape
    eng = CompressedKV(make_method(spec), budget, num_layers=L)
    eng.pass_scores = pass_scores
    for layer in range(L):
        k, v = keys[layer : layer + 1], values[layer : layer + 1]
        eng.prefill_layer(layer, torch.zeros(1, hq, S, d), k, v, None, d**-0.5)
    kept = torch.zeros(L, H, S, dtype=torch.bool)
    for layer, store in enumerate(eng.layers):
        for h in range(H):
            kept[layer, h, store.positions[0, h][store.valid[0, h]]] = True
    return kept, [int(x) for x in kept.sum((1, 2))]


def set_metrics(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Agreement of two ``(..., H, S)`` kept masks: mean Jaccard over heads, share of heads whose sets are equal,
    and the differing entries as a fraction of the reference's kept entries (``|A xor B| / 2 / |B|``)."""
    a, b = ours.reshape(-1, ours.shape[-1]), ref.reshape(-1, ref.shape[-1])
    inter = (a & b).sum(-1).double()
    union = (a | b).sum(-1).double().clamp_min(1)
    return {
        "jaccard": float((inter / union).mean()),
        "equal_heads": float((a == b).all(-1).double().mean()),
        "diff_frac": float((a ^ b).sum() / 2 / b.sum().clamp_min(1)),
    }


def diff_beyond_ties(ours: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor) -> float:
    """Differing entries whose score (ours) is not tied with the lowest kept selectable score of their head, as a
    fraction of the reference's kept entries: what remains once ties (max pooling makes plateaus of equal scores,
    broken by index in one code and by ``topk``'s order in the other) are forgiven."""
    n = 0
    for h in range(ours.shape[0]):
        kept = scores[h][ours[h] & torch.isfinite(scores[h])]
        if kept.numel() == 0:
            n += int((ours[h] ^ ref[h]).sum())
            continue
        edge = kept.min()
        diff = ours[h] ^ ref[h]
        tied = (scores[h] - edge).abs() <= 1e-6 * edge.abs().clamp_min(1e-30)
        n += int((diff & ~tied).sum())
    return n / 2 / max(int(ref.sum()), 1)


def next_query_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, mask: torch.Tensor
) -> torch.Tensor:
    """Attention output ``(Hq, d)`` of the last prompt query (the query nearest to the next one) over a kept set."""
    Hq, Hkv = q.shape[1], k.shape[1]
    g = Hq // Hkv
    x = torch.einsum("hd,hsd->hs", q[0, :, -1].double(), k[0].double().repeat_interleave(g, 0)) * scaling
    x = x.masked_fill(~mask.repeat_interleave(g, 0), float("-inf"))
    return torch.einsum("hs,hsd->hd", torch.softmax(x, -1), v[0].double().repeat_interleave(g, 0))


def output_diff(q, k, v, scaling, ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``||o(ours) - o(ref)|| / ||o(full)||`` for the last prompt query."""
    full = next_query_output(q, k, v, scaling, torch.ones_like(ours))
    d = next_query_output(q, k, v, scaling, ours) - next_query_output(q, k, v, scaling, ref)
    return float(d.norm() / full.norm().clamp_min(1e-30))


# ------------------------------------------------------------------ fixtures I/O
def pack(mask: torch.Tensor) -> np.ndarray:
    return np.packbits(mask.numpy().astype(np.uint8), axis=-1)


def unpack(bits: np.ndarray, S: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(bits, axis=-1)[..., :S].astype(bool))


def load_fixture(name: str) -> tuple[dict, dict]:
    """``(arrays, meta)`` of one committed fixture case (``<name>.npz`` + ``<name>.json``)."""
    arrays = dict(np.load(FIXTURES / f"{name}.npz"))
    meta = json.loads((FIXTURES / f"{name}.json").read_text())
    return arrays, meta


def tensors(arrays: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.from_numpy(arrays[n].astype(np.float32)) for n in ("queries", "keys", "values"))


def is_close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
