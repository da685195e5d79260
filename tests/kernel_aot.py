"""Compile the fused decode kernels for an NVIDIA GPU on a machine without one (``tests/test_kernels_compile.py``).

Run as a script in its own process: Triton decides when a kernel is defined whether it is interpreted, so the
kernel module is imported here with ``TRITON_INTERPRET`` unset. Each case of ``argv[2:]`` (``method`` or
``method@dtype``, dtype ``float32``/``bfloat16``/``int8``/``fp8_e4m3``) runs one decode step of the transformers
engine at Llama-3-8B's head shape (8 KV heads, 4 query heads each, 128 dims, 1,024 kept slots, batch 1; ``--shape
batch8-128`` before the target: 8 rows of 128, the vLLM pool's; ``--leave-out sort,fold,...`` after it: the second
kernel without those parts, as ``python -m benchmarks kernel-parts`` times it; ``--tune COMBINE=8,...`` after that:
other launch constants, as ``python -m benchmarks kernel-tune`` times them; ``--keys 70,71,...`` first: no
compilation, but one step at each of those budgets and the number of distinct compilations Triton's JIT would make
of each kernel, printed as ``compilations``), with every kernel
launch replaced by an ahead-of-time compilation for the target ``argv[1]`` (e.g. ``cuda:90``: an H100) through
Triton's CUDA backend and its bundled ``ptxas``; the kernels are compiled with the arguments and constants the step
would launch them with, specialized as Triton's JIT specializes a launch (an int equal to 1 made a constant, pointers
aligned to 16 bytes and ints divisible by 16 marked so; without it the loads were compiled unvectorized and the
register counts were not a GPU's, since 2026-11-28); half-precision keys take the low-precision products where
the step would on a GPU (:func:`slake.cache.fused_step.half_precision_dots`). A case ``dense@dtype`` compiles the
full cache's masked attention over a static store of 128K slots instead (:mod:`slake.kernels.triton_dense`). Prints
one JSON line per
case: the kernels compiled, whether each produced a cubin, its shared memory in bytes, its warps, and what ``ptxas -v``
reports of it (registers per thread, stack frame, bytes spilled to local memory), with its machine code's static
instruction counts (``sass``), and the memory hazards within a program that its Triton GPU IR shows (``hazards``:
``tests/kernel_hazards.py``); and whether the process has loaded transformers (``transformers_loaded``). Nothing
runs: the outputs of these steps are garbage, and not looked at.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks (--keys)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402

from gpu_targets import SHARED_LIMITS  # noqa: E402
from kernel_hazards import hazards  # noqa: E402
from slake.cache import fused_step  # noqa: E402
from slake.kernels import launch_config, triton_decode, triton_dense  # noqa: E402

TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "i1",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.float8_e4m3fn: "fp8e4nv",
}
KERNELS = ("_append_logits_kernel", "_value_projection_kernel", "_evict_attend_kernel", "_layer_eviction_kernel")
DENSE_KERNELS = ("_dense_partials_kernel", "_dense_combine_kernel")
#: the full cache's static store a ``dense@dtype`` case compiles the dense attention for: Llama-3-8B's heads at
#: batch 1 over 128K slots (rows split into pieces of 4,096)
DENSE_SHAPE = dict(R=1, H=8, G=4, D=128, W=131072 + 40)


#: machine instructions counted in each kernel's SASS (``sass`` in the report): global loads, stores and reductions
#: (atomics whose result is unused), shared-memory loads and stores, barriers, shuffles, float32 FMAs, local-memory
#: traffic (spills)
SASS_OPS = ("LDG", "STG", "REDG", "LDS", "STS", "BAR", "SHFL", "FFMA", "LDL", "STL")


def sass_counts(sass: str) -> dict:
    """Static instruction counts of a kernel's SASS (``cuobjdump -sass``): ``total`` and each of :data:`SASS_OPS`.
    Static: an instruction in a loop counts once. A proxy for a kernel's critical path, read without a GPU."""
    ops: Counter = Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return {"total": sum(ops.values()), **{op: ops[op] for op in SASS_OPS}}


