"""The check for memory hazards inside a program (``tests/kernel_hazards.py``), on small kernels whose hazards are
known (``tests/hazard_samples.py``): it finds each one, and nothing where a barrier, a reduction or the same pointer
orders the accesses. ``tests/test_kernels_compile.py`` runs it over every fused kernel it compiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

RAW, WAR = "read after write", "write after read"

EXPECTED = {
    "store_then_shifted_load": [RAW],
    "store_barrier_load": [],
    "load_then_reversed_store": [WAR],
    "load_reduce_store": [],
    "load_branch_store": [],
    "read_modify_write": [],
    # the order buffer's compaction (slake.kernels.triton_wide._drop_evicted) without its barriers: the store of
    # one block over entries other threads still read, and the next block's load after it
    "loop_compaction": [RAW, WAR],
    "loop_compaction_with_barriers": [],
    "two_atomics": [],
    "atomic_then_load": [RAW],
    "scalar_store_then_load": [RAW],
    "scalar_read_modify_write": [WAR],  # one pointer: stored by one thread, loaded by all
    "block_pointer": [],  # Triton rewrites block pointers into tensors of pointers before this IR
}


@pytest.mark.skipif(
    not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
    reason="Triton's CUDA backend (ptxas) is not installed",
)
def test_the_hazard_check_finds_the_known_hazards_and_only_those():
    script = Path(__file__).with_name("hazard_samples.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    refused = found.pop("pointer_from_an_integer")
    assert found == EXPECTED
    # a pointer the analysis cannot trace to an argument is refused, not passed as checked
    assert refused.startswith("error: tt.int_to_ptr"), refused


def test_names_reused_by_sibling_regions_are_told_apart():
    """MLIR prints values of sibling regions (an ``if``'s branches) under the same names: ``%1`` is a pointer into
    ``%a`` in one branch and into ``%b`` in the other, so a load of ``%b`` after the ``if`` follows the second
    branch's store only (taken as one value, both stores would be of both arguments)."""
    from kernel_hazards import hazards

    ttir = """module {
  tt.func public @k(%a: !tt.ptr<f32>, %b: !tt.ptr<f32>, %c: i1) {
    scf.if %c {
      %1 = tt.addptr %a, %c : !tt.ptr<f32>, i1 loc(#loc1)
      tt.store %1, %c : !tt.ptr<f32> loc(#loc1)
    } else {
      %1 = tt.addptr %b, %c : !tt.ptr<f32>, i1 loc(#loc2)
      tt.store %1, %c : !tt.ptr<f32> loc(#loc2)
    } loc(#loc1)
    %3 = tt.addptr %b, %c : !tt.ptr<f32>, i1 loc(#loc3)
    %4 = tt.load %3 : !tt.ptr<f32> loc(#loc3)
    tt.return loc(#loc1)
  } loc(#loc1)
} loc(#loc1)
#loc1 = loc("k.py":1:0)
#loc2 = loc("k.py":2:0)
#loc3 = loc("k.py":3:0)
"""
    (h,) = hazards(ttir)
    assert (h.kind, h.argument, h.first, h.second) == (RAW, "%b", ("k.py:2",), ("k.py:3",))
