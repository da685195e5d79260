"""How often a token KVzip's decode writes outlives the step that wrote it (SmolLM2-135M-Instruct, one synthetic
needle prompt of 150 sentences, budget 64, 24 new tokens, greedy), averaged over layers, KV heads and steps.

    SLAKE_NO_PROFILE=1 python docs/results/kvzip_new_token_survival/survival.py [SPEC ...]

Default spec: ``kvzip`` (docs/methods/kvzip.md#decode-rule quotes its output: 0.446). The second pass makes this a
few minutes on two cores.
"""

import sys

import slake
from slake.cache import fused_step
from slake.cache.decode_step import decode_step as torch_step

survived: list[float] = []


def recording(method, slots, kv, query, key, value, scaling):
    """The torch step, then whether each row and KV head still holds the token just written."""
    out = torch_step(method, slots, kv, query, key, value, scaling)
    newest = slots.newest.view(-1, 1, 1) if slots.newest.ndim else slots.newest
    survived.append((slots.positions == newest).any(-1).float().mean().item())
    return out


fused_step.decode_step = recording
model, tok = slake.load_model()
hay = " ".join(f"The grass is green and the sky is blue on day {i}." for i in range(150))
half = len(hay) // 2
prompt = hay[:half] + " The special magic number is 7481923. " + hay[half:] + "\nWhat is the special magic number?"
for spec in sys.argv[1:] or ["kvzip"]:
    survived.clear()
    r = slake.generate(model, tok, prompt, method=spec, budget=64, max_new_tokens=24)
    rate = sum(survived) / max(len(survived), 1)
    print(f"{spec}: prompt {r.prompt_tokens[0]} tokens, new token held after its step: {rate:.3f}; {r.texts[0]!r}")
