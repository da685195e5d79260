"""``slake fidelity``: how well a compressed cache approximates full attention, layer by layer.

One exact run of the model on a real prompt records, for every layer, the post-RoPE queries/keys/values of the
prompt and of ``steps`` greedy decode steps (full cache). Each (method, budget) then rebuilds its compressed cache
from the recorded prompt exactly as live compression would (cascade included), replays the decode steps
(teacher-forced: the same tokens as the full run, so errors do not compound across layers) and compares, per layer,
the attention output of

* the decode-step queries (``rel_err``), and
* the observation-window queries, the last ``window`` prompt queries (``rel_err_window``),

with full attention: ``||o_method - o_full|| / ||o_full||`` (Frobenius norm over heads and head dims, mean over
queries). This isolates the approximation of attention itself, the quantity PTAA is designed to improve (SLAKE
section 3.2). Both sides are causal: a window query sees the kept entries and, with the linear cache, the evicted
tokens at or before its own position only (a method that evicts inside the window, such as TOVA, folds later tokens
into the layer's linear state, which that query must not read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from slake.attention.linear_state import LinearState
from slake.budgets.budget import Budget
from slake.cache.compressed import CompressedKV
from slake.cache.quant import dequantize_rows, quantize_rows
from slake.engines.transformers.cache_kwarg import with_cache
from slake.methods.base import Method, canonical_method_spec, make_method
from slake.optional_plots import set_log_y


@dataclass
class Recording:
    """Per-layer prompt records ``(q, k, v, padding, scaling)``, per-step decode records ``(q, k, v)`` and, per
    compressed layer, the model facts a method may ask for (:class:`slake.methods.base.LayerContext`: rotary
    embedding, output projection), as :func:`slake.generate` provides them."""

    prompt: list[tuple]
    steps: list[list[tuple]]  # steps[t][layer] = (q, k, v)
    layer_context: list = field(default_factory=list)
    #: the model's index of each recorded layer (a hybrid model records its full-attention layers only); empty: 0..L-1
    model_layers: list[int] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.prompt)

    def model_layer(self, layer: int) -> int:
        """The model's index of recorded layer ``layer`` (Gemma 3's second compressed layer is its layer 11)."""
        return self.model_layers[layer] if self.model_layers else layer


class _Recorder(CompressedKV):
    """Full-cache compressor that records prompt and decode inputs."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(make_method("full"), 1, num_layers)
        self.prompt: list[tuple] = [None] * num_layers
        self.steps: list[list[tuple]] = []
        self._kv: dict[int, tuple] = {}

    def prefill_layer(self, layer_idx, queries, keys, values, key_padding, scaling) -> None:
        self.prompt[layer_idx] = (queries, keys, values, key_padding, scaling)
        super().prefill_layer(layer_idx, queries, keys, values, key_padding, scaling)

    def append(self, layer_idx, keys, values):
        self._kv[layer_idx] = (keys.clone(), values.clone())
        return super().append(layer_idx, keys, values)

    def decode_attention(self, layer_idx, queries, scaling):
        if layer_idx == 0:
            self.steps.append([None] * self.num_layers)
        k, v = self._kv.pop(layer_idx)
        self.steps[-1][layer_idx] = (queries.clone(), k, v)
        return super().decode_attention(layer_idx, queries, scaling)


def record(model, input_ids: torch.Tensor, steps: int) -> Recording:
    """Run the prompt and ``steps`` greedy tokens with the full cache, recording every compressed layer's inputs
    (every layer, except the sliding-window layers of a hybrid model, which are never compressed)."""
    from slake.engines.transformers.attention import prepare_model
    from slake.engines.transformers.cache import SlakeCache
    from slake.engines.transformers.layer_facts import layer_contexts

    prepare_model(model)
    cache = SlakeCache("full", 1, config=model.config)  # hybrid models: the compressed (full-attention) layers
    rec = _Recorder(len(cache.layout.compressed))
    cache.compressor = rec
    for i in cache.layout.compressed:
        cache.layers[i].compressor = rec
    with torch.inference_mode():
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            **with_cache(model, cache),
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
            cache_implementation=None,  # a checkpoint's own cache choice would conflict with the recording cache
            use_cache=True,
        )
    cache.check_routed()
    context = layer_contexts(model, cache.layout.compressed, cache.layout.layer_types)
    return Recording(
        prompt=rec.prompt, steps=rec.steps[:steps], layer_context=context, model_layers=list(cache.layout.compressed)
    )


