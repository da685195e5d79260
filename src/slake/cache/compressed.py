"""The compressor (:class:`CompressedKV`): prefill compression with layer budgets (uniform, pyramid or cascading), and
decode over the compressed cache with decode-time eviction and the optional PTAA linear term.

This module is engine-agnostic (no transformers import). ``slake.engines.transformers`` feeds it each layer's
post-RoPE queries, keys and values; the vLLM plugin uses it for the prefill of each compressed request. It is a
facade over one object per phase, sharing one :class:`~slake.cache.state.CacheState`:

* :class:`~slake.cache.prefill.PrefillCompressor`: per-layer scores, layer budgets, the cascade, eviction;
* :class:`~slake.cache.chunked.ChunkedPrefill`: a prompt fed in chunks, evicted after each;
* :class:`~slake.cache.decoding.Decoder`: new tokens, the shared decode step, static (compiled) mode;
* :mod:`slake.cache.accounting`: kept tokens and bytes, batch selection.

Conventions: ``docs/conventions.md``; positions index the (left-padded) input sequence and the token decoded at step
``t`` has position ``S + t``; budgets and evictions are per sequence; padding is never kept.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable

import torch

from slake.budgets.budget import Budget
from slake.cache import accounting
from slake.cache.chunked import ChunkedPrefill
from slake.cache.decoding import Decoder
from slake.cache.layer_store import _GROWTH, LayerStore
from slake.cache.prefill import PrefillCompressor, linear_state_slots
from slake.cache.quant import parse_kv_dtype
from slake.cache.state import CacheState, PrefillInfo
from slake.methods.base import LayerContext, Method, PrefillScores
from slake.methods.budget_check import check_method_budget

__all__ = ["KERNELS", "CompressedKV", "PrefillInfo", "linear_state_slots"]

#: the decode-step implementations :class:`CompressedKV` accepts (``"auto"``: Triton's fused kernels on NVIDIA GPUs when
#: Triton is installed, the torch step elsewhere; :func:`resolve_kernels`)
KERNELS = ("auto", "torch", "triton")

logger = logging.getLogger("slake.kernels")


#: whether :func:`kernel_choice` has said why ``"auto"`` is the torch step on an AMD GPU, with an old Triton, and on
#: a GPU without Triton (each once per process)
_told_amd = False
_told_old = False
_told_missing = False


def _importable_version(version: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
    """``version()`` (the installed Triton's release, which imports Triton), with a Triton that is installed but
    fails to import (a broken installation, one built for another torch) refused as a ValueError that says so, as
    :func:`slake.kernels.load`'s ImportError is: ``"auto"`` on an NVIDIA GPU reads the version before it loads."""
    try:
        return version()
    except ImportError as exc:
        raise ValueError(f"slake: Triton is installed but cannot be imported ({exc}); use kernels='torch'") from exc


def resolve_kernels(kernels: str, device: torch.device | str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for a :data:`KERNELS` choice on ``device`` (:func:`kernel_choice`'s choice).

    ``"auto"`` is Triton's fused kernels on an NVIDIA GPU when Triton 3.4 or later is installed
    (:data:`slake.kernels.MIN_TRITON`), the torch step elsewhere: on the CPU; on a GPU without Triton or with an older
    one; and on AMD GPUs (a ROCm build of torch, whose devices are ``"cuda"``), where the kernels compile
    (``tests/test_kernels_compile.py``) but have never run, so they are not chosen unasked (``"triton"`` chooses
    them). Each of the three GPU cases is logged once per process. Choosing ``"triton"`` loads the kernels
    (:func:`slake.kernels.load`; on a machine without CUDA through Triton's interpreter, for tests).

    Raises
    ------
    ValueError
        For an unknown name, ``"triton"`` without Triton installed or with one older than
        :data:`slake.kernels.MIN_TRITON`, the kernels failing to load (``"triton"``, or ``"auto"`` on an NVIDIA GPU),
        or ``"triton"`` for CPU tensors on a machine where Triton compiles for a GPU (the interpreter must then be
        asked for: ``TRITON_INTERPRET=1``).
    """
    return kernel_choice(kernels, device)[0]


def kernel_choice(kernels: str, device: torch.device | str | None = None) -> tuple[str, str | None]:
    """:func:`resolve_kernels`'s choice with why ``"auto"`` chose the torch step on a GPU: ``(choice, why)``, ``why``
    None except for ``"auto"`` on a ``"cuda"`` device without Triton (``"Triton not installed"``), with a Triton older
    than :data:`slake.kernels.MIN_TRITON`, or on an AMD GPU; an engine puts it in its
    :class:`~slake.cache.fused_step.KernelReport` (``auto``), so that ``statistics()["kernels"]`` and ``slake bench``'s
    rows read ``torch (auto: why)``.

    Parameters
    ----------
    kernels : str
        One of :data:`KERNELS`.
    device : torch.device or str or None
        Where the cache's tensors are (None: only the name is checked, and ``"auto"`` is the torch step).

    Returns
    -------
    tuple[str, str | None]
        ``"torch"`` or ``"triton"``, and why ``"auto"`` is the torch step on a GPU.

    Raises
    ------
    ValueError
        As :func:`resolve_kernels`.
    """
    global _told_old, _told_amd, _told_missing
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels {kernels!r}; use one of {', '.join(KERNELS)}")
    from slake.kernels import MIN_TRITON, interpreted, load, triton_available, triton_version

    cuda = device is not None and torch.device(device).type == "cuda"
    why = None
    if kernels == "auto":
        kernels = "triton" if cuda and triton_available() else "torch"
        if cuda and kernels == "torch":
            why = "Triton not installed"
            if not _told_missing:
                _told_missing = True
                logger.warning(
                    "slake: Triton is not installed: decoding with the torch step on this GPU (pip install triton "
                    "brings the fused decode kernels)"
                )
        if kernels == "triton" and _importable_version(triton_version) < MIN_TRITON:
            why = f"Triton {'.'.join(map(str, triton_version()))} is older than {'.'.join(map(str, MIN_TRITON))}"
            if not _told_old:
                _told_old = True
                logger.warning(
                    "slake: the fused decode kernels need Triton %s or later, and this is %s: decoding with the "
                    "torch step (a newer torch brings a newer Triton)",
                    ".".join(map(str, MIN_TRITON)), ".".join(map(str, triton_version())),
                )  # fmt: skip
            kernels = "torch"
        if kernels == "triton" and torch.version.hip is not None:
            why = "the kernels have not run on an AMD GPU yet"
            if not _told_amd:
                _told_amd = True
                logger.warning(
                    "slake: the fused decode kernels have not run on an AMD GPU yet: decoding with the torch step "
                    "(kernels='triton' chooses the kernels)"
                )
            kernels = "torch"
    if kernels == "triton":
        if not triton_available():
            raise ValueError("kernels='triton' needs Triton (pip install triton); use kernels='torch'")
        try:
            load()
        except (RuntimeError, ImportError) as exc:  # the interpreter asked for too late; a broken installation
            raise ValueError(str(exc)) from exc
        if triton_version() < MIN_TRITON:
            raise ValueError(
                f"kernels='triton' needs Triton {'.'.join(map(str, MIN_TRITON))} or later, and this is "
                f"{'.'.join(map(str, triton_version()))}; use kernels='torch' (or a newer torch, which brings one)"
            )
        if device is not None and not cuda and not interpreted():
            raise ValueError(
                "kernels='triton' runs on CUDA; on the CPU only through Triton's interpreter "
                "(set TRITON_INTERPRET=1 before starting Python), or use kernels='torch'"
            )
    return kernels, why


class CompressedKV:
    """A compressed KV cache for one generation.

    Parameters
    ----------
    method : Method or str
        The compression method (see :mod:`slake.methods`).
    budget : Budget | int | float
        Average per-layer cached tokens per KV head (window included), or a ratio of the prompt length.
    num_layers : int
        Number of attention layers of the model.
    charge_linear_state : bool
        Charge the PTAA linear state against the budget (SLAKE "memory honesty" option): the selectable budget of
        each layer shrinks by ``ceil((d + 1)^2 * 4 / (2 * d * itemsize))`` token slots (:func:`linear_state_slots`).
    kv_dtype : str | None
        Storage of the kept keys and values: None (the model's dtype) or ``"int8"`` / ``"fp8_e4m3"`` (8-bit codes
        with a float32 scale per row, dequantised in attention; :mod:`slake.cache.quant`).
    defer_cascade : bool
        Layer-preference methods (CAKE, SLAKE, LAVa): evict each layer at its own cascade stage and at the final
        stage only, skipping the re-evictions of earlier layers at the stages in between. The kept sets are the
        same (stage budgets never increase, so any subsequence of the stages ends in one-shot eviction with the final
        budgets, ``docs/methods/cake.md#cascading-prefill``); the PTAA linear state sums the same evicted tokens in
        fewer groups (equal up to float rounding). The cache then holds each layer at its first-stage budget (at most
        the layer cap) until the last layer, not the cascade's bound of the budget plus one layer: for engines that
        hold the whole prompt's KV during prefill anyway (the vLLM plugin), where the intermediate stages are only
        work. Default False: the paper's cascade.
    kernels : str
        The single-token decode step's implementation (:data:`KERNELS`): ``"torch"``, ``"triton"`` (fused kernels;
        on the CPU through Triton's interpreter, for tests) or ``"auto"`` (default: Triton on NVIDIA GPUs, torch
        elsewhere, decided at the first prefilled layer, and again at the first layer on a GPU after layers elsewhere:
        :meth:`kernel_choice_due`).
    """

    def __init__(
        self,
        method: Method | str,
        budget: Budget | int | float | str,
        num_layers: int,
        charge_linear_state: bool = False,
        kv_dtype: str | None = None,
        defer_cascade: bool = False,
        kernels: str = "auto",
    ) -> None:
        m, b = check_method_budget(method, budget)
        resolve_kernels(kernels)  # an unknown name, or Triton asked for and missing, fails here
        self.state = CacheState(m, b, num_layers, parse_kv_dtype(kv_dtype))
        self.prefill = PrefillCompressor(self.state, charge_linear_state, defer_cascade)
        self.decoder = Decoder(self.state)
        self.chunks = ChunkedPrefill(self.state, self.prefill, self.decoder)
        self.kernels = kernels
        #: the device type the decode step's implementation was last chosen on (None: not yet)
        self._chosen_on: str | None = None
        #: enter static mode right after the prefill, with room for ``max_cache_len`` positions in append-only layers
        self.max_cache_len: int | None = None
        #: a continuation grew this cache past its budget while it compresses nothing, and the user was told
        self._told_uncompressed = False
        #: whether such a continuation is told (once, :meth:`append`); the question-agnostic evaluation, which asks
        #: its question after compressing the context by design, turns it off on the caches it replays
        self.tell_uncompressed_turns = True

    # ------------------------------------------------------------------ configuration and shared state
    @property
    def method(self) -> Method:
        """The compression method."""
        return self.state.method

    @property
    def budget(self) -> Budget:
        """The average budget (tokens per layer and KV head)."""
        return self.state.budget

    @property
    def num_layers(self) -> int:
        """The compressed layers this cache holds."""
        return self.state.num_layers

    @property
    def kv_dtype(self) -> str | None:
        """The kept entries' 8-bit storage (``"int8"``, ``"fp8_e4m3"``), or None for the model's dtype."""
        return self.state.kv_dtype

    @property
    def charge_linear_state(self) -> bool:
        """Whether the PTAA linear state is charged against the budget (its slots come out of each layer's)."""
        return self.prefill.charge_linear_state

    @property
    def defer_cascade(self) -> bool:
        """Whether each layer is evicted at its own cascade stage and the final one only."""
        return self.prefill.defer_cascade

    @property
    def layers(self) -> list[LayerStore | None]:
        """One store per layer (None before its prefill)."""
        return self.state.layers

    @property
    def targets(self) -> list[torch.Tensor | None]:
        """Per layer, ``(B, Hkv)`` decode sizes, or None where the layer does not evict at decode."""
        return self.state.targets

    @property
    def info(self) -> PrefillInfo | None:
        """The per-sequence facts fixed at prefill."""
        return self.state.info

    @property
    def seen(self) -> list[int]:
        """Tokens seen per layer (kept or evicted), on the host."""
        return self.state.seen

    @property
    def position(self) -> list[torch.Tensor | None]:
        """Per layer, the position of the next token (0-dim int64 device tensor)."""
        return self.state.position

    @property
    def static(self) -> bool:
        """True in fixed-shape decode mode (:meth:`prepare_static`)."""
        return self.decoder.static

    @property
    def chunked_prefill(self) -> bool:
        """True between :meth:`begin_chunked_prefill` and :meth:`end_chunked_prefill`."""
        return self.chunks.active

    @property
    def layer_context(self) -> list[LayerContext | None]:
        """Per layer, the model facts the engine gives methods that ask for them (see :class:`CacheState`)."""
        return self.state.layer_context

    @layer_context.setter
    def layer_context(self, context: list[LayerContext | None]) -> None:
        if len(context) != self.num_layers:
            raise ValueError(f"{len(context)} layer contexts for {self.num_layers} layers")
        self.state.layer_context = list(context)

    @property
    def pass_scores(self) -> torch.Tensor | None:
        """``(L, B, Hkv, S)`` scores of the method's second pass, set by the engine before the prefill."""
        return self.state.pass_scores

    @pass_scores.setter
    def pass_scores(self, scores: torch.Tensor | None) -> None:
        self.state.pass_scores = scores

    @property
    def score_memo(self) -> dict[int, PrefillScores] | None:
        """Layer -> prefill scores shared by replays of one recorded prefill (see :class:`PrefillCompressor`)."""
        return self.prefill.score_memo

    @score_memo.setter
    def score_memo(self, memo: dict[int, PrefillScores] | None) -> None:
        self.prefill.score_memo = memo

    # ------------------------------------------------------------------ prefill
    def prefill_layer(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_padding: torch.Tensor | None,
        scaling: float,
    ) -> None:
        """Store layer ``layer_idx``'s prompt keys/values and compress them (called after its exact attention)."""
        if self.decoder.static:
            raise RuntimeError("this cache is in static decode mode; prefill a new cache")
        if self.state.info is None or self.kernel_choice_due(keys.device):
            self.decoder.kernels, self.decoder.report.auto = kernel_choice(self.kernels, keys.device)
            self._chosen_on = keys.device.type
        self.prefill.prefill_layer(layer_idx, queries, keys, values, key_padding, scaling, self.chunks.padding)
        self.decoder.reset_layer(layer_idx)
        if layer_idx == self.num_layers - 1:
            # a second pass's (L, B, Hkv, S) scores are read by the prefill only: 4 bytes per prompt token, layer and
            # KV head that the cache would otherwise hold, uncounted, for the whole generation
            self.state.pass_scores = None
            if self.chunks.active:
                self.chunks.tell_uniform_split()
            elif self.max_cache_len is not None:
                self.prepare_static(self.max_cache_len - keys.shape[2])

    def kernel_choice_due(self, device: torch.device) -> bool:
        """Whether a prefilled layer on ``device`` chooses the decode step's implementation again: ``"auto"`` is
        chosen at a generation's first layer, and again at the first layer on a CUDA device after layers elsewhere,
        so that a model whose first layers keep their cache on the CPU and later ones on a GPU runs the fused kernels
        on its GPU layers (its CPU layers then take the torch step, :func:`slake.kernels.host_layer`) rather than the
        torch step everywhere."""
        return self.kernels == "auto" and self._chosen_on not in (None, "cuda") and device.type == "cuda"

    def expect_trailing_prompt_tokens(self, count: int) -> None:
        """Count ``count`` prompt tokens that will follow the next prefill as decode steps in its budget and compress
        decision, so that they are those of the whole prompt (``slake.generate`` feeds a prompt's last token after a
        chunked or second-pass prefill of the rest). Call before the prefill's first layer; the next prefill
        consumes it."""
        if count < 0:
            raise ValueError(f"trailing prompt tokens must be >= 0, got {count}")
        if self.state.info is not None:
            raise RuntimeError("expect_trailing_prompt_tokens must be called before the prefill")
        self.prefill.trailing_tokens = int(count)

    def begin_chunked_prefill(self, key_padding: torch.Tensor) -> None:
        """Start a chunked prefill of a prompt whose full ``(B, S)`` padding mask (True = padded) is known.

        The budget, the compress decision and the real lengths are those of the whole prompt. The first chunk goes
        through :meth:`prefill_layer` (exact attention inside the chunk, method scores, layer budgets / cascade
        from the chunk); every later chunk is appended, attends over the compressed past plus itself
        (:meth:`decode_attention`) and each layer is evicted back to its budget (:meth:`ChunkedPrefill.evict`).

        Raises
        ------
        ValueError
            Before anything is stored, for a method that cannot prefill in chunks (:func:`slake.cache.chunked.
            check_chunkable`: a second pass over the whole prompt, KVzip, or a one-shot selection after it,
            SAGE-KV's ``Method.not_chunkable``).
        """
        self.chunks.begin(key_padding)

    def end_chunked_prefill(self, *, check: bool = True) -> None:
        """Leave chunked-prefill mode; later appends are decode steps with decode-time eviction.

        Raises
        ------
        RuntimeError
            With ``check`` (the default), when fewer tokens were fed than the prompt given to
            :meth:`begin_chunked_prefill` (:meth:`slake.cache.chunked.ChunkedPrefill.end`); ``check=False`` leaves
            the mode without it, after a chunk that failed."""
        self.chunks.end(check=check)
        if self.max_cache_len is not None and all(s is not None for s in self.layers):
            self.prepare_static(self.max_cache_len - self.seen[0])

    # ------------------------------------------------------------------ decode
    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> LayerStore:
        """Add new tokens of layer ``layer_idx`` (a decode token, a continuation, a prompt chunk); returns the store.

        A single decode token is staged and written by the decode step in :meth:`decode_attention`
        (:meth:`Decoder.append`)."""
        if self.state.layers[layer_idx] is None:
            raise RuntimeError(f"layer {layer_idx} received decode tokens before its prefill")
        if self.chunks.active:
            self.chunks.append(layer_idx, keys, values)
            return self.state.store(layer_idx)
        if layer_idx == 0 and keys.shape[2] > 1 and self.tell_uncompressed_turns and not self._told_uncompressed:
            self._tell_if_uncompressed(keys.shape[2])
        return self.decoder.append(layer_idx, keys, values)

    def _tell_if_uncompressed(self, new_tokens: int) -> None:
        """Warn once when a continuation (a later turn of a conversation) takes a cache that compresses nothing past
        its budget: the budget applies to the prompt a cache is prefilled with, and a first turn within it leaves
        the cache a full cache for every later turn (``docs/conventions.md``, one cache per conversation)."""
        info = self.state.info
        if info is None or info.compress_any or self.state.method.keeps_everything:  # the full cache keeps by design
            return
        held = self.seen[0] + new_tokens
        budget = int(info.budget.max())
        if held > budget:
            self._told_uncompressed = True
            logging.getLogger("slake").warning(
                "slake: this SlakeCache's first prompt (%d tokens) was within its budget (%d), so it compresses "
                "nothing, and this turn takes it to %d tokens, every one kept; to compress the conversation, pass "
                "the whole of it to a new SlakeCache",
                int(info.real_len.max()),
                budget,
                held,
            )

    def decode_attention(self, layer_idx: int, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of the newest ``n_q`` queries over the compressed layer, with decode-time eviction; returns
        ``(B, Hq, n_q, d)`` float32, or the query's dtype from the fused kernels and the cache's from the full cache's
        SDPA step (:meth:`Decoder.decode_attention`; during a chunked prefill the chunk's attention and the eviction
        back to the budget, :meth:`ChunkedPrefill.attention`)."""
        if self.chunks.active:
            return self.chunks.attention(layer_idx, queries, scaling)
        return self.decoder.decode_attention(layer_idx, queries, scaling)

    def attention(self, layer_idx: int, queries: torch.Tensor, positions: torch.Tensor, scaling: float) -> torch.Tensor:
        """Read-only attention of queries at ``positions`` over the layer as it is now (:meth:`Decoder.attention`)."""
        return self.decoder.attention(layer_idx, queries, positions, scaling)

    def position_of(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s next position, a 0-dim int64 device tensor (the layer must be prefilled)."""
        return self.decoder.position_of(layer_idx)

    def seen_tokens(self, layer_idx: int) -> int:
        """Tokens layer ``layer_idx`` has seen (its next position); in static mode a read of the device counter."""
        return self.decoder.seen_tokens(layer_idx)

    def prepare_static(self, decode_tokens: int) -> None:
        """Enter static (fixed-shape) decode mode after the prefill (:meth:`Decoder.prepare_static`)."""
        if self.chunks.active:
            raise RuntimeError("prepare_static is called after the chunked prefill ended")
        self.decoder.prepare_static(decode_tokens)

    def static_tensors(self) -> list[torch.Tensor]:
        """Every tensor a static decode step reads or updates in place (``torch._dynamo.mark_static_address``)."""
        return self.decoder.static_tensors()

    def expect_decode_steps(self, steps: int) -> None:
        """Size an append-only layer's growth for ``steps`` decode steps (at most the default 256 slots at once):
        a generation that decodes 40 tokens then holds room for 40, not 256 (``CacheState.growth``). More steps
        than that grow the layer again; a compressed layer, which evicts, never grows."""
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        self.state.growth = min(int(steps), _GROWTH)

    # ------------------------------------------------------------------ reporting and batch manipulation
    def kept_tokens_per_layer(self) -> list[float]:
        """Mean kept tokens per KV head and sequence, per layer."""
        return accounting.kept_tokens_per_layer(self.state)

    def byte_counts(self, sequence: int | None = None) -> dict[str, int]:
        """Bytes of the whole cache (:func:`slake.cache.accounting.byte_counts`)."""
        return accounting.byte_counts(self.state, sequence)

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder / select sequences (beam search)."""
        accounting.map_batch(self.state, index=index)
        self.decoder.reset_all()

    def repeat_batch(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times."""
        accounting.map_batch(self.state, repeats=repeats)
        self.decoder.reset_all()
