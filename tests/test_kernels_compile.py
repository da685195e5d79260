"""The fused decode kernels compile for an H100 (``sm_90``) on this machine, which has no GPU, and for other GPUs: an
A100, Ada and Blackwell parts, an MI300X (:data:`OTHER_GPUS`).

Triton's interpreter (``tests/test_fused_decode.py``) checks what the kernels compute but not that Triton's GPU compiler
accepts them: an operation the interpreter allows and the compiler refuses, or a kernel whose shared memory exceeds a
GPU's, would only show on a GPU. ``tests/kernel_aot.py`` compiles every kernel a decode step launches, with the step's
own arguments and constants at Llama-3-8B's head shape and budget 1024 (and at the vLLM pool's 8 rows and budget 128 for
the cases that differ there), through Triton's CUDA backend down to a cubin (its bundled ``ptxas``), once per family of
decode rule and per storage, and checks each kernel's shared memory against an H100's; no kernel may spill registers
to local memory (``ptxas -v``), in bfloat16, float32 or 8-bit storage: at batch 1 the second kernel runs 8 programs, and
a spill there is latency on the step's critical path. Each launch is compiled with the specialization Triton's JIT
gives it (``tests/kernel_aot.py``). And in every kernel compiled here, each read of what another thread of its
program wrote, and each write over what another thread may still read, is ordered by a barrier
(``tests/kernel_hazards.py``, read off the Triton IR): the interpreter runs a program as one sequence and cannot
show a missing one, and on a GPU it would be a wrong value now and then.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

#: shared memory one block may use on an H100 (227 KB)
H100_SHARED = 232448

#: one case per decode-rule family (``slake.methods.decode_rule.RULE_KINDS``) and per constant that changes the code:
#: pooling, the linear state, evicting first, low-precision dots, 8-bit storage, per-head visibility, the two stages
CASES = {
    "slake": 2,  # pooled attention (sort), the linear state, evicting before the output
    "slake@bfloat16": 2,  # low-precision dots
    "cake@bfloat16": 2,  # the window's slots out of the pooling
    "ada-snapkv@bfloat16": 2,  # max pooling
    "h2o@int8": 2,  # accumulated attention, int8 rows
    "ahakv@bfloat16": 2,  # sharpened accumulation
    "tova@fp8_e4m3": 2,  # the layer's mean, fp8 rows
    "streamingllm": 2,  # recency
    "sagekv": 2,  # pinned recency, per-query-head visibility
    "kvzip": 2,  # running maximum
    "kvzip[keep_generated=true]": 2,  # generated tokens ranked above the context
    "keydiff@bfloat16": 2,  # key diversity (the row's keys read in the second kernel)
    "ada-expected-attention@bfloat16": 2,  # mapped queries, value norms
    "ada-criticalkv": 3,  # the two stages, and the projection kernel
    "criticalkv[scorer=expected-attention,window=0]": 3,
    "slake[decode_eviction=false]@bfloat16": 2,  # a layer that does not evict (KEEP_ALL): no rule, no logits kept
    "ada-snapkv[decode_scope=layer]@bfloat16": 3,  # across a layer's KV heads: the heads' lowest slots, 3rd kernel
    "kvzip[decode_scope=layer]": 3,
}


def _ptxas() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


#: the cases compiled again at the vLLM pool's shape (8 rows, budget 128: rows of 257 slots, 4 warps in the second
#: kernel, where SLAKE's spilled 244 bytes before its victim's piece was summed in blocks of 32 slots)
POOL_CASES = {"slake@bfloat16": 2, "cake@bfloat16": 2}


def _compile(cases: dict[str, int], *shape: str, target: str = "cuda:90") -> list[dict]:
    script = Path(__file__).with_name("kernel_aot.py")
    run = subprocess.run(
        [sys.executable, str(script), *shape, target, *cases],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == list(cases)
    # the compilations read no transformers, so `make test-oldest` (transformers at its floor) leaves them out
    assert not any(r["transformers_loaded"] for r in results if "compiled" in r), "the compilation loaded transformers"
    for r in results:
        for k in r.get("compiled", ()):
            assert not k["hazards"], f"{r['case']}: {k['kernel']}: " + "; ".join(k["hazards"])
    return results


@pytest.mark.gpu_compile
@pytest.mark.skipif(not _ptxas().exists(), reason="Triton's CUDA backend (ptxas) is not installed")
@pytest.mark.parametrize("shape", ["batch1-1024", "batch8-128"])
def test_every_fused_kernel_compiles_for_an_h100(shape):
    cases = CASES if shape == "batch1-1024" else POOL_CASES
    for r in _compile(cases, "--shape", shape):
        kernels = r["compiled"]
        assert len(kernels) == cases[r["case"]], r
        for k in kernels:
            assert k["binary"], r
            assert k["shared"] <= H100_SHARED, f"{r['case']}: {k['kernel']} needs {k['shared']} bytes of shared memory"
            # every value stays in registers, whatever the storage (8-bit rows spilled 316 bytes in the first kernel
            # until it ran unpipelined, SLAKE's second kernel 16 until its victim's piece was summed 16 slots at a time)
            spilled = k["spill_stores"] + k["spill_loads"]
            assert spilled == 0, f"{r['case']}: {k['kernel']} spills {spilled} bytes to local memory ({k})"


#: other GPUs than the H100, each with the cases whose code or resources differ there (``slake.kernels.device_support``)
OTHER_GPUS = {
    # an A100: fp8 rows through their bits (Triton refused the kernels' e4m3 conversion before sm_89); the rest as on
    # an H100, within 163 KB of shared memory
    "cuda:80": {
        "slake": 2, "slake@bfloat16": 2, "slake@fp8_e4m3": 2, "tova@fp8_e4m3": 2, "ada-criticalkv": 3,
        "dense@fp8_e4m3": 2,
    },
    # Ada (an L40S, an RTX 4090) and consumer Blackwell (an RTX 5090, through Blackwell's own ptxas): 99 KB of shared
    # memory, which the full cache's float32 attention exceeds pipelined (it runs unpipelined there)
    "cuda:89": {"slake": 2, "ada-expected-attention@bfloat16": 2, "dense@float32": 2},
    "cuda:120": {"slake@bfloat16": 2, "tova@fp8_e4m3": 2, "dense@float32": 2},
    # a T4: float32 products (its half-precision ones spilled 988 bytes per thread in the first kernel), 64 KB of
    # shared memory (Expected Attention's first kernel took 81,920 bytes with half-precision products), fp8 bits
    "cuda:75": {"slake@float16": 2, "ada-expected-attention@float16": 2, "tova@fp8_e4m3": 2},
    # a B200 (Blackwell's ptxas, Hopper's shared memory)
    "cuda:100": {"slake@bfloat16": 2},
    # an MI300X: 64 KB of shared memory (float32 rows' first kernel and attention unpipelined), fp8 through the bits,
    # 64-lane warps
    "hip:gfx942": {
        "slake": 2, "slake@bfloat16": 2, "h2o@int8": 2, "tova@fp8_e4m3": 2, "ada-criticalkv": 3, "dense@float32": 2,
        "dense@fp8_e4m3": 2,
    },
}  # fmt: skip


@pytest.mark.gpu_compile
@pytest.mark.skipif(not _ptxas().exists(), reason="Triton's CUDA backend (ptxas) is not installed")
@pytest.mark.parametrize("target", list(OTHER_GPUS))
def test_the_fused_kernels_compile_for_other_gpus(target):
    """Every kernel of those cases compiles for the target (a cubin through the ``ptxas`` Triton uses for it, an
    hsaco for AMD), within the target's shared memory once a kernel that exceeds it pipelined is compiled
    unpipelined, as it is launched there (``slake.kernels.launch_cache.fitting``), and without spilling registers
    to memory (on AMD: no scratch memory; scalar registers spilled into vector lanes cost none). Before these
    targets were compiled here, an A100 refused every fp8 case, and an RTX 4090's or an MI300's first launch of
    float32 rows stopped on Triton's ``out of resource: shared memory``."""
    from gpu_targets import SHARED_LIMITS

    cases = OTHER_GPUS[target]
    backend, arch = target.split(":")
    limit = SHARED_LIMITS[arch if backend == "hip" else int(arch)]
    unpipelined = set()
    for r in _compile(cases, target=target):
        kernels = r["compiled"]
        assert len(kernels) == cases[r["case"]], r
        for k in kernels:
            if k["unpipelined"]:
                unpipelined.add((r["case"], k["kernel"]))
            assert k["binary"], r
            assert k["shared"] <= limit, f"{target} {r['case']}: {k['kernel']} needs {k['shared']} bytes"
            if backend == "hip":
                assert k["stack"] == 0, f"{target} {r['case']}: {k['kernel']} uses scratch memory ({k})"
            else:
                spilled = k["spill_stores"] + k["spill_loads"]
                assert spilled == 0, f"{target} {r['case']}: {k['kernel']} spills {spilled} bytes ({k})"
    # what needs the unpipelined launch there: float32 rows, pipelined, beyond 99 and 64 KB
    expected = {
        "cuda:89": {("dense@float32", "_dense_partials_kernel")},
        "cuda:120": {("dense@float32", "_dense_partials_kernel")},
        "hip:gfx942": {("dense@float32", "_dense_partials_kernel")}
        | {(case, "_append_logits_kernel") for case in ("slake", "ada-criticalkv")},
    }
    assert unpipelined == expected.get(target, set())


