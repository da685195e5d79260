"""Capture the shared inputs of the reference comparison (runs in slake's own environment).

Writes one ``.pt`` file per case into ``--out`` (a scratch folder, not committed):

* ``model_<S>.pt``: post-RoPE queries / keys / values of every layer of the default model (SmolLM2-135M-Instruct,
  ``slake.load_model()``, fp32 on CPU) for one prompt of about ``S`` tokens, exactly as slake's engine receives them
  (recorded at :meth:`slake.cache.compressed.CompressedKV.prefill_layer`), rounded to fp16-representable values so
  that the committed fixtures hold the very tensors both sides saw; plus the prompt's token ids (chat template
  applied), for the end-to-end greedy comparison.
* ``random_<name>.pt``: tiny random tensors (GQA 4/2 and MHA 4/4 heads, head dim 16, several lengths), one layer.

Usage: ``PYTHONPATH=src python tools/reference/capture.py --out /tmp/slake-ref``
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

#: random cases: name -> (query heads, KV heads, head dim, lengths)
RANDOM_CASES = {"gqa": (4, 2, 16, (96, 200, 333)), "mha": (4, 4, 16, (97, 256))}
#: RoPE base of the random cases (their tensors are read as post-RoPE at positions 0..S-1) and their hidden size
RANDOM_THETA, RANDOM_HIDDEN = 10000.0, 48
#: KVzip's random multi-layer case: layers, query heads, KV heads, head dim, prompt length, template prefix, chunk
KVZIP_RANDOM = (4, 4, 2, 16, 150, 10, 64)
#: KVzip chunk size used on the default model's capture (several chunks, so the continuation prompt is exercised)
KVZIP_MODEL_CHUNK = 256


def build_prompt(n_facts: int) -> str:
    """A deterministic retrieval prompt: numbered facts, then a question about one of them (query-aware scoring)."""
    cities = ["Avalon", "Brixton", "Calder", "Dunmore", "Elgin", "Fenwick", "Garrow", "Harlow", "Ilford", "Jarrow",
              "Kelso", "Lowick", "Marden", "Norwood", "Oakham", "Penrith", "Quorn", "Redruth", "Selby", "Thirsk"]
    lines = []
    for i in range(n_facts):
        city = cities[i % len(cities)]
        code = (7919 * (i + 3)) % 10000
        lines.append(f"Note {i + 1}: the archive of {city} district {i // len(cities) + 1} keeps the access code "
                     f"{code:04d}, stored on shelf {(i * 37) % 91}.")
    target = n_facts // 3
    city = cities[target % len(cities)]
    question = (f"\nQuestion: what access code does the archive of {city} district {target // len(cities) + 1} "
                f"keep? Answer with the code only.")
    return "Read the notes below.\n" + "\n".join(lines) + question


def fp16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor holding fp16-representable values (what the fixtures store)."""
    return x.detach().to(torch.float16).to(torch.float32).contiguous()


def capture_model(n_facts: int) -> dict:
    import slake
    from slake.cache.compressed import CompressedKV
    from slake.engines.transformers import reconstruction
    from slake.engines.transformers.prefill_once import capture_prefill
    from slake.methods import make_method

    model, tokenizer = slake.load_model(device="cpu", dtype=torch.float32)
    prompt = build_prompt(n_facts)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    layers: dict[int, tuple] = {}
    original = CompressedKV.prefill_layer

    def record(self, layer_idx, queries, keys, values, key_padding, scaling):
        if layer_idx not in layers:
            layers[layer_idx] = (fp16_round(queries), fp16_round(keys), fp16_round(values), float(scaling))
        return original(self, layer_idx, queries, keys, values, key_padding, scaling)

    CompressedKV.prefill_layer = record
    try:
        slake.generate(model, tokenizer, prompt, method="full", budget=8, max_new_tokens=1)
    finally:
        CompressedKV.prefill_layer = original
    L = len(layers)
    q = torch.cat([layers[i][0] for i in range(L)])  # (L, Hq, S, d)
    k = torch.cat([layers[i][1] for i in range(L)])
    v = torch.cat([layers[i][2] for i in range(L)])
    if q.shape[2] != len(ids):
        raise RuntimeError(f"captured {q.shape[2]} tokens but the chat template gives {len(ids)}")
    rope = model.model.rotary_emb
    o_proj = torch.stack([fp16_round(layer.self_attn.o_proj.weight) for layer in model.model.layers])
    # KVzip's reconstruction pass, run by slake's engine; every scoring call's post-RoPE queries and keys recorded
    calls: list[tuple] = []
    original_score = reconstruction.reconstruction_attention

    def recording(query, key, sink, start, end, scaling):
        calls.append((fp16_round(query), fp16_round(key), sink, start, end))
        return original_score(query, key, sink, start, end, scaling)

    reconstruction.reconstruction_attention = recording
    try:
        prompt_ids = reconstruction.ReconstructionPrompt.from_tokenizer(tokenizer)
        with torch.inference_mode():
            cap = capture_prefill(model, torch.tensor([ids]), keep_queries=False)
            reconstruction.reconstruction_scores(model, cap, make_method("kvzip", chunk_size=KVZIP_MODEL_CHUNK),
                                                 prompt_ids)
    finally:
        reconstruction.reconstruction_attention = original_score
    L = len(layers)
    kvzip = {"prefix": prompt_ids.prefix_length(ids), "chunk_size": KVZIP_MODEL_CHUNK,
             "chunks": [{"start": calls[c][3], "end": calls[c][4], "sink": calls[c][2],
                         "queries": torch.cat([calls[c + i][0] for i in range(L)]),
                         "keys": torch.cat([calls[c + i][1] for i in range(L)])} for c in range(0, len(calls), L)]}
    return {"queries": q, "keys": k, "values": v, "scaling": layers[0][3], "input_ids": torch.tensor(ids),
            "inv_freq": rope.inv_freq.detach().float().clone(), "rope_scaling": float(rope.attention_scaling),
            "o_proj": o_proj, "kvzip": kvzip,
            "prompt": prompt, "source": "SmolLM2-135M-Instruct (slake.load_model(), fp32 CPU), fp16-rounded"}