def _full_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Exact causal attention of queries at ``qpos`` over keys at positions ``0..n-1`` (fp32)."""
    B, Hq, nq, d = q.shape
    H = k.shape[1]
    qf = q.float().reshape(B, H, Hq // H, nq, d)
    x = torch.matmul(qf, k.float().unsqueeze(2).transpose(-1, -2)) * scaling
    kpos = torch.arange(k.shape[2], device=q.device)
    x = x.masked_fill(kpos.view(1, 1, 1, 1, -1) > qpos.view(1, 1, 1, -1, 1), float("-inf"))
    return torch.matmul(torch.softmax(x, -1), v.float().unsqueeze(2)).reshape(B, Hq, nq, d)


def _window_attention(
    eng: CompressedKV,
    layer: int,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_padding: torch.Tensor | None,
    positions: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of prompt ``queries`` at ``positions`` over the compressed layer, causal in the linear term too.

    :meth:`CompressedKV.attention` masks the kept entries after each query's position, but the layer's PTAA linear
    state sums every evicted prompt token. Where a method evicted tokens after a query's position, that query's
    state here leaves them out (``[k, 1]^T [v, 1]`` of each such token subtracted, in the form the cache folded it:
    8-bit storage folds the stored rows), so it reads the evicted tokens full attention would see. Returns
    ``(B, Hq, n_q, d)`` float32.
    """
    out = eng.attention(layer, queries, positions, scaling)
    store = eng.layers[layer]
    lin = store.linear
    if lin is None or positions.numel() == 0:
        return out
    B, H, S, d = keys.shape
    first = int(positions.min())
    # the tokens after the first query: kept or not (a prompt slot's position is its index in the recorded prompt)
    kept = torch.zeros(B, H, S + 1, dtype=torch.bool, device=keys.device)
    in_prompt = store.valid & (store.positions >= 0) & (store.positions < S)
    kept.scatter_(-1, torch.where(in_prompt, store.positions, S), True)
    later = ~kept[..., first + 1 : S]
    if key_padding is not None:  # padding is never kept and never folded
        later &= ~key_padding[:, None, first + 1 : S].to(later.device)
    if not bool(later.any()):
        return out
    k, v = keys[:, :, first + 1 :], values[:, :, first + 1 :]
    if store.kv_dtype is not None:
        k, v = dequantize_rows(*quantize_rows(k, store.kv_dtype)), dequantize_rows(*quantize_rows(v, store.kv_dtype))
    ones = torch.ones(*k.shape[:-1], 1, dtype=lin.aug.dtype, device=k.device)
    kp = torch.cat([k.to(lin.aug.dtype), ones], -1)
    vp = torch.cat([v.to(lin.aug.dtype), ones], -1)
    kpos = torch.arange(first + 1, S, device=keys.device)
    out = out.clone()
    try:
        for i, p in enumerate(positions.tolist()):
            future = later & (kpos > p)
            if not bool(future.any()):
                continue
            fp = kp * future[..., None].to(kp.dtype)
            left = lin.aug - fp.transpose(-1, -2) @ vp
            # a head whose every folded token is after p holds n_e = 0 exactly but a rounding residue in k_sum,
            # v_sum and L (summed in another order than the fold's), which PTAA read as mu = residue / 0 = +-inf
            left.masked_fill_(left[..., d:, d:] < 0.5, 0.0)
            store.linear = LinearState(left)
            out[:, :, i : i + 1] = eng.attention(layer, queries[:, :, i : i + 1], positions[i : i + 1], scaling)
    finally:
        store.linear = lin
    return out


