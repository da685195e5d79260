"""Compile the fused decode kernels for an NVIDIA GPU on a machine without one (``tests/test_kernels_compile.py``).

Run as a script in its own process: Triton decides when a kernel is defined whether it is interpreted, so the
kernel module is imported here with ``TRITON_INTERPRET`` unset. Each case of ``argv[2:]`` (``method`` or
``method@dtype``, dtype ``float32``/``bfloat16``/``int8``/``fp8_e4m3``) runs one decode step of the transformers
engine at Llama-3-8B's head shape (8 KV heads, 4 query heads each, 128 dims, 1,024 kept slots), with every kernel
launch replaced by an ahead-of-time compilation for the target ``argv[1]`` (e.g. ``cuda:90``: an H100) through
Triton's CUDA backend and its bundled ``ptxas``; the kernels are compiled with the arguments and constants the step
would launch them with (half-precision keys take the low-precision dots, as on a GPU). Prints one JSON line per
case: the kernels compiled, whether each produced a cubin, and its shared memory in bytes. Nothing runs: the
outputs of these steps are garbage, and not looked at.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from slake.kernels import triton_decode  # noqa: E402

# the module is imported in compiled mode; from now on slake.kernels.load() returns it as it is
os.environ["TRITON_INTERPRET"] = "1"

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
KERNELS = ("_append_logits_kernel", "_value_projection_kernel", "_evict_attend_kernel")


class AheadOfTime:
    """Stands in for a kernel: ``kernel[grid](*args)`` compiles it for ``target`` instead of launching it."""

    def __init__(self, kernel, target: GPUTarget, compiled: list) -> None:
        self.kernel, self.target, self.compiled = kernel, target, compiled

    def __getitem__(self, grid):
        def compile_instead(*args, **kwargs):
            fn = self.kernel
            bound = dict(zip(fn.arg_names, args, strict=False))
            bound.update(kwargs)
            signature, constants = {}, {}
            for i, name in enumerate(fn.arg_names):
                value = bound[name]
                if fn.params[i].is_constexpr:
                    signature[name], constants[name] = "constexpr", value
                elif isinstance(value, torch.Tensor):
                    signature[name] = "*" + TYPES[value.dtype]
                elif isinstance(value, bool):
                    signature[name] = "i1"
                elif isinstance(value, int):
                    signature[name] = "i64" if abs(value) >= 2**31 else "i32"
                elif isinstance(value, float):
                    signature[name] = "fp32"
                else:
                    raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
            keys = bound.get("k_ptr")
            if "LOW_DOT" in constants and keys is not None and keys.dtype in (torch.bfloat16, torch.float16):
                constants["LOW_DOT"] = True  # what the step passes on a GPU
            binary = triton.compile(triton.compiler.ASTSource(fn, signature, constants), target=self.target)
            self.compiled.append(
                {"kernel": fn.__name__, "cubin": "cubin" in binary.asm, "shared": int(binary.metadata.shared)}
            )

        return compile_instead


def main(argv: list[str]) -> None:
    backend, arch = argv[0].split(":")
    target = GPUTarget(backend, int(arch), 32)
    compiled: list = []
    for name in KERNELS:
        setattr(triton_decode, name, AheadOfTime(getattr(triton_decode, name), target, compiled))
    import test_fused_decode as harness

    shape = dict(B=1, H=8, G=4, D=128, S=1100, budget=1024, pad=False, steps=1, layers=1)
    for case in argv[1:]:
        method, _, storage = case.partition("@")
        options: dict = {}
        if storage in ("bfloat16", "float16"):
            options["dtype"] = getattr(torch, storage)
        elif storage:
            options["kv_dtype"] = storage
        compiled.clear()
        harness._run(harness._method(method), "triton", **shape, **options)
        print(json.dumps({"case": case, "compiled": compiled}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
