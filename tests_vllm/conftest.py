"""Shared fixtures of the vLLM tests (run in ``.venv-vllm`` by ``make test-vllm``; not collected by ``make test``).

The tiny model is a random Llama saved to a temporary directory, with larger query/key and embedding weights so
that attention is peaky and greedy continuations vary: every method's compressed continuation differs from the
full cache's, so an engine that silently ran uncompressed would fail the equivalence tests.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _fill_slakes_scratch() -> None:
    """As in ``make test`` (``tests/scratch_poison.py``): every uninitialised tensor slake's modules allocate holds
    NaN or -1 until written, so that the plugin's steps inside vLLM show a read of scratch before its write."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "scratch_poison", Path(__file__).resolve().parents[1] / "tests" / "scratch_poison.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()


_fill_slakes_scratch()

BUDGET = 64
NEW_TOKENS = 24
#: prompt lengths of the batch: compressed ones of different lengths, two of the same length with different tokens,
#: one shorter than the budget (never compressed), and one of whole blocks below CAKE/SLAKE's layer cap (its first
#: decode step needs one more block than its prefill)
LENGTHS = (200, 120, 40, 300, 200, 96)
#: vLLM's max_layer_budget of CAKE/SLAKE at BUDGET (slake.engines.vllm.plugin.config.with_layer_cap)
LAYER_CAP = 2 * BUDGET


def build_tiny(path: str, seed: int = 0) -> None:
    """Save a random 3-layer Llama (GQA 4/2 heads, head dim 32) to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
            if name.endswith(("lm_head.weight", "embed_tokens.weight")):
                p.mul_(3.0)
    model.save_pretrained(path)


def preempting_run(model_dir: str, method: str, block: int = 32):
    """8 usable KV blocks of ``block`` tokens (plus vLLM's null block): A (40-token prompt, uncompressed) grows until
    it needs a block held by B (100-token prompt, compressed, scheduled after A), so vLLM preempts B, finishes A, and
    recomputes B from its prompt plus the tokens it had generated. Returns B's prompt and the run."""
    from slake.engines.vllm.runner import run_vllm

    g = torch.Generator().manual_seed(11)
    a = torch.randint(3, 500, (40,), generator=g).tolist()
    b = torch.randint(3, 500, (100,), generator=g).tolist()
    run = run_vllm(
        model_dir,
        [a, b],
        slake={"method": method, "budget": BUDGET},
        max_new_tokens=150,
        max_tokens=[130, 150],
        ignore_eos=True,
        block_size=block,
        num_blocks=9,
        max_model_len=256,
    )
    return b, run


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny(path)
    return path


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]


def hf_generate(model_dir: str, ids: list[int], method: str | None, budget: int, new_tokens: int) -> list[int]:
    """Greedy tokens of slake's transformers engine (batch 1), or of the full cache when ``method`` is None."""
    from transformers import AutoModelForCausalLM

    import slake
    from slake.engines.transformers.cache import SlakeCache
    from slake.engines.transformers.cache_kwarg import with_cache
    from slake.methods import make_method

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    slake.prepare_model(model)
    kw = {}
    if method is not None:
        from slake.budgets.budget import Budget
        from slake.engines.vllm.plugin.config import with_layer_cap

        built = with_layer_cap(make_method(method), Budget(budget))  # the cap vLLM uses for CAKE/SLAKE
        kw.update(with_cache(model, SlakeCache(built, budget, model.config.num_hidden_layers)))
    x = torch.tensor([ids])
    # exactly new_tokens, EOS included where it is the argmax, as vLLM's ignore_eos (min_new_tokens would mask EOS)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw
        )
    return out[0, len(ids) :].tolist()
