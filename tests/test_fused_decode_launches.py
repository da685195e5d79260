"""How the fused decode step is launched and when: at most four launches per layer and step (the transformers engine
and the vLLM pool) and the torch step's operation counts; which steps take the kernels (a rule without a fused form,
prompts within the budget, layers that do not evict) and which kernels a Triton version and a device get; the launch
constants, plans and left-out parts; the fused arguments and held steps made once and again when their sources
change, with their shared scratch arena."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import fused_cases
from fused_cases import BS, BUDGET, DEVICE, D, G, H, _assert_same, _method, _pool_run, _run
from slake.cache.compressed import CompressedKV, resolve_kernels
from slake.engines.vllm.plugin.paged import FlashAttnLayout, slot_blocks
from slake.kernels import launch_config
from slake.methods import make_method

#: runs the same under any transformers (none is loaded here): ``make test-oldest`` skips it (tests/test_tiers.py)
pytestmark = pytest.mark.transformers_free

#: the fixtures, bound here by name (imported, each test's argument of that name would redefine it: ruff's F811)
split_rows = fused_cases.split_rows
wide_rows = fused_cases.wide_rows


# ---------------------------------------------------------------------------------------------- launches
class _Launches(TorchDispatchMode):
    """Counts the torch operations that launch work (not views, not allocations); the fused op itself is counted
    through its Triton kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if not (func.is_view or "empty" in name or name.startswith("slake::") or name == "aten::lift_fresh"):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _counted_kernels(monkeypatch) -> list:
    """The Triton kernels launched from now on (each launch appends its kernel)."""
    from slake.kernels import triton_decode

    launched: list = []

    class Counting:
        def __init__(self, kernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(self.kernel)
            launch = self.kernel[grid]

            def run(*args, **kwargs):  # one launch: what Triton's interpreter does inside it is not counted
                with _disable_current_modes():
                    return launch(*args, **kwargs)

            return run

    for kernel in ("_append_logits_kernel", "_value_projection_kernel", "_evict_attend_kernel",
                   "_layer_eviction_kernel"):  # fmt: skip
        monkeypatch.setattr(triton_decode, kernel, Counting(getattr(triton_decode, kernel)))
    return launched


def _count_one_step(name: str, kernels: str, monkeypatch) -> int:
    launched = _counted_kernels(monkeypatch)
    method = _method(name)
    eng, _ = _run(method, kernels, steps=1, layers=1)
    q, k, v = (torch.randn(2, n, 1, D, device=DEVICE) for n in (H * G, H, H))
    eng.append(0, k, v)
    launched.clear()
    with _Launches() as mode:
        eng.decode_attention(0, q, D**-0.5)
    return len(mode.ops) + len(launched)


@pytest.mark.parametrize("name", ["snapkv", "slake", "tova", "ahakv", "keydiff", "kvzip", "expected-attention",
                                  "criticalkv", "ada-criticalkv", "ada-snapkv[decode_scope=layer]"])  # fmt: skip
def test_one_fused_step_of_one_layer_is_at_most_four_launches(name, monkeypatch):
    assert _count_one_step(name, "triton", monkeypatch) <= 4
    # the counter sees the torch step's operations (a count that cannot pass by accident)
    assert _count_one_step(name, "torch", monkeypatch) > 20


#: torch operations of one torch step of one layer in the transformers engine (docs/gpu.md's table): on a CPU each
#: costs a few microseconds whatever its size, so the step costs its count; a change that adds operations fails here
TORCH_STEP_OPS = {"tova": 30, "h2o": 40, "snapkv": 42, "cake": 42, "ahakv": 55, "slake": 65}


@pytest.mark.parametrize("name", sorted(TORCH_STEP_OPS))
def test_the_torch_step_of_one_layer_stays_within_its_operation_count(name, monkeypatch):
    assert _count_one_step(name, "torch", monkeypatch) <= TORCH_STEP_OPS[name]


class _AllOps(TorchDispatchMode):
    """Every operator name dispatched, custom operators included."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def test_eager_fused_step_calls_the_kernels_without_the_custom_operator():
    """The custom operator exists for torch.compile; in eager code its Python dispatch cost ~0.35 ms per call on a CPU
    host (more than the rest of the layer's step), so eager code calls the kernels' function directly."""
    eng, _ = _run(_method("slake"), "triton", steps=1, layers=1)
    q, k, v = (torch.randn(2, n, 1, D, device=DEVICE) for n in (H * G, H, H))
    eng.append(0, k, v)
    with _AllOps() as mode:
        eng.decode_attention(0, q, D**-0.5)
    assert not [op for op in mode.ops if op.startswith("slake::")]
    assert mode.ops  # the mode saw the step


def test_one_fused_pool_step_of_one_layer_is_at_most_four_launches(monkeypatch):
    """The vLLM pool's ``decode_layer`` for three requests: the two kernels, nothing else (the rows are a slice)."""
    pool, cache, _ = _pool_run("slake", "triton", FlashAttnLayout(), True)
    launched = _counted_kernels(monkeypatch)
    rows = torch.arange(3, device=DEVICE)
    table = torch.stack([torch.arange(8, device=DEVICE) + 1 + 8 * r for r in range(3)])
    blocks, offsets = slot_blocks(table, BUDGET + 1, BS)
    newest = pool.seen.index_select(0, rows).view(-1, 1, 1)
    q, k, v = (torch.randn(3, n, D, device=DEVICE) for n in (H * G, H, H))
    with _Launches() as mode:
        pool.decode_layer(0, slice(0, 3), table, blocks, offsets, newest, q, k, v, cache, D**-0.5)
    assert len(mode.ops) + len(launched) == 2, mode.ops
    assert pool.report.steps == {"triton": 5}


# ---------------------------------------------------------------------------------------------- choosing kernels
def test_a_step_the_kernels_do_not_cover_runs_in_torch_and_says_why(caplog, monkeypatch):
    """A method whose decode rule has no fused form (here, a subclass with its own rule) runs the torch step; the
    report names the reason and a warning is logged once (per process: the reasons already said are forgotten here)."""
    from slake.cache import fused_step
    from uncovered_rule import Reversed  # SnapKV with its own rule, which has no fused form

    monkeypatch.setattr(fused_step, "_LOGGED", set())
    method = Reversed(window=4)
    with caplog.at_level("WARNING", logger="slake.kernels"):
        eng, _ = _run(method, "triton", steps=2, layers=1)
    assert eng.decoder.report.steps == {"torch": 2}
    assert "no fused form" in eng.decoder.report.summary()
    assert sum("fused decode kernels do not cover" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "prefix"])
@pytest.mark.parametrize("name", ["slake", "cake[linear_cache=true]", "snapkv"])
def test_a_prompt_within_the_budget_decodes_as_the_full_cache_does(name, pad, caplog):
    """A batch whose prompts all fit the budget is not compressed: no layer evicts at decode and nothing is folded,
    so the step is the full cache's (the token's write and one attention), for the methods with a linear state too.
    It was the torch step for SLAKE and ``cake[linear_cache=true]`` (the linear-state flag of the method, not the
    layer's state, chose it), which the fused kernels do not cover: on a GPU its 40-odd operations per layer, and a
    warning that the kernels were not used for a cache that has nothing for them to do."""
    full, full_out = _run(make_method("full"), "torch", S=20, budget=24, steps=3, pad=pad)
    for kernels in ("torch", "triton"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="slake.kernels"):
            eng, outs = _run(_method(name), kernels, S=20, budget=24, steps=3, pad=pad)
        assert all(t is None for t in eng.targets)
        # a padded row's masked attention is the dense kernels; a prefix is one SDPA call, reported as such
        if kernels == "triton":
            assert eng.decoder.report.steps == ({"triton": 6} if pad else {"sdpa": 6}), eng.decoder.report.summary()
        assert not any("do not cover" in r.message for r in caplog.records)
        for a, b in zip(full_out, outs, strict=True):
            torch.testing.assert_close(b.float(), a.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name",
    ["slake[decode_eviction=false]", "cake[linear_cache=true,decode_eviction=false]", "sagekv[decode_eviction=false]"],
)
def test_a_layer_that_does_not_evict_but_keeps_a_linear_state_or_hidden_slots_runs_the_kernels(
    name, split_rows, monkeypatch
):
    """Compressed at prefill, then append-only (``decode_eviction=False``, kvpress's protocol): SLAKE's layers keep
    the evicted tokens' linear state and SAGE-KV's the slots hidden from some query heads, so their steps are not the
    full cache's. They ran the torch step (31 operations per layer for SLAKE); the kernels now run them with a target
    of -1 and no rule (``KEEP_ALL``: nothing scored, no victim sought): the same outputs, linear state, slots and
    stored scores (the new slot's 0, as the torch step's), every row growing by a token per step. The rows grow 3
    slots at a time here (256 by default), twice in four steps, so that the held arguments are made again (the test
    patched the growth of multi-token appends instead, and its rows grew once, by 256: nine times the programs)."""
    from slake.cache import state

    monkeypatch.setattr(state, "_GROWTH", 3)
    method = _method(name)
    ref, ref_out = _run(method, "torch", steps=4)
    fused, fused_out = _run(method, "triton", steps=4)
    assert not any(fused.decoder.state.scored(li) for li in range(2))
    assert fused.decoder.report.steps == {"triton": 8}, fused.decoder.report.summary()
    kept = [s.valid.sum(-1) for s in fused.layers]
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    shorter, _ = _run(method, "torch", steps=0)  # the prefill's kept counts: 4 steps add 4 slots to every row
    for k, s, f in zip(kept, shorter.layers, fused.layers, strict=True):
        assert torch.equal(k, s.valid.sum(-1) + 4)
        assert f.valid.shape[-1] == s.valid.shape[-1] + 2 * 3  # grown twice


def test_kernel_choice_is_checked():
    with pytest.raises(ValueError, match="unknown kernels"):
        CompressedKV("snapkv", 64, 2, kernels="cuda")
    assert resolve_kernels("auto", "cpu") == "torch"
    assert resolve_kernels("torch", "cpu") == "torch"


def test_an_old_triton_is_refused_and_auto_is_the_torch_step_with_it(monkeypatch, caplog):
    """Triton 3.3 (torch 2.7's) has no run-time knobs for the launches to read and its interpreter does not take the
    kernels: on a GPU with it ``"auto"`` is the torch step, said once, and ``"triton"`` is refused with the versions
    named; Triton 3.4 (torch 2.8's) is the oldest taken."""
    import slake.kernels
    from slake.cache import compressed

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(compressed, "_told_old", False)
    monkeypatch.setattr(slake.kernels, "triton_version", lambda: (3, 3, 1))
    with caplog.at_level("WARNING", logger="slake.kernels"):
        assert resolve_kernels("auto", "cuda") == "torch"
        assert resolve_kernels("auto", "cuda") == "torch"
    assert sum("need Triton 3.4 or later, and this is 3.3.1" in r.message for r in caplog.records) == 1
    with pytest.raises(ValueError, match="needs Triton 3.4 or later, and this is 3.3.1; use kernels='torch'"):
        resolve_kernels("triton", "cpu")
    monkeypatch.setattr(slake.kernels, "triton_version", lambda: (3, 4, 0))
    assert resolve_kernels("auto", "cuda") == "triton" and resolve_kernels("triton", "cpu") == "triton"


def test_the_triton_version_is_read_from_its_release_string(monkeypatch):
    import triton

    from slake.kernels import triton_version

    for text, parsed in (("3.6.0", (3, 6, 0)), ("3.4.0+rocm6.4.1", (3, 4, 0)), ("3.7.0rc1", (3, 7, 0))):
        monkeypatch.setattr(triton, "__version__", text)
        assert triton_version() == parsed


def test_auto_is_the_torch_step_on_an_amd_gpu_and_says_so(monkeypatch, caplog):
    """On an NVIDIA GPU ``"auto"`` is the fused kernels; on an AMD one (a ROCm build of torch: ``torch.version.hip``
    set, devices still ``"cuda"``) the torch step, with a warning once, since the kernels compile for it but have
    not run on one; ``"triton"`` asked for is the kernels there too."""
    from slake.cache import compressed

    monkeypatch.setattr(torch.version, "hip", None)
    assert resolve_kernels("auto", "cuda") == "triton"
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(compressed, "_told_amd", False)
    with caplog.at_level("WARNING", logger="slake.kernels"):
        assert resolve_kernels("auto", "cuda") == "torch"
        assert resolve_kernels("auto", "cuda:1") == "torch"
    assert sum("have not run on an AMD GPU" in r.message for r in caplog.records) == 1
    assert resolve_kernels("triton", "cuda") == "triton"


# ---------------------------------------------------------------------------------------------- launch configuration
def test_rows_are_split_over_programs_when_few_rows_would_leave_a_gpu_idle():
    """One row of 8 KV heads at 1,056 slots (batch 1, budget 1024 on Llama-3-8B) runs as 17 programs per head, not
    one; 32 rows of 8 heads already fill a GPU and are not split; a split is never under MIN_SPLIT slots."""
    assert launch_config.split_size(1056, 8) == 64
    assert launch_config.split_size(1056, 256) >= 1056
    assert launch_config.split_size(40, 8) == launch_config.MIN_SPLIT
    for width in (1, 17, 1000, 16384):
        for programs in (1, 8, 64, 1000):
            split = launch_config.split_size(width, programs)
            assert split >= launch_config.MIN_SPLIT and split & (split - 1) == 0


@pytest.mark.parametrize(
    "constants",
    [
        {"COMBINE": 1, "RECOMPUTE_BLOCK": 16, "MIN_SPLIT": 16, "TARGET_PROGRAMS": 512},  # many pieces, one at a time
        {"COMBINE": 8, "MIN_SPLIT": 16, "TARGET_PROGRAMS": 1, "WIDE_WARPS": 16},  # one piece per row
        {"POOL_GATHER": 0, "SHORT_KEYS": 0},  # the pooling of before, through memory, on int64 keys
        {"HELD_ORDER": 0},  # every row sorted at every step
        {"NEW_TOKEN_APART": 0},  # the pooled rules over the row's slots, the new token's among them
    ],
)
def test_launch_constants_change_how_the_step_is_cut_not_what_it_computes(constants):
    """``launch_config.tuned`` (``python -m benchmarks kernel-tune``): SLAKE's step with rows cut into more or fewer
    pieces, combined more or fewer at a time, pooled as before (through memory), sorted at every step, or pooled over
    the row's slots with the new token among them, equals the torch step; bad constants are refused."""
    method = _method("slake")
    ref, ref_out = _run(method, "torch")
    with launch_config.tuned(**constants):
        assert all(getattr(launch_config, k) == v for k, v in constants.items())
        fused, fused_out = _run(method, "triton")
    assert launch_config.COMBINE == 4 and launch_config.MIN_SPLIT == 64 and launch_config.POOL_GATHER  # restored
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    bad_values = ({"COMBINE": 0}, {"MIN_SPLIT": 24}, {"WIDE_WARPS": 2}, {"BLOCK": 8}, {"COMBINE": True})
    for bad in (*bad_values, {"SHORT_KEYS": 2}, {"POOL_GATHER": True}, {"HELD_ORDER": -1}, {"NEW_TOKEN_APART": 2}):
        with pytest.raises(ValueError):
            with launch_config.tuned(**bad):
                pass


def test_leaving_out_a_part_of_the_second_kernel_is_for_timing_only():
    """``launch_config.leaving_out`` (``python -m benchmarks kernel-parts``) launches the second kernel without a
    part: every variant runs; without the fold SLAKE's ``d x d`` state keeps what the prefill left, where a real
    step folds each victim into it; outside the block the step is the real one again."""
    m = _method("slake")
    run = dict(B=1, steps=2, layers=1, pad=False)
    prefilled, _ = _run(m, "triton", **{**run, "steps": 0})
    real, real_out = _run(m, "triton", **run)
    d = prefilled.layers[0].keys.shape[-1]
    block = prefilled.layers[0].linear.aug[..., :d, :d]
    assert not torch.equal(real.layers[0].linear.aug[..., :d, :d], block)  # the real step folded its victims
    for part in launch_config.SKIP_PARTS:
        with launch_config.leaving_out(part):
            eng, outs = _run(m, "triton", **run)
        assert all(bool(torch.isfinite(o).all()) for o in outs), part
        if part == "fold":
            assert torch.equal(eng.layers[0].linear.aug[..., :d, :d], block)
    again, again_out = _run(m, "triton", **run)
    for a, b in zip(real_out, again_out, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown kernel parts"):
        with launch_config.leaving_out("everything"):
            pass


@pytest.mark.parametrize("name", ["slake", "snapkv", "h2o", "keydiff", "criticalkv"])
def test_the_second_kernel_holds_a_row_of_budget_plus_one_slots_in_pow2_budget_lanes(name, monkeypatch):
    """A row is its budget plus one slot wide (the slot the next token is written into). With the new token apart
    (``launch_config.NEW_TOKEN_APART``) the second kernel's vectors are ``pow2(budget)`` wide, not twice that: for
    every rule but CriticalKV's two stages, which keep the row's slots in slot order; with it off, for none."""
    from slake.kernels import load, triton_decode

    load()
    seen: list[tuple[int, bool]] = []
    kernel = triton_decode._evict_attend_kernel

    class Recording:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*args, **kwargs):
                seen.append((kwargs["BW"], kwargs["APART"]))
                return launch(*args, **kwargs)

            return run

    monkeypatch.setattr(triton_decode, "_evict_attend_kernel", Recording())
    run = dict(B=1, pad=False, steps=2, layers=1, budget=16)
    eng, _ = _run(_method(name), "triton", **run)
    assert eng.layers[0].positions.shape[-1] == 17  # budget + 1
    apart = name != "criticalkv"
    assert seen == [(16, True)] * 2 if apart else seen == [(32, False)] * 2
    seen.clear()
    with launch_config.tuned(NEW_TOKEN_APART=0):
        _run(_method(name), "triton", **run)
    assert seen == [(32, False)] * 2


def test_a_steps_launch_plan_is_made_once_and_follows_the_launch_configuration(monkeypatch):
    """The launches' constants are worked out once per shape, flags and launch configuration
    (``step_plan.launch_plan``): later steps of the same layer reuse them, and a change of a launch constant (by
    ``tuned``, ``leaving_out`` or an assignment) or of the first kernel's split takes effect at the next step."""
    from slake.kernels import load, step_plan, triton_decode

    load()
    seen: list[dict] = []
    kernel = triton_decode._evict_attend_kernel

    class Recording:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*args, **kwargs):
                seen.append(kwargs)
                return launch(*args, **kwargs)

            return run

    monkeypatch.setattr(triton_decode, "_evict_attend_kernel", Recording())
    step_plan._PLANS.clear()
    run = dict(B=1, pad=False, steps=3, layers=1, budget=16)
    _run(_method("slake"), "triton", **run)
    assert len(step_plan._PLANS) == 1 and len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert seen[0]["COMBINE"] == launch_config.COMBINE and seen[0]["SKIP"] == 0 and seen[0]["KEY_SPAN"] > 0
    seen.clear()
    with launch_config.tuned(COMBINE=8, NEW_TOKEN_APART=0):
        _run(_method("slake"), "triton", **run)
    assert [(k["COMBINE"], k["BW"], k["APART"]) for k in seen] == [(8, 32, False)] * 3
    seen.clear()
    with launch_config.leaving_out("fold"):
        _run(_method("slake"), "triton", **run)
    assert [k["SKIP"] for k in seen] == [launch_config.SKIP_PARTS["fold"]] * 3
    seen.clear()
    monkeypatch.setattr(launch_config, "SHORT_KEYS", False)
    monkeypatch.setattr(launch_config, "MIN_SPLIT", 16)  # rows of 17 slots in two pieces of 16
    _run(_method("slake"), "triton", **run)
    assert [(k["KEY_SPAN"], k["SPLIT"], k["COMBINE"]) for k in seen] == [(0, 16, launch_config.COMBINE)] * 3
    assert len(step_plan._PLANS) == 4


