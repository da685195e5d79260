"""KVzip with ``window=32`` after a5f2feb, beside KVzip as shipped, its append-only decoding and CAKE, all run on the
same Qwen2.5-Coder-0.5B prompts (8K, niah_single_2, niah_multikey_1, vt; the first 3 samples of each): score in %
and KL to the full cache (nats/token), each with its 95% bootstrap interval.

    python docs/results/qwen_kvzip_window_8k/table.py > docs/results/qwen_kvzip_window_8k/table.md

Before a5f2feb the window's prompt tokens kept the ``+inf`` that marks protected slots once they left the window
(KVzip's running maximum), and a head whose other slots all scored ``+inf`` lost its sinks, then each new token
(docs/results-qwen.md, "What KVzip keeps, and its decode rule"). These prompts are the generators' of 2026-11-30; the
rows of ``qwen_kvzip_decode_8k`` and ``qwen_methods_8k`` were made from those of 2026-11-26, whose full-cache answers
differ (the model answered with a list where it now answers with the number), so the two folders do not mix.
"""

import json
from pathlib import Path

from slake.eval.stats import line_interval, paired_difference, score_table

HERE = Path(__file__).parent
BUDGETS = (128, 256, 512, 1024)
REFERENCE = "kvzip[decode_eviction=false]"
METHODS = [
    "kvzip",
    "kvzip[window=32]",
    "kvzip[decode_scope=layer,keep_generated=true,window=32]",
    REFERENCE,
    "cake",
]

every = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines() if line.strip()]
ids = {r["sample_id"] for r in every if r["method"] != "full"}
score = score_table(every)
kl = score_table([{**r, "score": r["kl"]} for r in every if r.get("kl") is not None])
print(
    f"{len(ids)} prompts. Score % [95% CI] / KL nats/token [95% CI]; `>` marks a KL significantly above "
    f"`{REFERENCE}`'s (paired bootstrap, 95%), `<` one significantly below.\n"
)
print("| method | " + " | ".join(f"@{b}" for b in BUDGETS) + " | " + " | ".join(f"KL @{b}" for b in BUDGETS) + " |")
print("|---|" + "---:|" * (2 * len(BUDGETS)))
full = line_interval(score[("full", None)])
print(
    "| full | "
    + " | ".join([f"{full.mean:.1f} [{full.low:.0f}, {full.high:.0f}]"] * len(BUDGETS) + ["0"] * len(BUDGETS))
    + " |"
)
for m in METHODS:
    cells, kls = [], []
    for b in BUDGETS:
        if (m, b) not in score:
            cells.append("-")
            kls.append("-")
            continue
        s = line_interval(score[(m, b)])
        cells.append(f"{s.mean:.1f} [{s.low:.0f}, {s.high:.0f}]")
        k = line_interval(kl[(m, b)], scale=1.0)
        mark = ""
        if m != REFERENCE and (REFERENCE, b) in kl:
            d = paired_difference(kl, (m, b), (REFERENCE, b), scale=1.0)
            mark = ">" if d.low > 0 else "<" if d.high < 0 else ""
        kls.append(f"{mark}{k.mean:.2f} [{k.low:.2f}, {k.high:.2f}]")
    print(f"| {m} | " + " | ".join(cells) + " | " + " | ".join(kls) + " |")
