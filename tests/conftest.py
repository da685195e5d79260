"""Shared fixtures; Triton's interpreter on machines without a GPU (the fused decode kernels' tests run their
kernels on CPU tensors through it; it must be switched on before Triton is imported, and its helper calls skip a
redundant re-patching, :func:`_helper_calls_keep_the_launch_patch`); and the tests' CPU threads.

Threads: torch's OpenMP threads spin while they wait for work. On the two-core CI machine beside another job, that
spinning made the unit tests 8.7x slower (three test files: 13.6 minutes instead of 1.6; ``make test`` once took
25 minutes), so waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``, read when torch loads OpenMP, hence set before
``import torch``; subprocesses inherit it), and the unit tests, on tiny tensors where a second thread gains nothing
(1.5 minutes idle with one thread or two), run on one: 2.8 minutes beside the same job. The tests on real weights
(marker ``integration``) keep torch's default, where two threads pay (140 s against 187 s for the heaviest one), but
share it out among test processes run side by side (``pytest -n``; ``make test-integration`` runs one process): two
processes of two threads each would ask four threads of two cores."""

from __future__ import annotations

import os
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ and not Path("/dev/nvidiactl").exists():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny_models import tiny_model  # noqa: E402

#: torch's own thread count in this process, before any test changes it
DEFAULT_THREADS = torch.get_num_threads()


def _interpreter_to_patch():
    """Triton's interpreter module (``triton.runtime.interpreter``) when the interpreter is on and is the version
    the changes below were read from (3.6.0); else None, and they change nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return None
    return interpreter if triton.__version__ == "3.6.0" else None


def _helper_calls_keep_the_launch_patch() -> None:
    """Triton's interpreter (3.6.0) patches ``triton.language`` for an interpreted kernel once per launch, for the
    whole launch, and then again at every call of a ``@triton.jit`` helper from inside it (``inspect.getmembers``
    over four modules each time, about 0.4 ms here), its own reductions (``tl.sum``, ``tl.max``, ``tl.argmin``,
    ``tl.sort``...) included, whose module reaches ``triton.language.core`` rather than ``triton.language``. The
    fused kernels call such helpers many times in every program, and the re-patching was about a fifth of their
    tests' time, the largest share of the unit tier. Here a launch patches both modules for its whole run, and a
    helper call inside it patches nothing more. A builtin left unpatched would raise ("Did you forget to add
    @triton.jit ?"), never compute something else. Applied only where :func:`_interpreter_to_patch` says."""
    interpreter = _interpreter_to_patch()
    if interpreter is None:
        return
    from triton.language import standard

    patch = getattr(interpreter, "_patch_lang", None)
    call = interpreter.InterpretedFunction.__dict__.get("__call__")
    core_user = getattr(standard.max, "fn", None)  # a function whose module holds triton.language.core
    if patch is None or call is None or core_user is None:
        return
    if "_patch_lang" not in call.__code__.co_names:  # not the helper call this was written against
        return

    class _Both:
        def __init__(self, *scopes) -> None:
            self.scopes = scopes

        def restore(self) -> None:
            for scope in reversed(self.scopes):
                scope.restore()

    def launch_patch(fn):  # GridExecutor: once per launch, both language modules
        return _Both(patch(fn), patch(core_user))

    def helper_call(self, *args, **kwargs):  # a helper inside a launch: already patched
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter._patch_lang = launch_patch
    interpreter.InterpretedFunction.__call__ = helper_call


def _bf16_casts_round_to_nearest_even() -> None:
    """Triton's interpreter (3.6.0) casts float32 to bfloat16 by cutting the low bits off (its ``cast_impl`` passes
    no rounding mode), where a GPU's ``.to(tl.bfloat16)`` and torch round to nearest, ties to even: half of the
    values differed by one bf16 step, and CriticalKV's bf16 weights, stored through such a cast, made a fused step
    diverge from the torch step over ~150 decode steps on the CPU alone (the 2026-11-30 audit of long decoding). Here
    that one cast rounds as torch does; every other cast is the interpreter's.
    Applied only where :func:`_interpreter_to_patch` says."""
    interpreter = _interpreter_to_patch()
    if interpreter is None:
        return
    import numpy as np
    import triton.language as tl

    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    if cast is None or not hasattr(interpreter, "TensorHandle"):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return cast(self, src, dst_type)

    cast_impl.truncating = cast  # type: ignore[attr-defined]  # the interpreter's own, for a test that needs it
    builder.cast_impl = cast_impl


def _no_discarded_overflow_checks() -> None:
    """Triton's interpreter (3.6.0) computes a check of every int32 add, subtract and multiply of a kernel for
    overflow (the operation again in int64, compared with int32's bounds) and then, its ``debug`` option being off
    as a GPU launch's is by default, drops the assertion unread: about a fifth of the interpreted kernels' time, the
    largest share of the unit tier, for no check. Here the interpreter does not compute it (``sanitize_overflow``
    off); ``debug`` stays off, so nothing the kernels are checked for changes.
    Applied only where :func:`_interpreter_to_patch` says."""
    interpreter = _interpreter_to_patch()
    if interpreter is None:
        return
    import dataclasses

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if getattr(options, "debug", True) or not hasattr(options, "sanitize_overflow"):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _numpy_types_looked_up_once() -> None:
    """Triton's interpreter (3.6.0) finds the numpy type of a Triton type (``_get_np_dtype``) by building a table of
    nineteen types at every call, hundreds of thousands of times in a fused kernel's test: a tenth of its time. Here
    each type's answer is kept after its first lookup, keyed by the type's class and name (which spells a block's
    shape and element type, a pointer's element type), which decide the answer; the lookup itself is the
    interpreter's. Applied only where :func:`_interpreter_to_patch` says."""
    interpreter = _interpreter_to_patch()
    if interpreter is None:
        return
    own = getattr(interpreter, "_get_np_dtype", None)
    if own is None:
        return
    known: dict = {}

    def get_np_dtype(tt_dtype):
        key = (type(tt_dtype), getattr(tt_dtype, "name", None))
        if key[1] is None:
            return own(tt_dtype)
        try:
            return known[key]
        except KeyError:
            known[key] = found = own(tt_dtype)
            return found

    get_np_dtype.own = own  # type: ignore[attr-defined]  # the interpreter's, for the test that compares the two
    interpreter._get_np_dtype = get_np_dtype


_helper_calls_keep_the_launch_patch()
_bf16_casts_round_to_nearest_even()
_numpy_types_looked_up_once()
_no_discarded_overflow_checks()
if os.environ.get("TRITON_INTERPRET") == "1":  # every kernel's loads and stores within its launch's tensors
    import kernel_bounds  # noqa: E402

    kernel_bounds.install()

import scratch_poison  # noqa: E402

scratch_poison.install()  # slake's uninitialised tensors hold NaN and -1, not the zeros fresh CPU pages hold


#: test processes running side by side (pytest-xdist's workers; 1 without it)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


@pytest.fixture(autouse=True)
def _threads(request):
    """One torch thread for a unit test; for a test on real weights torch's default, shared out among the processes
    that run side by side (module docstring): two workers on two cores take one thread each, not two. Set for every
    test, so that one that changes the count (``slake bench --threads``) leaves nothing behind."""
    real = request.node.get_closest_marker("integration")
    torch.set_num_threads(max(1, DEFAULT_THREADS // WORKERS) if real else 1)


@pytest.fixture(scope="session")
def llama_gqa():
    return tiny_model("llama-gqa")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches reset before and after the test (compiled-decoding tests: no graph carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
