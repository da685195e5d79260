"""Launches without Triton's per-call binding (:mod:`slake.kernels.launch_cache`): the key is at least as fine as
Triton's own specialization, checked against the binder Triton builds for its CUDA backend (which runs without a
GPU) on the arguments of real fused steps; and the launcher's bookkeeping (when it goes through Triton, what it
hands the compiled kernel) with stand-ins for a kernel and a driver. The launches themselves need a GPU:
``tests/test_cuda.py``."""

from __future__ import annotations

import importlib
import inspect
import random

import pytest
import torch

from slake.kernels import launch_cache, launch_config, load
from slake.kernels.launch_cache import CachedLaunch, cached, launch_key

pytestmark = pytest.mark.transformers_free

KERNELS = ("_append_logits_kernel", "_value_projection_kernel", "_evict_attend_kernel", "_layer_eviction_kernel")


def _triton_binder(kernel):
    """The function Triton's ``JITFunction.run`` binds and specializes a launch's arguments with, built for the
    CUDA backend of an sm_90 GPU from ``kernel``'s Python signature: ``(args, kwargs) -> specialization``."""
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import KernelParam, create_function_from_signature

    sig = inspect.signature(kernel.fn)
    params = [KernelParam(i, p, False, False) for i, p in enumerate(sig.parameters.values())]
    binder = create_function_from_signature(sig, params, backends["nvidia"].compiler(GPUTarget("cuda", 90, 32)))
    return lambda args, kwargs: binder(*args, **kwargs)[1]


