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
    return {"queries": q, "keys": k, "values": v, "scaling": layers[0][3], "input_ids": torch.tensor(ids),
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
    return {"queries": fp16_round(q), "keys": fp16_round(k), "values": fp16_round(v), "scaling": 1 / math.sqrt(d),
            "source": f"torch.randn seed {seed}, Hq={hq}, Hkv={hkv}, d={d}, S={s}, fp16-rounded"}


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
    if not args.no_model:
        for n in args.facts:
            case = capture_model(n)
            S = case["queries"].shape[2]
            torch.save(case, args.out / f"model_{S}.pt")
            print(f"model prompt of {n} facts: {S} tokens, {case['queries'].shape[0]} layers")
    print("captured into", args.out)


if __name__ == "__main__":
    main()