def ptxas_report(ptx: str, arch: int) -> dict:
    """What Triton's bundled ``ptxas`` says of a kernel's PTX for ``sm_<arch>`` (``-v``, the options Triton compiles
    with): registers per thread, stack frame, and the bytes spilled to local memory (stores and loads); and its
    machine code's instruction counts (:func:`sass_counts`, through the bundled ``cuobjdump``). The ``ptxas`` is the
    one Triton compiles that target with (Blackwell's, ``sm_100`` and later, is a separate binary)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = Path(get_ptxas(arch).path)
    except TypeError:  # Triton 3.4 and 3.5: one ptxas for every target
        ptxas = Path(get_ptxas().path)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)
        cubin = Path(tmp, "kernel.cubin")
        run = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name={gpu}", str(src), "-o", str(cubin)],
            capture_output=True,
            text=True,
            check=True,
        )
        dump = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True)
    log = run.stderr + run.stdout

    def number(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": number(r"Used (\d+) registers"),
        "stack": number(r"(\d+) bytes stack frame"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "sass": sass_counts(dump.stdout) if dump.returncode == 0 else None,
    }


def amdgcn_report(asm: str) -> dict:
    """What an AMD kernel's assembly (Triton's ``amdgcn`` stage) says of its resources, in the fields
    :func:`ptxas_report` gives a CUDA kernel: vector registers per lane (``registers``, accumulation registers
    included: the count of gfx90a's and gfx942's unified register file), the scratch memory per lane (``stack``)
    and the vector registers spilled to it (``spill_stores``, in registers: AMD's assembler reports no bytes, nor
    loads apart); besides, ``sgpr_spills``: scalar registers spilled into spare lanes of vector registers, which
    costs no memory traffic."""

    def number(name: str) -> int:
        found = re.findall(rf"^\s*-?\s*\.{name}:\s+(\d+)", asm, re.M)
        return max((int(n) for n in found), default=0)

    return {
        "registers": number("vgpr_count"),  # the unified register file's count: accumulation registers included
        "stack": number("private_segment_fixed_size"),
        "spill_stores": number("vgpr_spill_count"),
        "spill_loads": 0,
        "sgpr_spills": number("sgpr_spill_count"),
        "sass": None,
    }


def _specialize(backend, value, is_const: bool, specialize_value: bool, align: bool) -> tuple:
    """Triton's specialization of one launch argument: ``native_specialize_impl`` (Triton 3.6 and later), or the
    Python ``create_specialize_impl`` of Triton 3.4 and 3.5 with the backend's own marks."""
    try:
        from triton._C.libtriton import native_specialize_impl
    except ImportError:
        from triton.runtime.jit import create_specialize_impl

        return create_specialize_impl(backend.get_arg_specialization)(value, is_const, specialize_value, align)
    return native_specialize_impl(backend, value, is_const, specialize_value, align)


def jit_specialization(fn, args: tuple, kwargs: dict, backend=BaseBackend) -> tuple[dict, dict, dict]:
    """What Triton's JIT specializes a launch of ``fn`` with these arguments on, as its compiler takes it:
    ``(signature, constants, attrs)`` (``native_specialize_impl``: an int equal to 1 made a constant unless the
    parameter is ``do_not_specialize``; pointers aligned to 16 bytes and ints divisible by 16 marked so; ``backend``'s
    own marks besides, such as AMD's for a tensor whose storage is within 2 GB)."""
    bound = dict(zip(fn.arg_names, args, strict=False))
    bound.update(kwargs)
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = bound[name]
        param = fn.params[i]
        if param.is_constexpr:
            signature[name], constants[name] = "constexpr", value
            continue
        if not isinstance(value, (torch.Tensor, bool, int, float)):
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
        # specialized as Triton's JIT does at a launch (triton.runtime.jit): an int equal to 1 becomes a
        # constant, and a pointer aligned to 16 bytes or an int divisible by 16 is marked so, which lets the
        # compiler vectorize loads (the CPU's allocator aligns as CUDA's does)
        kind, spec = _specialize(
            backend, value, param.is_const, not param.do_not_specialize, not param.do_not_specialize_on_alignment
        )
        if kind == "constexpr":
            signature[name], constants[name] = "constexpr", spec
            continue
        signature[name] = kind
        if isinstance(spec, str) and spec:
            attrs[(i,)] = backend.parse_attr(spec)
    return signature, constants, attrs