@pytest.fixture(scope="module")
def recorded_launches():
    """The arguments of the fused step's launches for SLAKE, SnapKV, CriticalKV (its projection kernel too) and KVzip
    across a layer's KV heads (its layer kernel too), bf16 keys,
    a padded batch, recorded by stand-ins in the kernels' place: ``[(kernel, args, kwargs)]``."""
    decode = load()
    import fused_cases as harness

    seen: list = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append((self.kernel, args, kwargs))

    saved = {name: getattr(decode, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(decode, name, Recorder(saved[name]))
        for method in ("slake", "snapkv", "criticalkv", "kvzip[decode_scope=layer]"):
            harness._run(harness._method(method), "triton", steps=1, layers=1, dtype=torch.bfloat16)
    finally:
        for name, kernel in saved.items():
            setattr(decode, name, kernel)
    assert len({id(k) for k, _, _ in seen}) == 4 and len(seen) == 10
    return seen


def _variants(args: tuple, rng: random.Random) -> list[tuple]:
    """Copies of ``args`` with one argument changed in a way Triton's specialization may or may not see: a tensor
    moved off (or onto) a 16-byte boundary, or given another dtype; an integer set to 0, 1, 2, 16, 17, -16,
    2**31, 2**31 + 16 or 2**63; a bool flipped; a float changed."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            flat = torch.zeros(a.numel() + 8, dtype=a.dtype)
            for shift in (0, 1, 4):
                out.append(args[:i] + (flat[shift : shift + a.numel()],) + args[i + 1 :])
            other = torch.int32 if a.dtype != torch.int32 else torch.int64
            out.append(args[:i] + (a.to(other),) + args[i + 1 :])
        elif isinstance(a, bool):
            out.append(args[:i] + (not a,) + args[i + 1 :])
        elif isinstance(a, int):
            for v in rng.sample([0, 1, 2, 16, 17, -16, 2**31, 2**31 + 16, 2**63, a + 1, a * 16], 4):
                out.append(args[:i] + (v,) + args[i + 1 :])
            out.append(args[:i] + (bool(a),) + args[i + 1 :])  # True == 1 and hashes alike: the key must not
        elif isinstance(a, float):
            out.append(args[:i] + (a * 3.0 + 1.0,) + args[i + 1 :])
    return out


def test_equal_keys_mean_equal_triton_specializations(recorded_launches):
    """Over the recorded launches and one-argument variants of each, two argument lists with one
    :func:`launch_key` get one specialization from Triton's CUDA binder: a cached kernel is never launched with
    arguments Triton would have compiled apart. And the key is not so fine that it never repeats: the same
    arguments in fresh tensors of the same dtypes (as every step allocates) key alike."""
    rng = random.Random(0)
    for kernel, args, kwargs in recorded_launches:
        spec = _triton_binder(kernel)
        lists = [args, *_variants(args, rng)]
        by_key: dict[tuple, list] = {}
        for a in lists:
            by_key.setdefault(launch_key(a), []).append(spec(a, kwargs))
        for specs in by_key.values():
            assert all(s == specs[0] for s in specs), "one key, two specializations"
        # every variant Triton specializes differently keys apart, so the key saw it
        assert len(by_key) >= len({tuple(map(str, spec(a, kwargs))) for a in lists})
        fresh = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        assert launch_key(fresh) == launch_key(args)


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default
        self.has_default = default is not inspect.Parameter.empty


class _Compiled:
    """A compiled kernel's stand-in: records what its launcher is handed."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.launched: list = []

    def run(self, *args):
        self.launched.append(args)


class _Kernel:
    """A Triton kernel's stand-in with parameters ``x, n, A, B=7``, the last two constants."""

    arg_names = ["x", "n", "A", "B"]
    params = [_Param("x"), _Param("n"), _Param("A"), _Param("B", 7)]

    def __init__(self):
        self.pre_run_hooks: list = []
        self.used_global_vals: dict = {}
        self.through: list = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.through.append((grid, args, kwargs))
            return self.compiled

        return run


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


def test_a_repeated_launch_skips_triton_and_hands_the_compiled_kernel_its_arguments():
    kernel = _Kernel()
    launcher = CachedLaunch(kernel, driver=_Driver())
    x = torch.zeros(8)
    launcher[(3, 2)](x, 5, A=2, num_warps=4)
    assert launcher.misses == 1 and len(kernel.through) == 1 and kernel.through[0][2] == {"A": 2, "num_warps": 4}
    launcher[(3, 2)](torch.ones(8), 5, A=2, num_warps=4)  # a fresh tensor of the same dtype and alignment
    assert launcher.hits == 1 and len(kernel.through) == 1
    # the grid padded to three, the stream, the kernel's handles, no launch metadata or hooks, then every parameter
    # in the signature's order: the constants after the runtime arguments, defaults included, options left out
    (launched,) = kernel.compiled.launched
    assert launched[:9] == (3, 2, 1, 1234, "function", "metadata", None, None, None)
    assert launched[10:] == (5, 2, 7)
    # what Triton specializes on sends the launch through Triton again: another int, a misaligned tensor, another
    # constant, another option
    launcher[(3, 2)](x, 1, A=2, num_warps=4)
    launcher[(3, 2)](torch.zeros(9)[1:], 5, A=2, num_warps=4)
    launcher[(3, 2)](x, 5, A=3, num_warps=4)
    launcher[(3, 2)](x, 5, A=2, num_warps=8)
    assert launcher.misses == 5 and launcher.hits == 1


def test_launches_go_through_triton_under_hooks_and_changed_globals(monkeypatch):
    from triton import knobs

    kernel = _Kernel()
    launcher = CachedLaunch(kernel, driver=_Driver())
    x = torch.zeros(8)
    launcher[(1,)](x, 5, A=2)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    launcher[(1,)](x, 5, A=2)  # a profiler's hook: Triton passes it what it asks for
    monkeypatch.undo()
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    launcher[(1,)](x, 5, A=2)
    kernel.pre_run_hooks.clear()
    where = {"CONSTANT": 1}
    kernel.used_global_vals[("CONSTANT", id(where))] = (1, where)
    launcher[(1,)](x, 5, A=2)
    assert launcher.hits == 1  # the globals as they were compiled
    where["CONSTANT"] = 2
    launcher[(1,)](x, 5, A=2)  # Triton raises for a changed global; it is Triton's to say
    assert launcher.hits == 1 and launcher.misses == 4


def test_an_argument_that_cannot_be_hashed_goes_through_triton():
    kernel = _Kernel()
    launcher = CachedLaunch(kernel, driver=_Driver())
    for _ in range(2):
        launcher[(1,)](torch.zeros(8), [1, 2], A=2)
        launcher[(1,)](torch.zeros(8), 5, A=[2])
    assert launcher.misses == 4 and launcher.hits == 0 and not launcher.entries


def test_the_cache_is_bounded():
    kernel = _Kernel()
    launcher = CachedLaunch(kernel, driver=_Driver())
    x = torch.zeros(8)
    for n in range(launch_cache.MAX_ENTRIES + 5):
        launcher[(1,)](x, n + 2, A=2)
    assert len(launcher.entries) <= launch_cache.MAX_ENTRIES


def test_cached_passes_interpreted_kernels_and_stand_ins_through(monkeypatch):
    """In the interpreter (this machine) and for the benchmarks' stand-ins the launches are Triton's own; with
    ``CACHED_LAUNCH`` off, everywhere."""
    decode = load()
    assert cached(decode._evict_attend_kernel) is decode._evict_attend_kernel
    stand_in = _Kernel()
    assert cached(stand_in) is stand_in
    monkeypatch.setattr(launch_config, "CACHED_LAUNCH", False)
    assert cached(decode._append_logits_kernel) is decode._append_logits_kernel


def test_the_environment_turns_the_cache_off_for_a_run(monkeypatch):
    """``SLAKE_CACHED_LAUNCH=0`` (or off/false/no) in the environment when the module is imported; the same for the
    kept slot order (``SLAKE_HELD_ORDER``), the new token apart (``SLAKE_NEW_TOKEN_APART``) and the held eager steps
    (``SLAKE_HELD_STEP``), which a GPU session turns off if their tests fail on that GPU."""
    switches = (
        ("SLAKE_CACHED_LAUNCH", "CACHED_LAUNCH"), ("SLAKE_HELD_ORDER", "HELD_ORDER"),
        ("SLAKE_NEW_TOKEN_APART", "NEW_TOKEN_APART"), ("SLAKE_HELD_STEP", "HELD_STEP"),
    )  # fmt: skip
    try:
        for variable, switch in switches:
            for value, expected in (("0", False), ("off", False), ("No", False), ("1", True), (None, True)):
                if value is None:
                    monkeypatch.delenv(variable, raising=False)
                else:
                    monkeypatch.setenv(variable, value)
                assert getattr(importlib.reload(launch_config), switch) is expected, (variable, value)
            monkeypatch.delenv(variable, raising=False)
    finally:
        monkeypatch.undo()
        importlib.reload(launch_config)


def test_constants_made_once_key_a_launch_as_their_content_does():
    """:class:`~slake.kernels.launch_cache.Constants` (a launch's named constants, hashed once for many launches):
    two with the same content are one key, so the second launch skips Triton; another content goes through it; the
    compiled kernel gets the constants in the signature's order, the defaults included."""
    from slake.kernels.launch_cache import Constants, launch

    a, b = Constants({"A": 2, "num_warps": 4}), Constants({"A": 2, "num_warps": 4})
    assert a == b and hash(a) == hash(b) and a != Constants({"A": 3, "num_warps": 4}) and a != {"A": 2}
    kernel = _Kernel()
    launcher = CachedLaunch(kernel, driver=_Driver())
    x = torch.zeros(8)
    launcher.launch((3,), (x, 5), a)
    launcher.launch((3,), (torch.ones(8), 5), b)
    assert launcher.misses == 1 and launcher.hits == 1 and kernel.through[0][2] == {"A": 2, "num_warps": 4}
    assert kernel.compiled.launched[0][10:] == (5, 2, 7)
    launcher.launch((3,), (x, 5), Constants({"A": 3, "num_warps": 4}))
    assert launcher.misses == 2
    # launch(): a kernel that cached() passes through (the interpreter's, a stand-in) gets the constants by name
    stand_in = _Kernel()
    launch(stand_in, (2,), (x, 5), a)
    assert stand_in.through == [((2,), (x, 5), {"A": 2, "num_warps": 4})]


def test_a_fixed_run_keys_as_its_arguments_do_and_reaches_the_launcher_as_addresses():
    """:class:`~slake.kernels.launch_cache.Fixed`: a run of arguments made once, whose part of the key is
    :func:`launch_key` of the run, and whose tensors reach the compiled kernel's launcher as their addresses (CUDA
    tensors by default; forced here on CPU tensors). A launch that goes through Triton gets the tensors themselves;
    a launch of the same arguments as one tuple has the same key."""
    from slake.kernels.launch_cache import Constants, Fixed, launch_parts

    x, y = torch.zeros(8), torch.ones(8)
    run = Fixed((y, 5))
    assert run.key == launch_key((y, 5)) and run.fast == (y, 5)  # CPU tensors stay tensors unless asked
    forced = Fixed((y, 5), addresses=True)
    assert forced.fast == (y.data_ptr(), 5) and forced.args == (y, 5) and forced.key == run.key

    class _TwoTensors(_Kernel):  # parameters x, y, n and the constant A, B=7
        arg_names = ["x", "y", "n", "A", "B"]
        params = [_Param("x"), _Param("y"), _Param("n"), _Param("A"), _Param("B", 7)]

    kernel = _TwoTensors()
    launcher = CachedLaunch(kernel, driver=_Driver())
    constants = Constants({"A": 2})
    launcher.launch_parts((2,), ((x,), forced), constants)
    assert launcher.misses == 1 and kernel.through[0][1] == (x, y, 5)  # Triton binds the tensors
    launcher.launch_parts((2,), ((torch.ones(8),), forced), constants)
    assert launcher.hits == 1 and launcher.misses == 1
    # an equal run made again (a layer's step made afresh) has the same token, so the same key
    launcher.launch_parts((2,), ((x,), Fixed((y, 5), addresses=True)), constants)
    assert launcher.hits == 2 and launcher.misses == 1
    launcher.launch((2,), (x, y, 5), constants)  # the same arguments as one tuple: keyed apart, through Triton once
    launcher.launch((2,), (x, y, 5), constants)
    assert launcher.hits == 3 and launcher.misses == 2
    first, again, _ = kernel.compiled.launched
    assert torch.equal(first[9], torch.ones(8)) and first[10:] == (y.data_ptr(), 5, 2, 7)
    assert again[9] is x and again[10:] == (y.data_ptr(), 5, 2, 7)
    joined = kernel.compiled.launched[2]
    assert joined[9] is x and joined[10] is y and joined[11:] == (5, 2, 7)
    # a kernel cached() passes through gets the tensors, joined
    stand_in = _TwoTensors()
    launch_parts(stand_in, (2,), ((x,), forced), constants)
    launch_parts(stand_in, (2,), ((x,), (y, 5)), constants)
    for _, args, kwargs in stand_in.through:
        assert args[0] is x and args[1] is y and args[2:] == (5,) and kwargs == {"A": 2}


def test_fixed_runs_with_equal_keys_share_a_token_and_others_never_do(monkeypatch):
    """A :class:`~slake.kernels.launch_cache.Fixed` run's token stands for its key in a launch's key: equal keys get
    one token, different keys different ones; the table is bounded, and a key seen again after it was emptied gets a
    new token (one more pass through Triton), never one that another key holds."""
    from slake.kernels.launch_cache import Fixed

    monkeypatch.setattr(launch_cache, "_tokens", {})
    monkeypatch.setattr(launch_cache, "MAX_TOKENS", 3)
    x = torch.zeros(8)
    a, b = Fixed((x, 5)), Fixed((torch.ones(8), 5))  # one key: same dtype, alignment and integer
    c, d = Fixed((x, 6)), Fixed((x.to(torch.int32), 5))
    assert a.token == b.token and len({a.token, c.token, d.token}) == 3
    e = Fixed((x, 7))  # the table was full: emptied, then e's key
    f = Fixed((x, 5))  # a's key again, after the table was emptied
    assert len(launch_cache._tokens) <= 3
    assert f.token not in {a.token, c.token, d.token, e.token} and f.key == a.key
    assert launch_cache._parts_key(((x,), a)) == launch_cache._parts_key(((torch.ones(8),), b))
    assert launch_cache._parts_key(((x,), a)) != launch_cache._parts_key(((x,), c))
    assert launch_cache._parts_key(((x,), a)) != launch_key((x, x, 5))  # never a joined key


class _TooBigPipelined(_Kernel):
    """A kernel that needs more shared memory than the GPU's ``limit`` unless launched with ``num_stages=1``
    (``unpipelined``: what it needs then), as Triton refuses such a kernel: ``OutOfResources`` before it runs."""

    __name__ = "_too_big"

    def __init__(self, limit=65536, unpipelined=40960):
        super().__init__()
        self.limit, self.unpipelined = limit, unpipelined

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def run(*args, **kwargs):
            need = self.unpipelined if kwargs.get("num_stages") == 1 else 69632
            if need > self.limit:
                raise OutOfResources(need, self.limit, "shared memory")
            self.through.append((grid, args, kwargs))
            return self.compiled

        return run


def test_a_launch_beyond_the_gpus_shared_memory_runs_unpipelined_from_then_on(caplog):
    """An MI300's 64 KB of shared memory refuses the first kernel pipelined for fp32 rows (68 KB when compiled for
    gfx942): the launch goes again with ``num_stages=1``, and so does every later launch with those constants,
    through the cache or not, logged once."""
    from slake.kernels import launch_cache

    kernel = _TooBigPipelined()
    constants = launch_cache.Constants({"A": 2, "num_stages": 3})
    x = torch.zeros(8)
    with caplog.at_level("INFO", logger="slake.kernels"):
        launch_cache.fitting(kernel, (1,), (x, 5), constants.kwargs)
        launch_cache.fitting(kernel, (1,), (x, 5), constants.kwargs)
    assert [k for _, _, k in kernel.through] == [{"A": 2, "num_stages": 1}] * 2
    assert sum("launched unpipelined" in r.getMessage() for r in caplog.records) == 1
    launcher = CachedLaunch(kernel, driver=_Driver())
    launcher.launch((1,), (x, 5), constants)
    launcher.launch((1,), (x, 5), constants)
    assert launcher.misses == 1 and launcher.hits == 1 and kernel.through[-1][2]["num_stages"] == 1
    other = launch_cache.Constants({"A": 3, "num_stages": 3})  # other constants: refitted on their own
    launch_cache.fitting(kernel, (1,), (x, 5), other.kwargs)
    assert kernel.through[-1][2] == {"A": 3, "num_stages": 1}


def test_a_kernel_too_big_even_unpipelined_says_so():
    from slake.kernels import launch_cache

    kernel = _TooBigPipelined(limit=32768)
    with pytest.raises(RuntimeError, match="even unpipelined.*kernels='torch'"):
        launch_cache.fitting(kernel, (1,), (torch.zeros(8), 5), {"A": 2})
    assert kernel.through == []


def _a_kernel(x_ptr, n):
    pass


def _another_kernel(x_ptr, n):
    pass


def test_amd_gpus_launch_every_kernel_through_triton(monkeypatch):
    """Triton's AMD backend specializes a tensor on whether its storage is within 2 GB (32-bit buffer offsets), which
    the cache's key does not hold: on a ROCm build of torch every launch goes through Triton's binding, as
    ``slake.kernels.launch_mode`` then says."""
    from triton.runtime.jit import JITFunction

    from slake.kernels import launch_mode

    nvidia = JITFunction(_a_kernel)
    assert isinstance(cached(nvidia), CachedLaunch)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    amd = JITFunction(_another_kernel)
    assert cached(amd) is amd
    monkeypatch.delenv("TRITON_INTERPRET")
    assert launch_mode() == "triton"


def test_a_triton_without_the_instrumentation_knob_launches_through_the_cache(monkeypatch):
    """Triton 3.4 and 3.5 (torch 2.8's and 2.9's) have no ``knobs.compilation.instrumentation_mode``, nor is it in
    their JIT's key: the cache keys without it there (it read the knob and raised AttributeError at every eager
    fused step of such a GPU machine)."""
    from triton import knobs

    monkeypatch.delattr(type(knobs.compilation), "instrumentation_mode", raising=False)
    assert not hasattr(knobs.compilation, "instrumentation_mode")
    kernel = _Kernel()
    launcher = CachedLaunch(kernel, driver=_Driver())
    x = torch.zeros(8)
    launcher[(1,)](x, 5, A=2)
    launcher[(1,)](x, 5, A=2)
    assert launcher.misses == 1 and launcher.hits == 1