@pytest.mark.gpu_compile
@pytest.mark.skipif(not _ptxas().exists(), reason="Triton's CUDA backend (ptxas) is not installed")
def test_gemma3_heads_fit_a_gpu_of_99_kb():
    """Heads of 256 dims (Gemma 3's) on an RTX 4090: the full cache's bfloat16 attention over a static store
    (``--compile``) takes 141,568 bytes of shared memory pipelined, beyond the GPU's 99 KB (Triton refused to launch
    it), and is launched unpipelined there; the fused step's kernels fit as they are."""
    from gpu_targets import SHARED_LIMITS

    cases = {"dense@bfloat16": 2, "slake@bfloat16": 2}
    results = _compile(cases, "--shape", "head256", target="cuda:89")
    for r in results:
        for k in r["compiled"]:
            assert k["binary"] and k["shared"] <= SHARED_LIMITS[89], r
    unpipelined = {(r["case"], k["kernel"]) for r in results for k in r["compiled"] if k["unpipelined"]}
    assert unpipelined == {("dense@bfloat16", "_dense_partials_kernel")}


@pytest.mark.gpu_compile
@pytest.mark.skipif(not _ptxas().exists(), reason="Triton's CUDA backend (ptxas) is not installed")
def test_the_second_kernel_compiles_without_the_parts_kernel_parts_leaves_out():
    """``python -m benchmarks kernel-parts`` times SLAKE's second kernel with each of its parts left out
    (``launch_config.leaving_out``): every part left out at once takes each alternative the kernel has, and it
    compiles for an H100 (a variant that does not would cost a GPU session its measurement)."""
    from slake.kernels.launch_config import SKIP_PARTS

    (r,) = _compile({"slake@bfloat16": 2}, "--leave-out", ",".join(SKIP_PARTS))
    assert [k["kernel"] for k in r["compiled"]] == ["_append_logits_kernel", "_evict_attend_kernel"], r
    assert all(k["binary"] for k in r["compiled"]), r


