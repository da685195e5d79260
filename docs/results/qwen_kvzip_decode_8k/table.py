"""KVzip's decode rules on the same Qwen2.5-Coder-0.5B prompts (8K, niah_single_2, niah_multikey_1, vt; the first 3
samples of each): score in % and KL to the full cache (nats/token), each with its 95% bootstrap interval.

    python docs/results/qwen_kvzip_decode_8k/table.py > docs/results/qwen_kvzip_decode_8k/table.md

Rows come from this folder (the new rules) and from ``qwen_methods_8k`` (KVzip as shipped before, its variants, CAKE),
restricted to the prompts this folder has (docs/results-qwen.md, "What KVzip keeps, and its decode rule").
"""

import json
from pathlib import Path

from slake.eval.stats import line_interval, paired_difference, score_table

HERE = Path(__file__).parent
BUDGETS = (128, 256, 512, 1024)
METHODS = [
    "kvzip",
    "kvzip[decode_scope=layer]",
    "kvzip[keep_generated=true]",
    "kvzip[decode_scope=layer,keep_generated=true]",
    "kvzip[decode_scope=layer,keep_generated=true,window=32]",
    "kvzip[window=32]",
    "kvzip[decode_eviction=false]",
    "cake",
]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


new = rows(HERE / "results.jsonl")
ids = {r["sample_id"] for r in new if r["method"] != "full"}
every = [r for r in rows(HERE.parent / "qwen_methods_8k" / "results.jsonl") + new if r["sample_id"] in ids]
score = score_table(every)
kl = score_table([{**r, "score": r["kl"]} for r in every if r.get("kl") is not None])
print(
    f"{len(ids)} prompts. Score % [95% CI] / KL nats/token [95% CI]; `>` marks a KL significantly above "
    "`kvzip[decode_eviction=false]`'s (paired bootstrap, 95%), `<` one significantly below.\n"
)
print("| method | " + " | ".join(f"@{b}" for b in BUDGETS) + " | " + " | ".join(f"KL @{b}" for b in BUDGETS) + " |")
print("|---|" + "---:|" * (2 * len(BUDGETS)))
for m in METHODS:
    cells, kls = [], []
    for b in BUDGETS:
        s = line_interval(score[(m, b)])
        cells.append(f"{s.mean:.1f} [{s.low:.0f}, {s.high:.0f}]")
        k = line_interval(kl[(m, b)], scale=1.0)
        mark = ""
        if m != "kvzip[decode_eviction=false]":
            d = paired_difference(kl, (m, b), ("kvzip[decode_eviction=false]", b), scale=1.0)
            mark = ">" if d.low > 0 else "<" if d.high < 0 else ""
        kls.append(f"{mark}{k.mean:.2f} [{k.low:.2f}, {k.high:.2f}]")
    print(f"| {m} | " + " | ".join(cells) + " | " + " | ".join(kls) + " |")
