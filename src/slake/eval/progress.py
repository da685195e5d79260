"""The time left in an evaluation, for its progress bar.

An evaluation's outputs do not cost alike: a prompt's prefill comes before its first output, long prompts cost more
than short ones, and a batch of pairs then comes out quickly. Counting outputs (what a progress bar does by itself)
therefore swings between far too pessimistic and far too optimistic. :class:`TimeLeft` counts *work* instead: each
prompt weighs its number of tokens, shared equally by its pending (method, budget) pairs, and the time left is the
elapsed time scaled by the work left over the work done. Prompts of one length cost about alike, so on a run of one
length the estimate converges once a few prompts are done; across lengths it underestimates long prompts (attention
grows faster than the token count), which is why it is an estimate.

No estimate is given until the work done stands for the rest: every output of some prompt (an engine that prefills
a prompt once and replays every pair from it spends most of the prompt's time before its first output, which an
equal share credits with one pair's part: after that first output the estimate was several times the time left,
a KVzip run on Qwen at 8K showed "~8h20m left" after its first output and "~1h27m" after its seventh), or one output
of every prompt (an engine that runs each pair over all prompts at once). An engine that prefills a prompt once and
replays every pair from it (``whole_prompts``) waits for a whole prompt: where one batch holds every pending prompt,
its first outputs carry every prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from slake.engines.base import EvalRequest

__all__ = ["TimeLeft", "format_duration"]


class TimeLeft:
    """Work done and time left of an evaluation (see the module docstring).

    Parameters
    ----------
    requests : sequence of EvalRequest
        The pending prompts, with their pending pairs.
    clock : callable
        Seconds, monotonic (tests pass a fake).
    whole_prompts : bool
        Give no estimate before every output of some prompt is done (an engine that prefills a prompt once and replays
        every pair from it, :attr:`slake.engines.base.Engine.prefills_once`); else one output of every prompt is enough.
    """

    def __init__(
        self,
        requests: Sequence[EvalRequest],
        clock: Callable[[], float] = time.perf_counter,
        *,
        whole_prompts: bool = False,
    ) -> None:
        self._share = {r.key: (len(r.prefill_ids) + len(r.question_ids)) / max(len(r.pairs), 1) for r in requests}
        self.total = float(sum(self._share[r.key] * len(r.pairs) for r in requests))
        self.done = 0.0
        self._pending = {r.key: len(r.pairs) for r in requests}  # outputs each prompt has still to give
        self._untouched = {r.key for r in requests if r.pairs}  # prompts without an output yet
        self._whole_prompts = whole_prompts
        self._ready = not self._untouched and not whole_prompts  # the work done stands for the rest (module docstring)
        self._clock = clock
        self._start = clock()

    def update(self, key: int) -> None:
        """One output of request ``key`` is done."""
        self.done += self._share.get(key, 0.0)
        self._untouched.discard(key)
        if key in self._pending:
            self._pending[key] -= 1
            self._ready = self._ready or self._pending[key] <= 0 or (not self._untouched and not self._whole_prompts)

    def seconds_left(self) -> float | None:
        """Estimated seconds left, or None until the work done stands for the rest (every output of some prompt, or
        one of every prompt)."""
        if self.done <= 0.0 or not self._ready:
            return None
        elapsed = self._clock() - self._start
        return max(0.0, elapsed * (self.total - self.done) / self.done)

    def describe(self) -> str:
        """``"~1h02m left"``, or ``"time left: after the first prompt"`` before any output."""
        left = self.seconds_left()
        return "time left: after the first prompt" if left is None else f"~{format_duration(left)} left"


def format_duration(seconds: float) -> str:
    """``45s``, ``12m05s`` or ``3h07m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
