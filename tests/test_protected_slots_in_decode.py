"""Protected slots survive decoding for every method that evicts while decoding (``docs/methods/README.md``): the
sinks stay, and the most recent ``window`` tokens are held at every step, through the torch step and the fused
kernels alike.

KVzip's running maximum kept the prompt's window tokens at the ``+inf`` that marks protected slots after they left
the window; once a head's unprotected slots all scored ``+inf``, its arg-min fell on the first slot, a sink, and
then on each new token.
"""

from __future__ import annotations

import pytest
import torch

from slake import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import prefill_for_generate, random_ids, tiny_model

WINDOW, SINKS, PROMPT, NEW = 8, 4, 60, 14
METHODS = ["snapkv", "pyramidkv", "ada-snapkv", "ada-pyramidkv", "h2o", "ahakv", "cake", "slake", "lava", "keydiff",
           "expected-attention", "ada-expected-attention", "criticalkv", "ada-criticalkv", "streamingllm", "kvzip",
           "kvzip[keep_generated=true,decode_scope=layer]"]  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa")


def _held_after_decoding(model, method: str, budget: int, kernels: str) -> list[list[set[int]]]:
    extra = f"window={WINDOW},sinks={SINKS}"
    spec = f"{method[:-1]},{extra}]" if method.endswith("]") else f"{method}[{extra}]"
    ids = random_ids(PROMPT, seed=31)
    cache = SlakeCache(spec, budget, config=model.config, kernels=kernels)
    prefill_for_generate(model, cache, ids)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=NEW,
                       min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
    out = []
    for store in cache.compressor.layers:
        pos, valid = store.positions[0], store.valid[0]
        out.append([set(pos[h][valid[h]].tolist()) for h in range(pos.shape[0])])
    return out


def _check(held: list[list[set[int]]]) -> None:
    newest = PROMPT + NEW - 2  # the last token fed to the model (the last one generated is not)
    protected = set(range(SINKS)) | set(range(newest - WINDOW + 1, newest + 1))
    for layer, heads in enumerate(held):
        for head, kept in enumerate(heads):
            assert protected <= kept, f"layer {layer}, KV head {head} lost {sorted(protected - kept)}"


@pytest.mark.parametrize("budget", [SINKS + WINDOW, 20])
@pytest.mark.parametrize("method", METHODS)
def test_sinks_and_window_survive_the_torch_step(model, method, budget):
    _check(_held_after_decoding(model, method, budget, "torch"))


@pytest.mark.parametrize("method", ["kvzip", "h2o", "ahakv", "snapkv"])
def test_sinks_and_window_survive_the_fused_step(model, method):
    _check(_held_after_decoding(model, method, SINKS + WINDOW, "triton"))