@pytest.mark.gpu_compile
@pytest.mark.skipif(not _ptxas().exists(), reason="Triton's CUDA backend (ptxas) is not installed")
@pytest.mark.parametrize(
    "variant", ["COMBINE=8,RECOMPUTE_BLOCK=64,TARGET_PROGRAMS=512", "WIDE_WARPS=16", "POOL_GATHER=0,SHORT_KEYS=0"]
)
def test_the_second_kernel_compiles_with_the_launch_constants_kernel_tune_tries(variant):
    """``python -m benchmarks kernel-tune`` times the step with other launch constants (``benchmarks.pool
    .TUNE_VARIANTS``): the ones that take the most of a program (the most pieces and slots in flight; 16 warps, whose
    threads get 128 registers each) and the pooling of before (through memory, int64 keys) compile for an H100, so
    that a GPU session does not lose its measurement."""
    (r,) = _compile({"slake@bfloat16": 2}, "--tune", variant)
    assert [k["kernel"] for k in r["compiled"]] == ["_append_logits_kernel", "_evict_attend_kernel"], r
    assert all(k["binary"] for k in r["compiled"]), r
    if variant.startswith("WIDE_WARPS"):
        assert r["compiled"][1]["warps"] == 16, r


#: one case per family of decode rule in the blockwise form of wide rows (``slake.kernels.triton_wide``): pooled with
#: its order (SLAKE, CAKE's window), accumulated over int8 rows, sharpened, the layer's mean, key diversity, mapped
#: queries, pinned recency with per-head visibility, SLAKE in float32
WIDE_CASES = {
    "slake@bfloat16": 2, "cake@bfloat16": 2, "h2o@int8": 2, "ahakv@bfloat16": 2, "tova@bfloat16": 2,
    "keydiff@bfloat16": 2, "ada-expected-attention@bfloat16": 2, "sagekv": 2, "slake": 2,
    "kvzip[decode_scope=layer]@bfloat16": 3, "ada-criticalkv": 3, "ada-snapkv[decode_scope=layer]@bfloat16": 3,
    "criticalkv[scorer=expected-attention,window=0]@bfloat16": 3,
}  # fmt: skip