def _count_fused_arguments(monkeypatch, *modules) -> list[int]:
    """Count the calls of ``fused_step.fused_arguments`` made through ``modules`` (each module's name for it replaced
    by a counting wrapper); the returned list grows by one per call."""
    from slake.cache import fused_step

    made: list[int] = []
    real = fused_step.fused_arguments

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, "fused_arguments", counting)
    return made


def test_a_layers_fused_arguments_are_made_once_and_again_when_what_they_came_from_is_replaced(monkeypatch):
    """In eager decoding the transformers engine makes a layer's fused-step arguments once
    (``fused_step.fused_arguments``) and reuses them while every object they were made from is the same
    (``Decoder._fused_sources``): replacing one of them, as a reordered batch, a grown store or a new prefill does,
    makes them again, and every step still equals the torch step."""
    from slake.cache import decoding

    made = _count_fused_arguments(monkeypatch, decoding)
    method = _method("slake")
    ref, ref_out = _run(method, "torch", steps=4)
    fused, fused_out = _run(method, "triton", steps=4)
    assert len(made) == 2  # one per layer; the three later steps of each reuse them
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)

    def replace(eng):  # the same contents in new tensors: the arguments' old ones are no longer the store's
        for st in eng.layers:
            st.scores, st.positions = st.scores.clone(), st.positions.clone()
        eng.state.targets[1] = eng.state.targets[1].clone()

    made.clear()
    ref, ref_out = _run(method, "torch", steps=4, meddle=(2, replace))
    fused, fused_out = _run(method, "triton", steps=4, meddle=(2, replace))
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    assert len(made) == 4  # the first step and the one after the replacement, per layer
    assert fused.decoder.report.steps == {"triton": 8}


