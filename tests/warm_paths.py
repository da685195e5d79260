"""Do the warm cache's steps specialize the fused kernels as a real decode does? (``tests/test_warm_cache.py``)

Run as a script in its own process (Triton is imported with ``TRITON_INTERPRET`` unset, as on a GPU): with Triton's
driver reporting sm_90 and every launch a ``warmup`` whose compilation a ``jit_cache_hook`` skips (nothing is
compiled or run; each specialization the JIT would compile is recorded), it decodes two steps of a random model with
Llama-3-8B's heads (2 layers, small elsewhere) through ``SlakeCache`` as ``slake bench`` does, eager, in static
mode, and compiled (``torch.compile``, inductor on the CPU: the fused step as the graph's custom operator), for each
method of ``argv[1]``; then runs the build's own steps
(``benchmarks.warm_parts.engine_steps``) at one width of each class the model's layers fell in. Prints one JSON
line: the model's specializations, and those of them the build's steps did not make.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import torch  # noqa: E402

from benchmarks import warm_cache, warm_parts  # noqa: E402


def main(methods: list[str]) -> None:
    warm_cache.compile_for_sm90()
    seen: set[tuple[str, str]] = set()
    warm_cache.skip_compiling(seen)
    from slake.engines.transformers.generate import prefill
    from slake.engines.transformers.measure import BenchConfig, _new_cache, _prompt, _step, compiled_step
    from slake.engines.transformers.shapes import random_model

    spec = "llama3-8b:num_hidden_layers=2,hidden_size=256,head_dim=128,intermediate_size=256,vocab_size=512"
    model = random_model(spec, dtype=torch.bfloat16)
    widths: set[int] = set()
    for method in methods:
        for mode in ("eager", "static", "compiled"):
            cfg = BenchConfig(method, 1024, 2048, decode_steps=2, warmup=1, kernels="triton", compile=mode != "eager")
            cache = _new_cache(model, cfg)
            ids = _prompt(model, cfg)
            with torch.inference_mode():
                tok = prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)
                step = compiled_step(model, cache) if mode == "compiled" else lambda t, c=cache: _step(model, c, t)
                for _ in range(2):
                    tok = step(tok)
            widths |= {int(s.capacity) for s in cache.compressor.state.layers}
    model_specs = set(seen)
    seen.clear()
    reps = {warm_parts.width_class(r): r for r in warm_parts.width_classes(warm_parts.MIN_WIDTH, max(widths))}
    reps = sorted({reps[warm_parts.width_class(w)] for w in widths})
    for static in (False, True):
        warm_parts.engine_steps(methods, reps, static, torch.bfloat16)
    missed = sorted(name for name, s in model_specs - seen)
    print(json.dumps({"widths": sorted(widths), "model": len(model_specs), "missed": missed}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","))
