"""Peak memory of one benchmark configuration.

* **CUDA**: ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats`` at the start of the
  configuration (bytes allocated by PyTorch tensors, model weights included).
* **CPU**: the process's resident-set high-water mark ``VmHWM`` from ``/proc/self/status``, reset at the start of the
  configuration by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), after a ``gc.collect()`` and glibc's
  ``malloc_trim(0)`` so that memory freed by the previous configuration is returned to the system first. It counts
  everything the process holds (weights, Python, allocator slack). Where the reset is not possible (not Linux, no
  permission), the high-water mark is monotone over the run and ``peak_mem_reset`` is reported False; use
  ``--isolate`` to run each configuration in a fresh process then (``slake bench`` measures its roofline's copy
  bandwidth in a child process there, :func:`~slake.engines.transformers.bench.device_bandwidth`, so that the
  copy's buffers are not in the mark).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import torch

__all__ = ["MemoryMeter"]


def _read_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class MemoryMeter:
    """Reset-able peak memory of the current process (CPU RSS) or CUDA device.

    Parameters
    ----------
    device : str | torch.device
        ``"cpu"`` or a CUDA device.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.reset_ok = False
        self.baseline = 0

    @property
    def kind(self) -> str:
        """What is measured: ``"cuda_max_memory_allocated"`` or ``"process_rss_hwm"``."""
        return "cuda_max_memory_allocated" if self.device.type == "cuda" else "process_rss_hwm"

    def reset(self) -> None:
        """Start a new measurement window."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            self.reset_ok = True
            return
        _malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False
        self.baseline = (_read_status_kb("VmRSS") or 0) * 1024

    def peak(self) -> int:
        """Peak bytes since :meth:`reset` (see the module docstring for what is counted)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = _read_status_kb("VmHWM")
        if hwm is None:  # not Linux: best effort
            try:
                import resource

                # ru_maxrss is in kilobytes on Linux and the BSDs, in bytes on macOS
                return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (
                    1 if sys.platform == "darwin" else 1024
                )
            except (ImportError, OSError):
                return 0
        return hwm * 1024

    @staticmethod
    def available() -> bool:
        """True when the CPU high-water mark can be reset (Linux ``/proc/self/clear_refs`` is writable)."""
        return os.access("/proc/self/clear_refs", os.W_OK)