def test_the_layers_held_steps_share_one_scratch_arena_and_carve_it_again_when_it_grows():
    """Eager decoding holds each layer's fused step (:class:`slake.kernels.held_step.HeldStep`) with its scratch
    carved from one arena the layers share. A layer widened mid-decode makes its step again with more scratch than
    the arena holds: the arena grows, the other layer carves its scratch again at its next step, and every step
    still equals the torch step."""
    from slake.kernels.held_step import HeldStep

    method = _method("slake")

    def widen(eng):  # layer 1's rows get 40 more free slots: new tensors, so a new held step
        eng.layers[1]._grow(40)

    ref, ref_out = _run(method, "torch", steps=4, meddle=(2, widen))
    fused, fused_out = _run(method, "triton", steps=4, meddle=(2, widen))
    _assert_same(ref, ref_out, fused, fused_out, 1e-5)
    arena = fused.decoder._arena
    assert arena.generation == 2 and len(arena._flat) == 1  # made once, grown once, one device
    (flat,) = arena._flat.values()
    for li in range(2):
        step = fused.decoder._fused[li][3]
        assert isinstance(step, HeldStep) and step._made[1] == arena.generation
        carved = [
            t for run in step._made[2] for t in run.args
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        ]  # fmt: skip
        assert len({t.storage_offset() for t in carved}) >= 4, li  # x, stat, part, newslot and the linear share