class AheadOfTime:
    """Stands in for a kernel: ``kernel[grid](*args)`` compiles it for ``target`` instead of launching it."""

    def __init__(self, kernel, target: GPUTarget, compiled: list) -> None:
        self.kernel, self.target, self.compiled = kernel, target, compiled

    def __getitem__(self, grid):
        def compile_instead(*args, **kwargs):
            fn = self.kernel
            backend = make_backend(self.target).__class__
            signature, constants, attrs = jit_specialization(fn, args, kwargs, backend)
            options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
            source = triton.compiler.ASTSource(fn, signature, constants, attrs)
            binary = triton.compile(source, target=self.target, options=options)
            # a kernel beyond the target's shared memory is launched again unpipelined on that GPU
            # (slake.kernels.launch_cache.fitting): compiled so here too
            limit = SHARED_LIMITS.get(self.target.arch)
            unpipelined = limit is not None and binary.metadata.shared > limit and options.get("num_stages") != 1
            if unpipelined:
                binary = triton.compile(source, target=self.target, options={**options, "num_stages": 1})
            hip = self.target.backend == "hip"
            report = amdgcn_report(binary.asm["amdgcn"]) if hip else ptxas_report(binary.asm["ptx"], self.target.arch)
            self.compiled.append(
                {
                    "kernel": fn.__name__,
                    "binary": ("hsaco" if hip else "cubin") in binary.asm,
                    "unpipelined": unpipelined,
                    "shared": int(binary.metadata.shared),
                    "warps": int(binary.metadata.num_warps),
                    # accesses of a program's threads to one argument that no barrier orders (kernel_hazards)
                    "hazards": [str(h) for h in hazards(binary.asm["ttgir"])],
                    **report,
                }
            )

        return compile_instead


#: the step shapes a run can compile at (``--shape NAME`` before the target): Llama-3-8B's heads (8 KV heads of 4 query
#: heads, 128 dims) at the transformers rows' batch 1 and budget 1,024, and at the vLLM pool's 8 rows and budget 128;
#: heads of 256 dims (Gemma 3's: one KV head of four query heads) at batch 1 and budget 1,024
SHAPES = {
    "batch1-1024": dict(B=1, H=8, G=4, D=128, S=1100, budget=1024, pad=False, steps=1, layers=1),
    "batch8-128": dict(B=8, H=8, G=4, D=128, S=300, budget=128, pad=False, steps=1, layers=1),
    "head256": dict(B=1, H=1, G=4, D=256, S=1100, budget=1024, pad=False, steps=1, layers=1),  # Gemma 3's heads
}


