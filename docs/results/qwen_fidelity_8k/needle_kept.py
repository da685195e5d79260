"""Which methods keep the tokens that hold the answer: for each RULER sample of the fidelity runs, the share of the
model's (layer, KV head) pairs whose cache keeps every token of the answer's needle value after the prefill's
compression, per method and budget (results-fidelity.md, "Qwen2.5-Coder-0.5B at 8K").

Run from the repository root, with the prompts of the section's commands (``slake make-prompt --model
qwen2.5-coder-0.5b --task T --length 8192 --seed 0 --out PROMPTS/p_T.txt`` for the three tasks) in a folder PROMPTS:

    python docs/results/qwen_fidelity_8k/needle_kept.py PROMPTS > docs/results/qwen_fidelity_8k/needle_kept.md

The prompt is formatted as ``slake fidelity --prompt-file`` formats it, and the caches are built as the fidelity
runs build them (the recorded prompt compressed layer by layer, the model's profile applied, PTAA as the method has
it by default; the kept set does not depend on PTAA).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import slake
from slake.budgets.budget import Budget
from slake.cache.compressed import CompressedKV
from slake.engines.transformers.generate import format_prompt, uses_chat_template
from slake.methods.profiles import resolve_method
from slake.quality import fidelity

SAMPLES = {  # task: the answer the make-prompt command printed (the needle's value)
    "niah_single_2": "7624914",
    "niah_multikey_1": "4541123",
    "vt": "57055",  # vt's answer is variable names; the value they hold is what the chain starts from
}
METHODS = ("snapkv", "cake", "slake")
BUDGETS = (128, 256, 512, 1024)


def answer_positions(tokenizer, text: str, value: str) -> tuple[torch.Tensor, list[int]]:
    """The formatted prompt's ids, and the positions of the tokens overlapping the first occurrence of ``value``."""
    prompt = format_prompt(tokenizer, text)
    enc = tokenizer(
        prompt, return_tensors="pt", add_special_tokens=not uses_chat_template(tokenizer), return_offsets_mapping=True
    )
    start = prompt.index(value)
    end = start + len(value)
    spans = enc["offset_mapping"][0].tolist()
    pos = [i for i, (a, b) in enumerate(spans) if a < end and b > start]
    return enc["input_ids"], pos


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    model, tokenizer = slake.load_model("qwen2.5-coder-0.5b")
    print("| sample | method | " + " | ".join(f"@{b}: pairs keeping all / share kept" for b in BUDGETS) + " |")
    print("|---|---|" + "---|" * len(BUDGETS))
    for task, value in SAMPLES.items():
        text = (folder / f"p_{task}.txt").read_text(encoding="utf-8")
        ids, pos = answer_positions(tokenizer, text, value)
        rec = fidelity.record(model, ids, 1)
        for name in METHODS:
            cells = []
            for b in BUDGETS:
                method, _ = resolve_method(name, b, model)
                eng = CompressedKV(method, Budget(b), rec.num_layers)
                for layer, (q, k, v, pad, scaling) in enumerate(rec.prompt):
                    eng.prefill_layer(layer, q, k, v, pad, scaling)
                full = share = 0
                pairs = 0
                for store in eng.layers:
                    kept = store.positions.masked_fill(~store.valid, -1)[0]  # (Hkv, n)
                    for h in range(kept.shape[0]):
                        hit = torch.isin(torch.tensor(pos), kept[h])
                        full += int(hit.all())
                        share += float(hit.float().mean())
                        pairs += 1
                cells.append(f"{full}/{pairs} / {share / pairs:.2f}")
            print(f"| {task} ({len(pos)} tokens) | {name} | " + " | ".join(cells) + " |", flush=True)
            if name == "cake":  # its layer budgets at 128, beside the uniform 128 of the others (SLAKE: alpha=beta=0)
                method, _ = resolve_method(name, 128, model)
                eng = CompressedKV(method, Budget(128), rec.num_layers)
                for layer, (q, k, v, pad, scaling) in enumerate(rec.prompt):
                    eng.prefill_layer(layer, q, k, v, pad, scaling)
                budgets = " ".join(str(round(x)) for x in eng.kept_tokens_per_layer())
                print(f"| | cake's kept tokens per layer at 128: {budgets} |" + " |" * (len(BUDGETS) - 1), flush=True)


if __name__ == "__main__":
    main()