def capture_random(hq: int, hkv: int, d: int, s: int, seed: int) -> dict:
    """Random post-RoPE-like tensors with some structure: a few 'heavy' keys and a sink, so scores are not flat."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, s, d, generator=g)
    k = torch.randn(1, hkv, s, d, generator=g)
    v = torch.randn(1, hkv, s, d, generator=g)
    heavy = torch.randint(0, s, (max(2, s // 20),), generator=g)
    k[:, :, heavy] *= 2.5
    k[:, :, 0] = q.reshape(1, hkv, hq // hkv, s, d).mean((2, 3)) * 3  # a sink every query likes
    o_proj = torch.randn(1, RANDOM_HIDDEN, hq * d, generator=g) / math.sqrt(hq * d)
    return {"queries": fp16_round(q), "keys": fp16_round(k), "values": fp16_round(v), "scaling": 1 / math.sqrt(d),
            "inv_freq": random_inv_freq(d), "rope_scaling": 1.0, "o_proj": fp16_round(o_proj),
            "source": f"torch.randn seed {seed}, Hq={hq}, Hkv={hkv}, d={d}, S={s}, fp16-rounded; RoPE base "
                      f"{RANDOM_THETA:g}, W_o ({RANDOM_HIDDEN}, {hq * d})"}


def random_inv_freq(d: int) -> torch.Tensor:
    return 1.0 / RANDOM_THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def capture_kvzip_random(seed: int) -> dict:
    """A multi-layer random case for KVzip (its budgets are global over layers): the prompt's keys and values, and
    for each reconstruction chunk the repeat input's post-RoPE queries and the keys it attends to (the prompt's,
    then its own: copies of the chunk's keys plus noise, so that the repeat input attends to what it repeats)."""
    L, hq, hkv, d, S, prefix, chunk = KVZIP_RANDOM
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, hkv, S, d, generator=g)
    v = torch.randn(L, hkv, S, d, generator=g)
    q = torch.randn(L, hq, S, d, generator=g)
    chunks = []
    for i, start in enumerate(range(prefix, S, chunk)):
        end = min(start + chunk, S)
        head = 8 if i == 0 else 12 + 8  # repeat prompt, or continuation prompt + the previous chunk's last 8 tokens
        n = head + 5 + (end - start)  # + template suffix + the chunk
        rep_k = torch.randn(L, hkv, n, d, generator=g)
        rep_k[:, :, n - (end - start):] += 1.5 * k[:, :, start:end]
        rep_q = torch.randn(L, hq, n, d, generator=g)
        rep_q[:, :, n - (end - start):] += 1.5 * k[:, :, start:end].repeat_interleave(hq // hkv, 1)
        chunks.append({"start": start, "end": end, "sink": min(4, start),
                       "queries": fp16_round(rep_q), "keys": fp16_round(torch.cat([k, rep_k], 2))})
    return {"queries": fp16_round(q), "keys": fp16_round(k), "values": fp16_round(v), "scaling": 1 / math.sqrt(d),
            "inv_freq": random_inv_freq(d), "rope_scaling": 1.0,
            "kvzip": {"prefix": prefix, "chunk_size": chunk, "chunks": chunks},
            "source": f"torch.randn seed {seed}, L={L}, Hq={hq}, Hkv={hkv}, d={d}, S={S}, template prefix {prefix}, "
                      f"KVzip chunks of {chunk}, fp16-rounded"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--facts", type=int, nargs="+", default=[22, 44],
                    help="prompt sizes in facts (22 ~ 0.6K tokens, 44 ~ 1.2K tokens with the default tokenizer)")
    ap.add_argument("--no-model", action="store_true", help="random tensors only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    seed = 0
    for name, (hq, hkv, d, lengths) in RANDOM_CASES.items():
        for s in lengths:
            seed += 1
            torch.save(capture_random(hq, hkv, d, s, seed), args.out / f"random_{name}_{s}.pt")
    torch.save(capture_kvzip_random(seed + 1), args.out / f"kvzip_random_{KVZIP_RANDOM[4]}.pt")
    if not args.no_model:
        for n in args.facts:
            case = capture_model(n)
            S = case["queries"].shape[2]
            torch.save(case, args.out / f"model_{S}.pt")
            print(f"model prompt of {n} facts: {S} tokens, {case['queries'].shape[0]} layers")
    print("captured into", args.out)


if __name__ == "__main__":
    main()
