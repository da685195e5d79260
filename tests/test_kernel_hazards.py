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
    "replicated_read_modify_write": [WAR],  # a layout that holds each element in several threads
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
    # an MI300X's Triton makes buffer operations (amdg.buffer_load %base[%offsets]) of loads and stores: the same
    # answers through them
    amd = {name: found.pop(name) for name in list(found) if "@gfx942" in name}
    assert found == EXPECTED
    for name, kinds in amd.items():
        if name.endswith(" buffer"):
            assert kinds is True, name
        else:
            assert kinds == EXPECTED[name.removesuffix("@gfx942")], name
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


BLOCKED_4 = "#ttg.blocked<{sizePerThread = [4], threadsPerWarp = [32], warpsPerCTA = [8], order = [0]}>"
BLOCKED_1 = "#ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [8], order = [0]}>"
BLOCKED_2D = "#ttg.blocked<{sizePerThread = [1, 2], threadsPerWarp = [1, 32], warpsPerCTA = [4, 2], order = [1, 0]}>"


def test_which_layouts_hold_an_element_in_more_than_one_thread():
    """A blocked layout of 8 warps of 32 threads holds 128 elements twice each and 1,024 once; a 4 x 128 tile of
    4 x 2 warps once; a slice of the dimension its warps span, in every warp along it; a linear layout with a lane
    basis of zeros, in two lanes; one pointer, in every thread."""
    from kernel_hazards import replicated

    layouts = {"#b": BLOCKED_1, "#b2": BLOCKED_2D}
    assert replicated("tensor<128x!tt.ptr<f32>, #b>", layouts)
    assert not replicated("tensor<1024x!tt.ptr<f32>, #b>", layouts)
    assert not replicated("tensor<4x128x!tt.ptr<f32>, #b2>", layouts)
    assert replicated("tensor<128x!tt.ptr<f32>, #ttg.slice<{dim = 0, parent = #b2}>>", layouts)
    linear = "#ttg.linear<{register = [[1]], lane = [[2], [0], [4], [8], [16]], warp = [[32], [64]], block = []}>"
    assert replicated(f"tensor<128x!tt.ptr<f32>, {linear}>", layouts)
    once = "#ttg.linear<{register = [[1]], lane = [[2], [32], [4], [8], [16]], warp = [[64]], block = []}>"
    assert not replicated(f"tensor<128x!tt.ptr<f32>, {once}>", layouts)
    assert replicated("!tt.ptr<f32>", layouts)


def test_a_conversion_that_moves_elements_between_warps_orders_the_program():
    """Four elements a thread to one (1,024 over 8 warps) moves most elements to another warp: Triton goes through
    shared memory and a barrier of the program. The same layout, or a slice whose every element its target warp
    already held, moves nothing between warps."""
    from kernel_hazards import crosses_warps, warps_holding

    layouts = {"#a": BLOCKED_4, "#b": BLOCKED_1}
    assert crosses_warps("#a", "#b", [1024], layouts)
    assert not crosses_warps("#a", "#a", [1024], layouts)
    held = warps_holding("#a", [1024], layouts)
    assert held[(0,)] == {0} and held[(127,)] == {0} and held[(128,)] == {1}
    assert warps_holding("#b", [1024], layouts)[(32,)] == {1}
    assert not crosses_warps("#a", "#b", [16], layouts)  # 16 elements: every warp holds all of them in both
