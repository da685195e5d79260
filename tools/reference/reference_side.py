"""Run the authors' / peers' reference code on the captured tensors (runs in the *reference* environment).

This script imports no slake code. It needs torch, and for each reference the location the user gives:

* kvpress from PyPI (``import kvpress``, pinned 0.5.5 in its own virtual environment),
* ``--kvcache-factory PATH``: a checkout of Zefan-Cai/KVCache-Factory (``pyramidkv/pyramidkv_utils.py``),
* ``--adakv PATH``: a checkout of FFY0/AdaKV (``adaptive_snapkv/monkeypatch/snapkv_utils.py``),
* ``--cake PATH``: a checkout of antgroup/cakekv (``cake/utils.py``, ``cake/cake_cache.py``,
  ``cake/model/modify_llama.py``),
* ``--lava PATH``: a checkout of MGDDestiny/Lava (``adaptive_snapkv/monkeypatch/snapkv_utils.py``).

Nothing is copied from them: their modules are loaded from those paths and their scoring / selection functions are
called on our tensors. Where a reference computes its score inline in a model forward (CAKE), the exact source lines
of that block are read from the checkout and executed on our tensors. The parts that need CUDA (FlashAttention,
the compiled varlen kernels) are never called: ``flash_attn`` is replaced by an empty stub module before import.

How kept sets are read back without re-implementing any selection: the value tensor handed to a reference carries
the token index in its channel 0 (no reference here scores with the values except LAVa, which gets the true values
and is read back through its per-head sorted indices), so the gathered values name the kept tokens.

Usage: ``VENV/bin/python tools/reference/reference_side.py --cases /tmp/slake-ref --out /tmp/slake-ref/ref.pt
[--kvcache-factory PATH] [--adakv PATH] [--cake PATH] [--lava PATH]``
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import textwrap
import traceback
import types
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def stub_cuda_only_imports() -> None:
    """``flash_attn`` (CUDA only) is imported at the top of the AdaKV / LAVa utils; their selection code never calls
    it. ``HybridCache`` was removed from transformers 5; CAKE's cache module imports it by name."""
    if "flash_attn" not in sys.modules:
        import importlib.machinery
        fa = types.ModuleType("flash_attn")
        fa.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
        fa.flash_attn_func = None
        fa.flash_attn_varlen_func = None
        sys.modules["flash_attn"] = fa
    import transformers.cache_utils as cu
    for name in ("HybridCache", "DynamicCache", "Cache"):
        if not hasattr(cu, name):
            setattr(cu, name, type(name, (), {}))


def marked(values: torch.Tensor) -> torch.Tensor:
    """Values whose channel 0 holds the token index (exact in fp32 up to 2^24)."""
    v = values.clone()
    v[..., 0] = torch.arange(v.shape[-2], dtype=v.dtype)
    return v


def mask_from_index(idx: torch.Tensor, S: int) -> torch.Tensor:
    """(H, k) float indices -> (H, S) bool mask."""
    m = torch.zeros(idx.shape[0], S, dtype=torch.bool)
    m.scatter_(1, idx.round().long(), True)
    return m