def test_steps_made_afresh_equal_held_steps(monkeypatch):
    """With :data:`~slake.kernels.launch_config.HELD_STEP` off, each step makes its scratch and launch arguments
    again (:class:`slake.kernels.held_step.Afresh`), with the same results."""
    from slake.kernels.held_step import Afresh

    monkeypatch.setattr(launch_config, "HELD_STEP", False)
    for name in ("snapkv", "criticalkv"):
        method = _method(name)
        ref, ref_out = _run(method, "torch", steps=3)
        fused, fused_out = _run(method, "triton", steps=3)
        _assert_same(ref, ref_out, fused, fused_out, 1e-5)
        assert isinstance(fused.decoder._fused[0][3], Afresh) and fused.decoder._arena is not None


def test_the_scratch_arena_carves_aligned_buffers_that_do_not_overlap():
    """:class:`slake.kernels.held_step.ScratchArena`: views of one float32 buffer per device, each starting on a
    multiple of 128 bytes, none overlapping; grown to at least twice its size when a carve needs more, which
    ``generation`` counts; 4-byte dtypes only."""
    from slake.kernels.held_step import ScratchArena

    cpu = torch.device("cpu")
    arena = ScratchArena()
    specs = (((2, 3, 5), torch.float32), None, ((7,), torch.int32), ((1, 33), torch.float32))
    a, unused, b, c = arena.carve(specs, cpu)
    assert unused is None and a.shape == (2, 3, 5) and b.shape == (7,) and b.dtype == torch.int32
    assert c.shape == (1, 33) and c.dtype == torch.float32
    spans = sorted((t.storage_offset(), t.storage_offset() + t.numel()) for t in (a, b, c))
    assert all(start % 32 == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert arena.generation == 1 and arena.nbytes() == 4 * (32 + 32 + 64)  # each rounded up to 32 elements
    arena.carve(specs, cpu)
    assert arena.generation == 1  # it fits: the same buffer
    (big,) = arena.carve((((200,), torch.float32),), cpu)
    assert arena.generation == 2 and big.numel() == 200 and arena.nbytes() == 4 * 2 * 128  # twice its size
    with pytest.raises(ValueError, match="4-byte"):
        arena.carve((((4,), torch.float16),), cpu)


def test_a_step_the_kernels_do_not_cover_works_out_the_fused_arguments_once(monkeypatch, wide_rows):
    """A step the fused kernels do not cover (a positional pooling over rows wider than the kernels' vectors, in a
    store without the order to rank them by) runs the torch step, says why, and works out the fused arguments once
    per step, not again inside the torch fallback."""
    from slake.cache import decoding, fused_step

    made = _count_fused_arguments(monkeypatch, decoding, fused_step)
    monkeypatch.setattr(decoding, "keeps_order", lambda method, kernels: False)
    method = _method("ada-snapkv", decode_scope="layer")
    ref, ref_out = _run(method, "torch", steps=2)
    fused, fused_out = _run(method, "triton", steps=2)
    assert len(made) == 4  # two layers, two steps, once each
    assert "without their order by position" in fused.decoder.report.summary()
    for a, b in zip(ref_out, fused_out, strict=True):
        torch.testing.assert_close(b, a)


def test_a_release_string_reads_as_its_leading_numbers():
    from slake.release import release

    cases = {"2.8.0+cu128": (2, 8, 0), "2.10.0a0+git1": (2, 10, 0), "3.7.0rc1": (3, 7, 0), "3.4.0+rocm6.4": (3, 4, 0)}
    for text, parsed in cases.items():
        assert release(text) == parsed
    assert release("2.9.0") >= (2, 9) > release("2.8.1")