def _rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over queries of ``||approx - exact|| / ||exact||`` (norm over heads and head dims)."""
    a = approx.float().transpose(1, 2).flatten(2)  # (B, nq, Hq*d)
    e = exact.float().transpose(1, 2).flatten(2)
    return float(((a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-12)).mean())


def resolve_setting(
    method: str,
    budget: int | float | str,
    profile_model: Any = None,
    linear_cache: bool | None = None,
    **hyperparameters: Any,
) -> tuple[Method, dict | None]:
    """The method that one setting of ``slake fidelity`` measures, and the profile entry applied to it.

    The model's profile (:func:`slake.methods.profiles.resolve_method`) is resolved for the method as given (its spec
    and ``hyperparameters``); only then does ``linear_cache`` (``--linear-cache on|off|both``) switch PTAA on or off.
    Both sides of ``--linear-cache both`` thus run the same values of everything else, as an ablation must: a profile
    entry calibrated with the linear cache does not apply to a spec that turns it off (docs/profiles.md), and
    resolving the switched spec gave the two sides different VABS exponents (or CAKE temperatures) wherever a profile
    covered one side only.

    Returns
    -------
    (Method, dict | None)
        The method, and ``{"source", "values", "budget"}`` of the profile entry applied (None when none was).

    Raises
    ------
    ValueError
        As :func:`slake.methods.make_method`: an unknown hyperparameter or a value the method refuses.
    """
    from slake.methods.profiles import resolve_method

    built, profile = resolve_method(method, budget, profile_model, **hyperparameters)
    if linear_cache is not None:
        built, _ = resolve_method(built, budget, None, linear_cache=linear_cache)
    return built, profile


def measure(
    recording: Recording,
    method: str,
    budget: int | float | str,
    window: int = 32,
    linear_cache: bool | None = None,
    kv_dtype: str | None = None,
    profile_model=None,
    **hyperparameters,
) -> list[dict]:
    """Per-layer relative errors of one (method, budget) against full attention.

    Returns rows ``{"method", "budget", "layer", "rel_err", "rel_err_window", "linear_cache", "profile"}``, ``layer``
    the model's index of the layer (a hybrid model's rows are its full-attention layers).
    ``method`` is the canonical spec of the variant (``slake[vabs=false]``, :mod:`slake.methods.spec`) without
    ``linear_cache``, which has its own column. ``kv_dtype`` (``"int8"``, ``"fp8_e4m3"``) stores the kept entries in
    8 bits; the label then ends in ``@int8`` / ``@fp8_e4m3``. ``profile_model`` (the model or its config) applies the
    model's hyperparameter profile (:mod:`slake.methods.profiles`) to what the spec leaves unset, and ``profile`` is
    the entry applied (None when none was); ``linear_cache`` switches PTAA on or off after that
    (:func:`resolve_setting`). ``rel_err`` is the mean over the recording's decode steps: NaN when it has none.
    """
    m, profile = resolve_setting(method, budget, profile_model, linear_cache, **hyperparameters)
    label = canonical_method_spec(method, drop=("linear_cache",)) if isinstance(method, str) else m.name
    L = recording.num_layers
    eng = CompressedKV(m, Budget(budget), L, kv_dtype=kv_dtype)
    if recording.layer_context:  # the layer facts methods such as Expected Attention need (its rotary embedding)
        eng.layer_context = list(recording.layer_context)
    if eng.kv_dtype is not None:
        label = f"{label}@{eng.kv_dtype}"
    S = recording.prompt[0][1].shape[2]
    win_pos = torch.arange(max(S - window, 0), S)
    window_err = []
    for layer, (q, k, v, pad, scaling) in enumerate(recording.prompt):
        eng.prefill_layer(layer, q, k, v, pad, scaling)
    full_k = [rec[1] for rec in recording.prompt]
    full_v = [rec[2] for rec in recording.prompt]
    for layer, (q, k, v, pad, scaling) in enumerate(recording.prompt):
        qw = q[:, :, win_pos]
        window_err.append(
            _rel_err(
                _window_attention(eng, layer, qw, k, v, pad, win_pos, scaling),
                _full_attention(qw, k, v, win_pos, scaling),
            )
        )
    decode_err = [[] for _ in range(L)]
    for t, step in enumerate(recording.steps):
        pos = torch.tensor([S + t])
        for layer, (q, k, v) in enumerate(step):
            scaling = recording.prompt[layer][4]
            eng.append(layer, k, v)
            approx = eng.decode_attention(layer, q, scaling)
            full_k[layer] = torch.cat([full_k[layer], k], 2)
            full_v[layer] = torch.cat([full_v[layer], v], 2)
            exact = _full_attention(q, full_k[layer], full_v[layer], pos, scaling)
            decode_err[layer].append(_rel_err(approx, exact))
    return [
        {
            "method": label,
            "budget": Budget(budget).value,
            "layer": recording.model_layer(layer),  # the model's numbering: a hybrid model's full-attention layers
            "linear_cache": m.linear_cache,
            "profile": profile,
            # NaN, not 0 (a perfect score), for a recording without decode steps: nothing was measured
            "rel_err": sum(decode_err[layer]) / len(decode_err[layer]) if decode_err[layer] else math.nan,
            "rel_err_window": window_err[layer],
        }
        for layer in range(L)
    ]


def summary_table(rows: list[dict]) -> str:
    """Markdown table: one line per (method, linear cache, budget) with the mean over layers and the worst layer."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["linear_cache"], r["budget"]), []).append(r)
    lines = [
        "| method | linear cache | budget | decode rel. err (mean over layers) | worst layer | "
        "window rel. err (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for (method, lin, budget), rs in groups.items():
        mean = sum(r["rel_err"] for r in rs) / len(rs)
        worst = max(rs, key=lambda r: r["rel_err"])
        win = sum(r["rel_err_window"] for r in rs) / len(rs)
        lines.append(
            f"| {method} | {'yes' if lin else 'no'} | {budget} | {mean:.4f} | "
            f"{worst['layer']} ({worst['rel_err']:.4f}) | {win:.4f} |"
        )
    return "\n".join(lines)


def per_layer_table(rows: list[dict]) -> str:
    """Markdown table of decode relative error per layer (columns = (method, budget))."""
    keys = sorted(
        {(r["method"], r["linear_cache"], r["budget"]) for r in rows}, key=lambda k: (k[0], bool(k[1]), float(k[2]))
    )
    layers = sorted({r["layer"] for r in rows})
    look = {(r["method"], r["linear_cache"], r["budget"], r["layer"]): r["rel_err"] for r in rows}
    head = "| layer | " + " | ".join(f"{m}{'+lin' if lin else ''}@{b}" for m, lin, b in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 1)]
    for layer in layers:
        lines.append(f"| {layer} | " + " | ".join(f"{look[(*k, layer)]:.4f}" for k in keys) + " |")
    return "\n".join(lines)


def plot_per_layer(rows: list[dict], path: str) -> None:
    """Line plot of decode relative error per layer, one line per (method, linear cache, budget), labelled as
    :func:`per_layer_table` heads its columns (``+ linear cache`` wherever it is on); saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = sorted(
        {(r["method"], r["linear_cache"], r["budget"]) for r in rows}, key=lambda k: (k[0], bool(k[1]), float(k[2]))
    )
    for m, lin, b in keys:
        rs = sorted(
            (r for r in rows if (r["method"], r["linear_cache"], r["budget"]) == (m, lin, b)), key=lambda r: r["layer"]
        )
        ax.plot(
            [r["layer"] for r in rs],
            [r["rel_err"] for r in rs],
            marker="o",
            markersize=3,
            label=f"{m}{' + linear cache' if lin else ''} @ {b}",  # slake's two settings apart too
        )
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of attention output")
    set_log_y(ax, [float(r["rel_err"]) for r in rows])  # an error of 0 (nothing evicted) is drawn at 0
    ax.set_title("Attention fidelity vs full cache (decode-step queries)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
