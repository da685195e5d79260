"""Audit of the vLLM plugin's request lifecycle and configuration (third pass). Each test failed before its fix:

* CAKE/SLAKE whose layer cap reaches ``max_model_len`` (``cake`` at budget 128 on a 200-token prompt: slake's own
  drivers size ``max_model_len`` to the prompt, 256 here, and the default cap is 2 x 128): the decode pool's width
  is ``max_model_len + 1`` slots, one block more than vLLM's block table holds when ``max_model_len`` is a multiple
  of 128 tokens, and the first compressed decode step killed the engine (``RuntimeError: The size of tensor a (9)
  must match the size of tensor b (8)`` in ``PluginState._plan_decodes``).
* ``--dtype half`` (a spelling the transformers engine accepts) reached vLLM as ``"half"`` and the driver's byte
  accounting as an unknown dtype, counted as 4 bytes per value: ``kv_bytes`` twice the truth.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import hf_generate
from slake.engines.vllm.plugin.config import parse_config, vllm_dtype
from slake.engines.vllm.plugin.paged import CpuAttnLayout
from slake.engines.vllm.plugin.state import PluginState
from slake.engines.vllm.runner import dtype_itemsize, run_vllm

BLOCK = 32


@dataclasses.dataclass
class StepMetadata:
    """What :meth:`PluginState.plan_step` reads of vLLM's ``CommonAttentionMetadata`` (a dataclass, as vLLM's)."""

    num_reqs: int
    query_start_loc_cpu: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table_tensor: torch.Tensor
    max_seq_len: int


def step(lens: list[tuple[int, int]], table: torch.Tensor) -> StepMetadata:
    """A step of requests given as ``(query tokens, sequence length)``, with vLLM's block table ``table``."""
    qsl = torch.tensor([0] + [sum(q for q, _ in lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    seq = torch.tensor([s for _, s in lens], dtype=torch.int32)
    return StepMetadata(len(lens), qsl, qsl, seq, table, int(seq.max()))


def vllm_table_width(max_model_len: int, block_size: int) -> int:
    """vLLM 0.32's block-table width: ``ceil(max_model_len / block_size)`` rounded up to 128 tokens
    (``vllm.v1.worker.block_table.get_block_table_width``)."""
    from vllm.v1.worker.block_table import get_block_table_width

    return get_block_table_width(-(-max_model_len // block_size), block_size)


@pytest.mark.parametrize("method", ["cake", "slake"])
def test_a_layer_cap_at_max_model_len_plans_its_decode_step(method):
    """The plan of a compressed decode step, with vLLM's block table as wide as vLLM makes it: the pool's
    ``max_model_len + 1`` slots read past the table's last column, which the plan now fills (with the row's first
    block, as every column past the request's own blocks)."""
    max_model_len, prompt = 256, 200
    cfg = parse_config({"slake": {"method": method, "budget": 128}}).for_engine(max_model_len)
    assert cfg.slots() == max_model_len + 1  # the cap (256) reaches max_model_len
    state = PluginState(
        cfg, num_layers=2, kv_heads=2, head_dim=16, block_size=BLOCK, max_rows=2, layout=CpuAttnLayout()
    )
    width = vllm_table_width(max_model_len, BLOCK)
    assert width * BLOCK < cfg.slots()
    table = torch.zeros(2, width, dtype=torch.int32)
    table[0, :7] = torch.arange(1, 8)  # the request's prompt blocks (vLLM's null block 0 is never a request's)
    state.step_req_ids, state.step_prompt_lens = ["r"], [prompt]
    plan, _ = state.plan_step(step([(prompt, prompt)], table))
    assert len(plan.prefills) == 1 and plan.decode is None
    plan, cm = state.plan_step(step([(1, prompt + 1)], table))
    batch = plan.decode
    assert batch is not None and batch.table.shape == (1, -(-cfg.slots() // BLOCK))
    held = cfg.blocks(BLOCK, prompt)  # the request's own blocks, then its first block
    assert batch.table[0, :held].tolist() == list(range(1, held + 1))
    assert (batch.table[0, held:] == 1).all()
    assert int(cm.seq_lens[0]) == 1


def test_a_layer_cap_at_max_model_len_decodes_as_the_transformers_engine(tiny_dir):
    """The same inside vLLM: ``cake`` at budget 128 on a 200-token prompt at ``max_model_len`` 256 (what ``slake
    generate --engine vllm`` sizes for a 200-token prompt) gives the transformers engine's tokens; before, the engine
    died at its first decode step."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 500, (200,), generator=g).tolist()
    run = run_vllm(
        tiny_dir,
        [ids],
        slake={"method": "cake", "budget": 128},
        max_new_tokens=8,
        ignore_eos=True,
        block_size=BLOCK,
        max_model_len=256,
    )
    assert run.compressed == [True]
    assert run.tokens[0] == hf_generate(tiny_dir, ids, "cake", 128, 8)


@pytest.mark.parametrize(
    ("spelling", "name", "itemsize"),
    [("half", "float16", 2), ("HALF", "float16", 2), ("float", "float32", 4), ("fp16", "float16", 2),
     ("bfloat16", "bfloat16", 2), (None, "float32", 4)],
)  # fmt: skip
def test_dtype_spellings_name_the_dtype_vllm_runs(spelling, name, itemsize):
    """``--dtype half`` is float16 for the transformers engine and for vLLM: named so in result rows, and counted as
    2 bytes per value in ``kv_bytes`` (before: ``"half"`` passed through, and counted as 4 bytes)."""
    assert vllm_dtype(spelling) == name
    assert dtype_itemsize(vllm_dtype(spelling)) == itemsize


def test_an_unknown_dtype_is_not_counted_as_four_bytes():
    with pytest.raises(ValueError, match="int8"):
        dtype_itemsize("int8")