@pytest.mark.gpu_compile
@pytest.mark.skipif(not _ptxas().exists(), reason="Triton's CUDA backend (ptxas) is not installed")
def test_the_blockwise_form_of_wide_rows_compiles_for_an_h100():
    """Rows wider than ``WIDE_SLOTS`` (16,384) are read in blocks of ``WIDE_BLOCK`` (1,024) slots: lowered to 512 here
    so that Llama-3-8B's rows of 1,025 slots take that form, which compiles as it would for a budget of 32K (the
    width is specialized only on its divisibility by 16). Every rule family compiles for an H100 within its shared
    memory and without spilling, with 8 warps per program; CriticalKV's two stages (the radix select of their
    threshold) and the eviction across a layer's KV heads (its tail reading the row back in blocks) with their third
    kernel."""
    for r in _compile(WIDE_CASES, "--tune", "WIDE_SLOTS=512,WIDE_BLOCK=1024"):
        names = [k["kernel"] for k in r["compiled"]]
        assert len(names) == WIDE_CASES[r["case"]] and names[0] == "_append_logits_kernel", r
        wide = r["compiled"][names.index("_evict_attend_kernel")]
        assert wide["binary"] and wide["shared"] <= H100_SHARED and wide["warps"] == 8, r
        for k in r["compiled"]:
            assert k["spill_stores"] + k["spill_loads"] == 0, r


@pytest.mark.gpu_compile
@pytest.mark.skipif(not _ptxas().exists(), reason="Triton's CUDA backend (ptxas) is not installed")
def test_the_dense_attention_compiles_for_an_h100():
    """The full cache's masked step over a static store of 128K slots (``slake.kernels.triton_dense``, two kernels)
    compiles for an H100 in float32 and bfloat16 and over int8 and fp8 rows, within its shared memory and without
    spilling."""
    cases = {"dense@float32": 2, "dense@bfloat16": 2, "dense@int8": 2, "dense@fp8_e4m3": 2}
    for r in _compile(cases):
        assert [k["kernel"] for k in r["compiled"]] == ["_dense_partials_kernel", "_dense_combine_kernel"], r
        for k in r["compiled"]:
            assert k["binary"] and k["shared"] <= H100_SHARED, r
            assert k["spill_stores"] + k["spill_loads"] == 0, r


def test_layers_whose_rows_differ_in_width_share_one_compilation():
    """Per-layer budgets (CAKE, SLAKE, PyramidKV) give a model's layers rows of different widths. Triton's JIT
    compiles a kernel once per specialization of its arguments, and it specialized the integers that follow a
    row's width (the number of pieces, the block size, the metadata's and scales' strides) on their values: layers
    of 71 and 72 slots compiled each kernel twice (9 and 7 compilations of SLAKE's two kernels for one 32-layer
    model), seconds each before a GPU's first token. With ``launch_config.UNSPECIALIZED`` not specialized, rows of
    71, 72 and 101 slots (whose powers of two and pieces agree) make one compilation of each kernel, in every
    layout: 8-bit scales, per-head visibility, CriticalKV's slot weights and projection."""
    cases = {"slake@bfloat16": 2, "snapkv@int8": 2, "sagekv@bfloat16": 2, "ada-criticalkv": 3}
    for r in _compile(cases, "--keys", "70,71,100"):
        assert len(r["compilations"]) == cases[r["case"]], r
        assert set(r["compilations"].values()) == {1}, r


def test_every_unspecialized_argument_is_a_kernel_parameter_marked_so():
    """:data:`~slake.kernels.launch_config.UNSPECIALIZED` names parameters of the kernels (a misspelt name would be
    ignored by Triton, silently), and every kernel that takes one of them marks it."""
    import inspect

    from slake import kernels
    from slake.kernels import launch_config, triton_dense, triton_rules

    mod = kernels.load()
    found: set[str] = set()
    for kernel in (mod._evict_attend_kernel, mod._append_logits_kernel, triton_rules._value_projection_kernel,
                   mod._layer_eviction_kernel, triton_dense._dense_partials_kernel,
                   triton_dense._dense_combine_kernel):  # fmt: skip
        fn = getattr(kernel, "fn", kernel)
        names = set(inspect.signature(fn).parameters)
        if hasattr(kernel, "params"):  # compiled mode (a JITFunction)
            marked = {p.name for p in kernel.params if p.do_not_specialize}
        else:  # the interpreter keeps the decorator's arguments
            marked = set(kernel.kwargs.get("do_not_specialize") or ())
        taken = names & set(launch_config.UNSPECIALIZED)
        assert taken <= marked, (fn.__name__, taken - marked)
        found |= taken
    assert found == set(launch_config.UNSPECIALIZED)