def main(argv: list[str]) -> None:
    shape = SHAPES["batch1-1024"]
    dense_shape = DENSE_SHAPE
    if argv and argv[0] == "--shape":
        shape = SHAPES[argv[1]]
        if argv[1] == "head256":  # the dense store of Gemma 3's heads: one KV head of four query heads, 256 dims
            dense_shape = dict(R=1, H=1, G=4, D=256, W=8192 + 40)
        argv = argv[2:]
    left_out: list[str] = []
    if argv and argv[0] == "--leave-out":  # the second kernel's variants of ``benchmarks kernel-parts``
        left_out = argv[1].split(",")
        argv = argv[2:]
    tune: dict[str, int] = {}
    if argv and argv[0] == "--tune":  # other launch constants (launch_config.tuned), as ``kernel-tune`` times them
        tune = {k: int(v) for k, v in (item.split("=") for item in argv[1].split(","))}
        argv = argv[2:]
    budgets: list[int] = []
    if argv and argv[0] == "--keys":  # count the compilations instead of compiling (one step at each budget)
        budgets = [int(b) for b in argv[1].split(",")]
        argv = argv[2:]
    backend, arch = argv[0].split(":")  # cuda:90 (an H100), cuda:80 (an A100), hip:gfx942 (an MI300X) ...
    target = GPUTarget("hip", arch, 64) if backend == "hip" else GPUTarget(backend, int(arch), 32)
    # fp8 codes through their bits where the target has no e4m3 conversion, as slake.kernels.device_support chooses
    # on that GPU (the tensors here are on the CPU, where it would choose the conversion)
    from slake.kernels import device_support

    device_support.FP8_BITS = backend == "hip" or int(arch) < 89
    # half-precision products where the target takes them (not before sm_80: device_support.half_precision_products)
    half_dots = backend == "hip" or int(arch) >= 80
    compiled: list = []
    seen: set[tuple[str, str]] = set()
    if budgets:  # Triton's own JIT, for an sm_90 target, counting what it would compile (benchmarks.warm_cache)
        from benchmarks import warm_cache

        warm_cache.compile_for_sm90()
        warm_cache.skip_compiling(seen)
    else:
        for module, names in ((triton_decode, KERNELS), (triton_dense, DENSE_KERNELS)):
            for name in names:
                setattr(module, name, AheadOfTime(getattr(module, name), target, compiled))
        # the kernel modules are imported in compiled mode; from now on slake.kernels.load() returns them as they are
        os.environ["TRITON_INTERPRET"] = "1"
    # half-precision keys take the low-precision products, as on a GPU (the tensors here are on the CPU)
    fused_step.half_precision_dots = lambda device, dtype: half_dots and dtype in (torch.float16, torch.bfloat16)
    triton_dense.half_precision_dots = fused_step.half_precision_dots
    import fused_cases as harness

    for case in argv[1:]:
        method, _, storage = case.partition("@")
        options: dict = {}
        if storage in ("bfloat16", "float16"):
            options["dtype"] = getattr(torch, storage)
        elif storage:
            options["kv_dtype"] = storage
        compiled.clear()
        if method == "dense":  # the full cache's masked step over a static store (slake.kernels.triton_dense)
            R, H, G, D, W = (dense_shape[k] for k in ("R", "H", "G", "D", "W"))
            dtype = options.get("dtype", torch.float32)
            codes = {"int8": torch.int8, "fp8_e4m3": torch.uint8}.get(options.get("kv_dtype", ""), dtype)
            keys, values = (torch.empty(R, H, W, D, dtype=codes) for _ in range(2))
            valid = torch.ones(R, H, W, dtype=torch.bool)
            scales = torch.empty(R, H, W, 1) if codes != dtype else torch.empty(0)
            triton_dense.dense_attention(torch.empty(R, H * G, D, dtype=dtype), keys, values, valid, scales, scales,
                                         D**-0.5)  # fmt: skip
            print(json.dumps({"case": case, "compiled": compiled, **_loaded()}), flush=True)
            continue
        if budgets:  # one engine per budget: layers whose rows differ in width, as per-layer budgets make them
            seen.clear()
            for budget in budgets:
                harness._run(harness._method(method), "triton", **{**shape, "budget": budget, "S": budget + 40},
                             **options)  # fmt: skip
            counts = Counter(name for name, _ in seen)
            print(json.dumps({"case": case, "budgets": budgets, "compilations": dict(counts)}), flush=True)
            continue
        with launch_config.leaving_out(*left_out), launch_config.tuned(**tune):
            harness._run(harness._method(method), "triton", **shape, **options)
        print(json.dumps({"case": case, "compiled": compiled, **_loaded()}), flush=True)


def _loaded() -> dict:
    """Whether this process has loaded transformers so far (``make test-oldest`` leaves the compilations out, on the
    ground that they read none: ``tests/test_kernels_compile.py`` checks it)."""
    return {"transformers_loaded": "transformers" in sys.modules}


if __name__ == "__main__":
    main(sys.argv[1:])