def causal_attention(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Eager causal attention probabilities (B, Hq, S, S), fp32: what ``output_attentions`` gives kvpress."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)
    x = torch.matmul(q, kk.transpose(-1, -2)) * scaling
    S = q.shape[2]
    x = x.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(x, dim=-1)


#: a single-layer case is scored as layer 3 of an 8-layer model by the pyramid schedules (one layer is a division
#: by zero in KVCache-Factory's formula)
PYRAMID_SINGLE = (3, 8)


def pyramid_position(layer_idx: int, num_layers: int) -> tuple[int, int]:
    return PYRAMID_SINGLE if num_layers == 1 else (layer_idx, num_layers)


# ====================================================================== kvpress
class KvpressRunner:
    """Calls kvpress presses' ``compress`` on our tensors with a minimal stand-in for the attention module."""

    version = None

    def __init__(self):
        import kvpress
        import kvpress.presses.expected_attention_press as ea_mod
        import kvpress.presses.kvzip_press as kvzip_mod
        import kvpress.presses.snapkv_press as snap_mod
        from importlib.metadata import version
        self.kvpress = kvpress
        self.version = version("kvpress")
        self._queries = None
        self._pre_queries = None
        # kvpress recomputes the window queries from hidden states (q_proj + RoPE); we hand it the captured
        # post-RoPE queries instead (identity RoPE below), so it scores exactly our tensors.
        snap_mod.get_prerope_query_states = lambda module, h: self._window_queries(h)
        # ExpectedAttentionPress wants the queries before RoPE (it rotates their statistics itself with the module's
        # rotary embedding): the captured post-RoPE queries rotated back with transformers' own cos/sin
        ea_mod.get_prerope_query_states = lambda module, h: self._pre_queries[:, :, -h.shape[1]:]
        # KVzipPress: the repeat input's post-RoPE queries of the layer being scored (identity RoPE in kwargs)
        kvzip_mod.get_prerope_query_states = lambda module, h: self._queries
        self.kvzip_mod = kvzip_mod

    def _window_queries(self, h):
        n = h.shape[1]
        return self._queries[:, :, -n:]

    def module(self, q, k, layer_idx, num_layers, rope=None, o_proj=None):
        m = nn.Module()
        Hq, d = q.shape[1], q.shape[-1]
        hidden = o_proj.shape[0] if o_proj is not None else Hq * d
        m.config = SimpleNamespace(num_attention_heads=Hq, num_key_value_heads=k.shape[1], head_dim=d,
                                   hidden_size=hidden, num_hidden_layers=num_layers, _attn_implementation="sdpa")
        m.head_dim = d
        m.layer_idx = layer_idx
        m.num_key_value_groups = Hq // k.shape[1]
        if rope is not None:
            m.rotary_emb = rope
        if o_proj is not None:
            m.o_proj = nn.Linear(Hq * d, hidden, bias=False)
            m.o_proj.weight.data = o_proj.float().clone()
        return m

    def run(self, press, q, k, v, layer_idx, num_layers, attentions=None, rope=None, o_proj=None,
            read="values"):
        """Kept mask ``(Hkv, S)`` of ``press`` on one layer. ``read="values"``: the press's own ``compress`` on values
        marked with their index (presses that do not score with the values); ``"scores"``: the press's ``score``
        then ``ScorerPress.compress``'s own selection (``compute_n_kept``, ``topk``), for presses that read the
        values (Expected Attention's value norms, CriticalKV's ``W_o v``); AdaKV-style presses (masked indices)
        get the true values."""
        from kvpress.utils import compute_n_kept
        B, Hq, S, d = q.shape
        self._queries = q
        if rope is not None:
            cos, sin = rope(q, torch.arange(S).view(1, -1))
            self._pre_queries = rope_back(q, cos, sin, getattr(rope, "attention_scaling", 1.0))
        mod = self.module(q, k, layer_idx, num_layers, rope, o_proj)
        hidden = torch.zeros(B, S, Hq * d)
        kwargs = {"position_embeddings": (torch.ones(B, S, d), torch.zeros(B, S, d))}
        if read == "scores":
            scores = press.score(mod, hidden, k, v, attentions, kwargs)
            idx = scores.topk(compute_n_kept(S, press.compression_ratio), dim=-1).indices
            return mask_from_index(idx[0].float(), S)
        keys, values = press.compress(mod, hidden, k, marked(v) if read == "values" else v, attentions, kwargs)
        if hasattr(mod, "masked_key_indices"):  # AdaKVPress: full-length cache + masked indices
            b, h, s = mod.masked_key_indices
            keep = torch.ones(k.shape[1], S, dtype=torch.bool)
            keep[h, s] = False
            return keep
        return mask_from_index(values[0, :, :, 0], S)


def rope_back(q, cos, sin, scaling):
    """Queries before RoPE from post-RoPE ones, with transformers' ``(cos, sin)`` (which carry the scaling)."""
    from transformers.models.llama.modeling_llama import rotate_half
    c, s = cos[:, None].float(), sin[:, None].float()
    return (q * c - rotate_half(q) * s) / (scaling * scaling)


def rotary_module(inv_freq: torch.Tensor, scaling: float, d: int):
    """transformers' own ``LlamaRotaryEmbedding`` (what a model's ``rotary_emb`` is) with the case's frequencies."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d))
    rope.inv_freq = inv_freq.float().clone()
    rope.original_inv_freq = inv_freq.float().clone()
    rope.attention_scaling = scaling
    return rope


def kvpress_cases(R: KvpressRunner, q, k, v, scaling, b, w, layer_idx, num_layers):
    from kvpress import (AdaKVPress, ObservedAttentionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress,
                         TOVAPress)
    S = q.shape[2]
    ratio = 1.0 - (b + 0.5) / S  # kvpress keeps int(S * (1 - ratio)) = b tokens
    out = {}
    out["snapkv"] = R.run(SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=5), q, k, v, layer_idx,
                          num_layers)
    out["streamingllm"] = R.run(StreamingLLMPress(compression_ratio=ratio, n_sink=4), q, k, v, layer_idx,
                                num_layers)
    out["tova"] = R.run(TOVAPress(compression_ratio=ratio), q, k, v, layer_idx, num_layers)
    out["observed"] = R.run(ObservedAttentionPress(compression_ratio=ratio), q, k, v, layer_idx, num_layers,
                            attentions=causal_attention(q, k, scaling))
    pl, pL = pyramid_position(layer_idx, num_layers)
    out["pyramidkv"] = R.run(PyramidKVPress(compression_ratio=ratio, window_size=w, kernel_size=5), q, k, v, pl, pL)
    out["adakv_snapkv"] = R.run(AdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=5),
                                           alpha_safeguard=0.2), q, k, v, layer_idx, num_layers)
    return out


def kvpress_leader_cases(R: KvpressRunner, q, k, v, b, w, layer_idx, num_layers, rope, o_proj):
    """The 2025 presses of issue 34, as kvpress's registry configures them (``evaluation/evaluate_registry.py``),
    SnapKV-based ones with our window and kernel 5 as above."""
    from kvpress import (AdaKVPress, CriticalAdaKVPress, CriticalKVPress, ExpectedAttentionPress, KeyDiffPress,
                         SnapKVPress)
    S = q.shape[2]
    ratio = 1.0 - (b + 0.5) / S
    out = {}
    out["keydiff"] = R.run(KeyDiffPress(compression_ratio=ratio), q, k, v, layer_idx, num_layers)
    out["expected_attention_plain"] = R.run(ExpectedAttentionPress(compression_ratio=ratio), q, k, v, layer_idx,
                                            num_layers, rope=rope, read="scores")
    out["expected_attention"] = R.run(AdaKVPress(ExpectedAttentionPress(compression_ratio=ratio, epsilon=1e-2)), q, k,
                                      v, layer_idx, num_layers, rope=rope, read="true values")
    if o_proj is not None:
        snap = SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=5)
        out["critical_snapkv"] = R.run(CriticalKVPress(snap), q, k, v, layer_idx, num_layers, o_proj=o_proj,
                                       read="scores")
        out["critical_adakv_snapkv"] = R.run(
            CriticalAdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=5)), q, k, v,
            layer_idx, num_layers, o_proj=o_proj, read="true values")
        out["critical_expected_attention"] = R.run(
            CriticalKVPress(ExpectedAttentionPress(compression_ratio=ratio, use_vnorm=False)), q, k, v, layer_idx,
            num_layers, rope=rope, o_proj=o_proj, read="scores")
    return out


def kvzip_model(R: KvpressRunner, case: dict, b: int):
    """Whole-model KVzip in kvpress: ``KVzipPress.score_kvzip`` on every (chunk, layer) of the recorded reconstruction
    pass (queries handed over through the patched ``get_prerope_query_states``, identity RoPE), then
    ``compress_post``'s global selection over a stand-in of the model's layers; read back from the masked indices."""
    from kvpress import KVzipPress
    K = case["keys"]
    L, Hkv, S, d = K.shape
    Hq = case["queries"].shape[1]
    kz = case["kvzip"]
    numel = L * Hkv * S
    press = KVzipPress(compression_ratio=(L * Hkv * (S - b) + 0.5) / numel, chunk_size=kz["chunk_size"])
    press.context_length, press.prefix_length = S, kz["prefix"]
    press.score_val = torch.zeros(L, 1, Hkv, S)
    modules = [R.module(case["queries"][l:l + 1], K[l:l + 1], l, L) for l in range(L)]
    for ch in kz["chunks"]:
        press.start_idx, press.end_idx = ch["start"], ch["end"]
        n = ch["queries"].shape[2]
        kwargs = {"position_embeddings": (torch.ones(1, n, d), torch.zeros(1, n, d))}
        for l in range(L):
            R._queries = ch["queries"][l:l + 1]
            keys = ch["keys"][l:l + 1]
            press.score_kvzip(modules[l], torch.zeros(1, n, Hq * d), keys, torch.zeros_like(keys), None, kwargs)
    press.compress_post(SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=m) for m in modules])))
    kept = []
    for m in modules:
        keep = torch.ones(Hkv, S, dtype=torch.bool)
        _, h, s = m.masked_key_indices
        keep[h, s] = False
        kept.append(keep)
    return {"kept": kept, "layer_budgets": [int(x.sum()) for x in kept], "scores": press.score_val[:, 0].clone()}


# ====================================================================== KVCache-Factory
def kvcf_cases(mod, q, k, v, b, w, layer_idx, num_layers):
    g = q.shape[1] // k.shape[1]
    S = q.shape[2]
    out = {}

    def read(kv):
        return mask_from_index(kv[1][0, :, :, 0], S)

    out["snapkv"] = read(mod.SnapKVCluster(window_size=w, max_capacity_prompt=b, kernel_size=5, pooling="avgpool")
                         .update_kv(k, q, marked(v), None, g))
    out["snapkv_max7"] = read(mod.SnapKVCluster(window_size=w, max_capacity_prompt=b, kernel_size=7,
                                                pooling="maxpool").update_kv(k, q, marked(v), None, g))
    pl, pL = pyramid_position(layer_idx, num_layers)
    out["pyramidkv"] = read(mod.PyramidKVCluster(num_hidden_layers=pL, window_size=w, max_capacity_prompt=b,
                                                 kernel_size=5, pooling="avgpool", beta=20, layer_idx=pl)
                            .update_kv(k, q, marked(v), None, g))
    out["h2o"] = read(mod.H2OKVCluster(window_size=w, max_capacity_prompt=b).update_kv(k, q, marked(v), None, g))
    out["streamingllm"] = read(mod.StreamingLLMKVCluster(window_size=w, max_capacity_prompt=b)
                               .update_kv(k, q, marked(v), None, g))
    for norm in (True, False):
        c = mod.AdaKVCluster(window_size=w, kernel_size=7, pooling="maxpool", max_capacity_prompt=b, floor=0.2,
                             normalize=norm, layer_idx=layer_idx, num_hidden_layers=num_layers)
        _, vals = c.update_kv(k, q, marked(v))
        out[f"adakv{'_norm' if norm else ''}"] = _split_heads(vals, c.head_lens, S)
    return out


def _split_heads(flat_values: torch.Tensor, head_lens: torch.Tensor, S: int) -> torch.Tensor:
    rows = torch.split(flat_values[:, 0], [int(x) for x in head_lens])
    m = torch.zeros(len(rows), S, dtype=torch.bool)
    for h, r in enumerate(rows):
        m[h, r.round().long()] = True
    return m


# ====================================================================== AdaKV (official)
def adakv_cases(mod, q, k, v, b, w, layer_idx, num_layers):
    g = q.shape[1] // k.shape[1]
    S = q.shape[2]
    out = {}
    for func in ("mean", "max"):
        c = mod.AdaptiveSnapKVCluster(window_size=w, kernel_size=7, pooling="maxpool", base_capacity=b,
                                      floor_alpha=0.2, skip=0, normalize=False, layer_idx=layer_idx,
                                      num_hidden_layers=num_layers, gqa_support=g > 1, num_key_value_groups=g,
                                      gqa_func=func)
        _, vals = c.update_kv(k, q, marked(v))
        out[f"adakv_gqa{func}"] = _split_heads(vals, c.head_lens, S)
        if g == 1:
            break
    return out


# ====================================================================== CAKE (official)
def cake_block(cake_dir: Path) -> str:
    """The prefill scoring block of CAKE's attention forward, read from the checkout (not copied)."""
    lines = (cake_dir / "cake" / "model" / "modify_llama.py").read_text().splitlines()
    start = next(i for i, l in enumerate(lines) if "if self.config.prefill[self.layer_idx]:" in l)
    stop = next(i for i in range(start, len(lines)) if "past_key_value.update_score(pref_score, hh_score)" in lines[i])
    return textwrap.dedent("\n".join(lines[start + 1:stop + 1]))


def cake_layer(block: str, utils, q, k, w, gamma, tau1=1.0, tau2=1.0):
    B, Hq, S, d = q.shape
    Hkv = k.shape[1]
    rec = {}
    cfg = SimpleNamespace(window_size=[w], tau1=tau1, tau2=tau2, gamma=gamma)
    fake_self = SimpleNamespace(config=cfg, layer_idx=0, head_dim=d, num_key_value_heads=Hkv,
                                num_key_value_groups=Hq // Hkv)
    pkv = SimpleNamespace(update_score=lambda p, h: rec.update(pref=float(p), hh=h))
    ns = {"torch": torch, "nn": nn, "F": F, "math": math, "calculate_entropy": utils.calculate_entropy,
          "self": fake_self, "query_states": q, "key_states": k.repeat_interleave(Hq // Hkv, dim=1), "bsz": B,
          "q_len": S, "past_key_value": pkv}
    exec(compile(block, "cakekv/cake/model/modify_llama.py", "exec"), ns)
    return rec["pref"], rec["hh"]


def cake_model(cake_dir, layers, b, w, gamma):
    """Whole-model CAKE prefill eviction: per-layer scores from the reference block, budgets and eviction by the
    reference's ``CakeprefillKVCache.__call__`` (cascading off: one allocation after the last layer, which the
    paper proves equal to the cascade)."""
    sys.path.insert(0, str(cake_dir))
    utils = load_module("cake.utils", cake_dir / "cake" / "utils.py")
    cache_mod = load_module("cake.cake_cache", cake_dir / "cake" / "cake_cache.py")
    block = cake_block(cake_dir)
    L = len(layers)
    q0, k0, v0 = layers[0]
    S = q0.shape[2]
    prefs, hh = [], []
    for q, k, v in layers:
        p, h = cake_layer(block, utils, q, k, w, gamma)
        prefs.append(p)
        hh.append(h)
    pkv = SimpleNamespace(pref_scores=list(prefs), evict_scores=list(hh), key_cache=[k for _, k, _ in layers],
                          value_cache=[marked(v) for _, _, v in layers], layer_budget=[None] * L)
    evict = cache_mod.CakeprefillKVCache(cache_size=b, window_size=w, num_heads=q0.shape[1], num_layers=L,
                                         use_cascading=False)
    pkv = evict(pkv, S)
    kept = [mask_from_index(pkv.value_cache[l][0, :, :, 0], S) for l in range(L)]
    budgets = [int(x) if x is not None else S - w for x in pkv.layer_budget]
    return {"kept": kept, "layer_budgets": budgets, "prefs": prefs, "compressed": S > b + w}


# ====================================================================== LAVa (official)
def lava_model(mod, layers, b, w, alpha):
    """Whole-model LAVa prefill: ``LavaKVCluster`` scores, head budgets and per-head selection of the reference;
    the cross-layer budget glue of its model forward (``adaptive_*_hijack_lava.py``: density-proportional
    ``int`` budgets recomputed after every layer, ``update_kv_gqa`` / ``re_update_kv_gqa``) is replayed here."""
    L = len(layers)
    q0, k0, _ = layers[0]
    g = q0.shape[1] // k0.shape[1]
    S = q0.shape[2]
    clusters, dens = [], []
    for l, (q, k, v) in enumerate(layers):
        c = mod.LavaKVCluster(window_size=w, kernel_size=7, pooling="maxpool", base_capacity=b, floor_alpha=alpha,
                              skip=0, normalize=False, layer_idx=l, num_hidden_layers=L, gqa_support=True,
                              num_key_value_groups=g)
        score, sparsity = c.calcul_attn_score(k, q, v)
        c.store(k, q, marked(v), score, sparsity)
        clusters.append(c)
        # --- glue of the reference's model forward (one block per layer) ---
        total = (b - w) * L
        dens.append(sparsity.item())
        share = [(x / sum(dens)) * total for x in dens]
        for j in range(l + 1):
            cj = clusters[j]
            cj.base_capacity = int(share[j])
            if cj.need_re:
                cj.re_update_kv_gqa()
            else:
                cj.update_kv_gqa()
    kept, heads = [], []
    for c in clusters:
        if isinstance(c.key_states, list):
            m = torch.zeros(len(c.value_states), S, dtype=torch.bool)
            for h, vals in enumerate(c.value_states):
                m[h, vals[:, 0].round().long()] = True
        else:  # not compressed
            m = torch.ones(c.key_states.shape[1], S, dtype=torch.bool)
        kept.append(m)
        heads.append((m.sum(-1) - w).tolist())
    return {"kept": kept, "layer_budgets": [c.base_capacity for c in clusters], "prefs": dens, "head_counts": heads}


# ====================================================================== driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kvcache-factory", type=Path)
    ap.add_argument("--adakv", type=Path)
    ap.add_argument("--cake", type=Path)
    ap.add_argument("--lava", type=Path)
    ap.add_argument("--no-kvpress", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    refs, versions, failures = {}, {}, {}
    if not args.no_kvpress:  # before the stubs: transformers inspects flash_attn's import spec
        try:
            refs["kvpress"] = KvpressRunner()
            versions["kvpress"] = f"kvpress {refs['kvpress'].version} (PyPI)"
        except Exception as e:  # noqa: BLE001
            failures["kvpress"] = repr(e)
    stub_cuda_only_imports()
    if args.kvcache_factory:
        refs["kvcf"] = load_module("kvcf_pyramidkv_utils", args.kvcache_factory / "pyramidkv" / "pyramidkv_utils.py")
    if args.adakv:
        refs["adakv"] = load_module("adakv_snapkv_utils",
                                    args.adakv / "adaptive_snapkv" / "monkeypatch" / "snapkv_utils.py")
    if args.lava:
        refs["lava"] = load_module("lava_snapkv_utils",
                                   args.lava / "adaptive_snapkv" / "monkeypatch" / "snapkv_utils.py")
    results = {"versions": versions, "failures": failures, "cases": {}}
    for path in sorted(args.cases.glob("*.pt")):
        if path.name == args.out.name:
            continue
        case = torch.load(path)
        Q, K, V = case["queries"], case["keys"], case["values"]
        if path.name.startswith("kvzip_"):  # KVzip's multi-layer random case: that reference only
            S = K.shape[2]
            for b in (S // 3, S // 2):
                key = f"{path.stem}/b{b}"
                print(key, flush=True)
                res = {"window": 0, "budget": b, "num_layers": K.shape[0], "layers": {}}
                if "kvpress" in refs:
                    res["kvzip"] = kvzip_model(refs["kvpress"], case, b)
                results["cases"][key] = res
            continue
        rope = o_proj = None
        if "kvpress" in refs and "inv_freq" in case:
            rope = rotary_module(case["inv_freq"], case["rope_scaling"], Q.shape[-1])
        if Q.dim() == 4 and Q.shape[0] > 1 or path.name.startswith("model_"):
            layers = [(Q[l:l + 1], K[l:l + 1], V[l:l + 1]) for l in range(Q.shape[0])]
            w, budgets = 32, (128, 256)
        else:
            layers = [(Q, K, V)]
            S = Q.shape[2]
            w, budgets = 16, (S // 3, S // 2)
        L = len(layers)
        for b in budgets:
            key = f"{path.stem}/b{b}"
            res = {"window": w, "budget": b, "num_layers": L, "layers": {}}
            print(key, flush=True)
            for l, (q, k, v) in enumerate(layers):
                per = {}
                if "kvpress" in refs:
                    per.update({f"kvpress.{n}": m for n, m in
                                kvpress_cases(refs["kvpress"], q, k, v, case["scaling"], b, w, l, L).items()})
                    if rope is not None:
                        wo = case["o_proj"][l] if "o_proj" in case else None
                        per.update({f"kvpress.{n}": m for n, m in
                                    kvpress_leader_cases(refs["kvpress"], q, k, v, b, w, l, L, rope, wo).items()})
                if "kvcf" in refs:
                    per.update({f"kvcf.{n}": m for n, m in kvcf_cases(refs["kvcf"], q, k, v, b, w, l, L).items()})
                if "adakv" in refs:
                    per.update({f"adakv.{n}": m for n, m in adakv_cases(refs["adakv"], q, k, v, b, w, l, L).items()})
                res["layers"][l] = per
            if args.cake:
                try:
                    res["cake"] = cake_model(args.cake, layers, b, w, gamma=200.0)
                except Exception:  # noqa: BLE001
                    failures[f"cake {key}"] = traceback.format_exc(limit=3)
            if "lava" in refs:
                try:
                    res["lava"] = lava_model(refs["lava"], layers, b, w, alpha=0.2)
                except Exception:  # noqa: BLE001
                    failures[f"lava {key}"] = traceback.format_exc(limit=3)
            if "kvpress" in refs and "kvzip" in case:
                try:
                    res["kvzip"] = kvzip_model(refs["kvpress"], case, b)
                except Exception:  # noqa: BLE001
                    failures[f"kvzip {key}"] = traceback.format_exc(limit=3)
            results["cases"][key] = res
    torch.save(results, args.out)
    print("failures:", failures or "none")


if __name__ == "__main__":
    main()
