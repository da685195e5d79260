"""The memory roofline of a decode step: the bytes a step must read, at the bandwidth the device was measured at.

A batch-1 decode step of a large model is bound by memory: it reads every weight once (the input embedding only at
the batch's token rows) and every kept key and value, SLAKE's linear state included. Its floor on a device is
those bytes over the device's memory bandwidth, which :func:`copy_bandwidth` measures in the process (a large copy
on the device: read and written, the best of a few), so that a decode time can be put beside what the memory
allows (``slake bench``'s ``roofline_ms`` and ``vs_roofline``; issue 32 asks every GPU measurement to carry it).
The slots' metadata (positions, validity, scores) and free slots are not counted: a step of the full cache need not
read them, and they are a few percent of a compressed layer's bytes.
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

__all__ = ["copy_bandwidth", "cpu_copy_bandwidth_apart", "decode_weight_bytes", "roofline_fields", "step_kv_bytes"]

#: what :func:`copy_bandwidth` copies by default: 1 GiB on a GPU (well beyond its caches), 256 MiB on a CPU
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 28}


def decode_weight_bytes(model: torch.nn.Module, batch: int = 1) -> int:
    """Bytes of the model's parameters and buffers that one decode step of ``batch`` tokens reads: all of them, but
    of an input embedding that is not also the output head only the ``batch`` rows looked up."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:  # tied weights are read once
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    emb = get_in() if get_in is not None else None
    head = get_out() if get_out is not None else None
    weight = getattr(emb, "weight", None)
    if weight is not None and (head is None or getattr(head, "weight", None) is None or
                               head.weight.data_ptr() != weight.data_ptr()):  # fmt: skip
        total += -weight.numel() * weight.element_size() + batch * weight.shape[-1] * weight.element_size()
    return int(total)


def step_kv_bytes(kv_bytes_detail: dict[str, int]) -> int:
    """Bytes of the cache one decode step must read, from a bench row's ``kv_bytes_detail``: the kept keys and
    values, SLAKE's linear state, and a hybrid model's sliding-window layers."""
    return int(sum(kv_bytes_detail.get(k, 0) for k in ("kept", "linear_state", "sliding")))


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second a copy of ``nbytes`` (default :data:`COPY_BYTES`) moves on ``device``, counting its read and
    its write, the best of ``repeats`` after one untimed copy."""
    dev = torch.device(device)
    n = int(nbytes if nbytes is not None else COPY_BYTES.get(dev.type, 1 << 28))
    if n < 1 or repeats < 1:
        raise ValueError("nbytes and repeats must be >= 1")
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * n / max(best, 1e-9)


def cpu_copy_bandwidth_apart(threads: int | None = None) -> float:
    """:func:`copy_bandwidth` on the CPU, measured in a child process with ``threads`` torch threads (default: this
    process's), so that its two buffers of :data:`COPY_BYTES` do not raise this process's memory high-water mark:
    ``slake bench`` measures it so where it cannot reset that mark per configuration (not Linux), and every row's peak
    would otherwise count the 512 MiB of the copy.

    Raises
    ------
    RuntimeError
        When the child fails (its standard error in the message).
    """
    code = (
        "import sys, torch; torch.set_num_threads(int(sys.argv[1])); "
        "from slake.engines.transformers.roofline import copy_bandwidth; print(copy_bandwidth('cpu'))"
    )
    n = int(threads if threads is not None else torch.get_num_threads())
    done = subprocess.run([sys.executable, "-c", code, str(n)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the CPU's copy bandwidth in a child process failed: {done.stderr.strip()}")
    return float(done.stdout.strip().splitlines()[-1])


def roofline_fields(decode_ms: float, weight_bytes: int, kv_bytes_detail: dict[str, int], bandwidth: float) -> dict:
    """A bench row's roofline fields: ``roofline_bytes`` (weights read per step plus :func:`step_kv_bytes`),
    ``bandwidth_gbs`` (the measured copy bandwidth, GB/s), ``roofline_ms`` (the bytes at that bandwidth) and
    ``vs_roofline`` (the decode step's milliseconds over ``roofline_ms``; 1.0 is the memory's floor)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    nbytes = int(weight_bytes) + step_kv_bytes(kv_bytes_detail)
    floor_ms = nbytes / bandwidth * 1e3
    return {
        "roofline_bytes": nbytes,
        "bandwidth_gbs": round(bandwidth / 1e9, 2),
        "roofline_ms": float(f"{floor_ms:.4g}"),
        "vs_roofline": round(decode_ms / floor_ms, 3) if floor_ms > 0 else None,
    }
