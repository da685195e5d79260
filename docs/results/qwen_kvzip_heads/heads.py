"""KVzip's slots per (layer, KV head) after the prefill of one RULER prompt on Qwen2.5-Coder-0.5B-Instruct.

    python docs/results/qwen_kvzip_heads/heads.py niah_multikey_1 8192 > docs/results/qwen_kvzip_heads/heads.txt

The prompt is the task's first sample (seed 0) at that length, as ``slake eval`` builds it (chat template, question in
the prompt); the second pass (the model repeating the prompt) runs once and every budget replays it
(docs/results-qwen.md, "What KVzip keeps, and its decode rule").
"""

import sys

import torch

import slake
from slake.engines.transformers.prefill_once import capture_prefill
from slake.engines.transformers.reconstruction import ReconstructionPrompt, run_second_pass
from slake.eval.prompts import build_prompt
from slake.eval.ruler import ruler_samples
from slake.methods.kvzip import KVzip

task, length = sys.argv[1], int(sys.argv[2])
model, tokenizer = slake.load_model("qwen2.5-coder-0.5b")
sample = ruler_samples(task, tokenizer, length, 1)[0]
ids = torch.tensor([tokenizer(build_prompt(sample, tokenizer), add_special_tokens=False)["input_ids"]])
capture = capture_prefill(model, ids, keep_queries=False)
capture.input_ids = ids
run_second_pass(model, capture, KVzip(), ReconstructionPrompt.from_tokenizer(tokenizer))
print(f"{task}, {ids.shape[1]} tokens: slots per (layer, KV head) after KVzip's prefill")
for budget in (128, 256, 512, 1024):
    layers = capture.replay("kvzip", budget).compressor.state.layers
    n = torch.stack([layer.valid[0].sum(-1) for layer in layers]).flatten().float()
    print(
        f"budget {budget}: min {n.min():.0f} median {n.median():.0f} max {n.max():.0f}, "
        f"heads under 64 slots: {(n < 64).sum():.0f} of {n.numel()}"
    )
