"""Prefill once, compress many (``docs/design.md#prefill-once-compress-many``).

Compression never changes prefill outputs (each layer's attention is exact and the layer is compressed afterwards),
and the cascade only depends on the per-layer queries/keys/values in layer order. So one full prefill can be
recorded — every layer's post-RoPE queries, keys and values plus the last-position logits — and replayed into any
number of (method, budget) caches, each giving exactly the cache that live compression would have built. Decoding
then continues from each replayed cache with a plain greedy loop.

Hybrid models: the sliding-window (and chunked) layers are not compressed; their prefill keys and values are
recorded too and replayed into a fresh bounded layer of transformers' own class, which keeps exactly what it kept in
the live prefill.

A capture can be kept on disk across runs (:class:`CaptureStore`): it is saved exactly (the same tensors, bit for
bit), under a key made of the prompt's token ids and a fingerprint of the model (its configuration, dtype, device
type, a digest of every weight and the versions that ran it: :func:`model_fingerprint`), so a later run on the same
prompt and model replays it instead of prefilling again, with the same results. A second-pass method's scores
(KVzip's reconstruction) are kept beside the capture in the same way (:meth:`CaptureStore.save_pass_scores`), so a
later run skips that pass as well.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slake.budgets.budget import Budget
from slake.cache.compressed import CompressedKV
from slake.engines.transformers.attention import prepare_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.window_layer import WindowLayer
from slake.methods.base import Method, make_method


class _RecordingKV(CompressedKV):
    """A full-cache compressor that also records each layer's prefill inputs (``keep_queries=False``: only the last
    query row, for replays whose method reads no prefill query)."""

    def __init__(self, num_layers: int, keep_queries: bool = True) -> None:
        super().__init__(make_method("full"), 1, num_layers)
        self.records: list[tuple] = [None] * num_layers
        self.keep_queries = keep_queries

    def prefill_layer(self, layer_idx, queries, keys, values, key_padding, scaling) -> None:
        kept = queries if self.keep_queries else queries[:, :, -1:]
        self.records[layer_idx] = (kept, keys, values, key_padding, scaling)
        super().prefill_layer(layer_idx, queries, keys, values, key_padding, scaling)


@dataclass
class PrefillCapture:
    """A recorded prefill: per-layer prefill inputs, the prompt's attention mask and last logits."""

    records: list[tuple]  # per compressed layer (the compressor's order)
    attention_mask: torch.Tensor  # (B, S) 1 = real token
    last_logits: torch.Tensor  # (B, vocab) float32 logits at the last prompt position
    prefill_s: float
    config: Any = None  # the model's config (its layer types); None: every layer compressed
    bounded: dict = field(default_factory=dict)  # model layer index -> (keys, values) of a sliding/chunked layer
    #: per compressed layer, the model facts methods may ask for (rotary embedding, output projection)
    layer_context: list = field(default_factory=list)
    #: ``(B, S)`` the prompt's token ids (a second pass, KVzip's reconstruction, reads them)
    input_ids: torch.Tensor | None = None
    #: second-pass scores already computed on this capture, by ``Method.second_pass_key()``
    pass_scores: dict = field(default_factory=dict)
    num_layers: int = field(init=False)
    #: True when the capture was read from a :class:`CaptureStore` instead of prefilled in this run
    cached: bool = field(init=False, default=False)
    _score_memos: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.num_layers = len(self.records)

    @property
    def prompt_len(self) -> int:
        """Padded prompt length ``S``."""
        return self.attention_mask.shape[1]

    def replay(
        self, method: str | Method, budget: int | float | str | Budget, kv_dtype: str | None = None, **hyperparameters
    ) -> SlakeCache:
        """A :class:`SlakeCache` holding the compressed prompt, as live compression would have left it.

        A method whose prefill scores do not depend on the budget (``prefill_scores_use_budget = False``, e.g.
        H2O) computes them once per capture and method configuration; later replays at other budgets reuse them.
        """
        method = make_method(method, **hyperparameters)
        if self.config is not None:
            cache = SlakeCache(method, budget, config=self.config, kv_dtype=kv_dtype)
        else:
            cache = SlakeCache(method, budget, self.num_layers, kv_dtype=kv_dtype)
        if not method.prefill_scores_use_budget:
            cache.compressor.score_memo = self._score_memos.setdefault(repr(method), {})
        return self.replay_into(cache)

    def replay_into(self, cache: SlakeCache, pass_scores: torch.Tensor | None = None) -> SlakeCache:
        """Prefill an empty ``cache`` (any method, budget and options, static or not) from the records, as live
        compression would have; ``pass_scores``: the method's second-pass scores (``Method.second_pass``), else
        those computed on this capture for the method's configuration."""
        eng = cache.compressor
        if self.layer_context:
            eng.layer_context = list(self.layer_context)
        if pass_scores is None and eng.method.second_pass is not None:
            pass_scores = self.pass_scores.get(eng.method.second_pass_key())
        eng.pass_scores = pass_scores
        for slot, (q, k, v, pad, scaling) in enumerate(self.records):
            eng.prefill_layer(slot, q, k, v, pad, scaling)
            cache.layers[cache.layout.compressed[slot]].lazy_initialization(k, v)
        for layer, (k, v) in self.bounded.items():
            bounded = cache.layers[layer]
            bounded.update(k, v)
            if isinstance(bounded, WindowLayer):  # a fixed-shape cache's ring: its padded slots, which no mask hides
                bounded.mark_padding(self.attention_mask == 0)
        return cache


def capture_prefill(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, keep_queries: bool = True
) -> PrefillCapture:
    """Run one exact prefill of ``input_ids`` (left-padded) and record what compression needs (``keep_queries=False``:
    every layer's keys and values but only the last query row, for methods that read no prefill query)."""
    from slake.engines.transformers.layer_facts import layer_contexts

    prepare_model(model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = SlakeCache("full", 1, config=model.config)
    recorder = _RecordingKV(len(cache.layout.compressed), keep_queries=keep_queries)
    cache.compressor = recorder
    bounded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, layer in enumerate(cache.layers):
        if i in cache.layout.bounded:
            layer.update = _recording_update(layer.update, bounded, i)
        else:
            layer.compressor = recorder
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **with_cache(model, cache),
            position_ids=_positions(attention_mask),
            logits_to_keep=1,
        )
    cache.check_routed()
    return PrefillCapture(
        records=recorder.records,
        attention_mask=attention_mask,
        last_logits=out.logits[:, -1].float(),
        prefill_s=time.perf_counter() - start,
        config=model.config if cache.layout.hybrid else None,
        bounded=bounded,
        layer_context=layer_contexts(model, cache.layout.compressed, cache.layout.layer_types),
        input_ids=input_ids,
    )


def _layer_contexts(model) -> list:
    """The model facts of every compressed layer (a stored capture holds none: they are the model's own tensors)."""
    from slake.engines.transformers.layer_facts import layer_contexts

    layout = SlakeCache("full", 1, config=model.config).layout
    return layer_contexts(model, layout.compressed, layout.layer_types)


#: what a stored capture holds and how (bumped when that changes, so older files are prefilled again, not misread)
CAPTURE_FORMAT = 2


def weights_digest(model) -> str | None:
    """A digest of every parameter and persistent buffer of ``model``: each one's name, shape, dtype, float64 sum (to
    9 significant digits) and a sample of its values at evenly spaced positions (a change to any tensor, such as a
    merged LoRA on some layers, changes the digest). Non-persistent buffers (the rotary ``inv_freq``, which dynamic
    and LongRoPE scaling rewrite in the forward) are left out. One pass over the weights, summed in slices of 4M
    values (no float64 copy of a whole tensor).

    Returns
    -------
    str | None
        A sha256 hex digest; None when a tensor is on the meta device (offloaded by accelerate: its values are not
        in the model, and how many layers are offloaded depends on the memory free at load time).
    """
    digest = hashlib.sha256()
    saved = set(model.state_dict(keep_vars=True))
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in saved]
    with torch.no_grad():
        for name, t in tensors:
            if t.device.type == "meta":
                return None
            digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.numel() == 0:
                continue
            flat = t.detach().flatten()  # a view where the tensor is contiguous (every weight of a loaded model)
            total = sum(float(part.sum(dtype=torch.float64)) for part in flat.split(1 << 22))
            sample = flat[:: max(1, flat.numel() // 64)].to("cpu", torch.float64)
            # 9 significant digits: the same on every device, whatever order its reduction adds in
            digest.update(f"{total:.9g}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def model_fingerprint(model) -> str:
    """A digest of what makes a model's prefill what it is: its configuration, dtype, device type, every weight
    (:func:`weights_digest`), the transformers and torch versions that ran it and :data:`CAPTURE_FORMAT` (so that
    two checkpoints of one architecture under one name differ, and an upgrade prefills again).

    Raises
    ------
    ValueError
        For a model with offloaded (meta) weights, whose values cannot be read.
    """
    import transformers

    weights = weights_digest(model)
    if weights is None:
        raise ValueError(
            "--prefill-cache (prefill_cache) needs the model's weights in memory to tell checkpoints apart, and "
            "accelerate has offloaded some (device_map): load the model without offloading, or run without the cache"
        )
    params = list(model.parameters())
    config = model.config.to_dict()
    for transient in (
        "_attn_implementation_autoset",
        "_attn_implementation",
        "slake_model_name",
        "transformers_version",  # the checkpoint's, not the one running (below)
    ):
        config.pop(transient, None)
    blob = json.dumps(
        {
            "config": config,
            "dtype": str(params[0].dtype),
            "device": params[0].device.type,
            "weights": weights,
            "versions": [transformers.__version__, torch.__version__, CAPTURE_FORMAT],
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class CaptureStore:
    """Prefill captures of single prompts kept in a folder across runs (``slake eval --prefill-cache DIR``).

    One file per (model fingerprint, prompt token ids), written atomically. A capture of an ``S``-token prompt holds
    every layer's queries, keys and values in the model's dtype: for Qwen2.5-0.5B in fp32 about 108 KiB per token
    (0.9 GB at 8K tokens), so the folder is the user's to clear. Second-pass scores (KVzip's reconstruction) go to its
    ``second_pass/`` subfolder, one file per prompt and pass configuration (:meth:`save_pass_scores`). A file is read
    back only when its archive's CRC-32s match (a damaged one counts as missing and is written again); a write that
    fails (a full disk) warns once and ends the store's writes, not the run.

    Parameters
    ----------
    folder : path-like
        Created when missing.
    model : transformers model
        The model whose captures are stored (its :func:`model_fingerprint` is part of every key).
    """

    def __init__(self, folder: str | os.PathLike[str], model) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.fingerprint = model_fingerprint(model)
        #: False after a write failed (:meth:`_write`): the store still reads, and writes nothing more
        self.writable = True

    def path(self, ids: list[int]) -> Path:
        """The file of one prompt's capture."""
        digest = hashlib.sha256(self.fingerprint.encode())
        digest.update(json.dumps(list(ids)).encode())
        return self.folder / f"{digest.hexdigest()[:32]}.pt"

    def load(self, ids: list[int]) -> PrefillCapture | None:
        """The stored capture of ``ids``, or None. A file that cannot be read is treated as missing (and replaced
        by the next :meth:`save`)."""
        data = self._read(self.path(ids), ids)
        if data is None:
            return None
        capture = PrefillCapture(
            records=[tuple(r) for r in data["records"]],
            attention_mask=data["attention_mask"],
            last_logits=data["last_logits"],
            prefill_s=float(data["prefill_s"]),
            config=self.model.config if data["hybrid"] else None,
            bounded={int(k): tuple(v) for k, v in data["bounded"].items()},
            layer_context=_layer_contexts(self.model),
            input_ids=torch.tensor([list(ids)], dtype=torch.long, device=data["attention_mask"].device),
        )
        capture.cached = True
        return capture

    def pass_path(self, ids: list[int], key: str) -> Path:
        """The file of one prompt's second-pass scores for one pass configuration ``key`` (in ``second_pass/``, so
        that the folder's ``*.pt`` files stay one per capture)."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return self.folder / "second_pass" / f"{self.path(ids).stem}-{digest}.pt"

    def load_pass_scores(self, ids: list[int], key: str) -> tuple[torch.Tensor, float] | None:
        """The stored ``(L, 1, Hkv, S)`` second-pass scores of the single prompt ``ids`` under ``key`` and the
        seconds their pass took, or None (a file that cannot be read, or one of another prompt, model or key, counts
        as missing)."""
        data = self._read(self.pass_path(ids, key), ids)
        if data is None or data.get("key") != key:
            return None
        return data["scores"], float(data["seconds"])

    def _read(self, path: Path, ids: list[int]) -> dict | None:
        """The contents of a stored file of the prompt ``ids`` on this model, or None: missing, unreadable, damaged
        (a CRC-32 of its archive does not match), or of another prompt or model (a hash collision, or a file from
        elsewhere)."""
        if not path.is_file():
            return None
        try:
            with open(path, "rb") as f:
                # torch.load checks no CRC: a damaged byte in a tensor (a disk error, a crash after the rename
                # before the data reached the disk) was read back silently; the archive's own CRC-32s catch it. An
                # entry marked a folder (torch.save writes none) is damage too: torch's reader takes it for an
                # empty record, the tensor's memory left unset, where zipfile's check reads its bytes
                with zipfile.ZipFile(f) as archive:
                    if archive.testzip() is not None or any(
                        info.filename.endswith("/") or info.external_attr & 0x10 for info in archive.infolist()
                    ):
                        return None
                f.seek(0)
                data = torch.load(f, map_location=next(self.model.parameters()).device, weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile):
            return None
        if not isinstance(data, dict) or data.get("ids") != list(ids) or data.get("fingerprint") != self.fingerprint:
            return None
        return data

    def save_pass_scores(self, ids: list[int], key: str, scores: torch.Tensor, seconds: float) -> Path | None:
        """Write the single prompt's ``(L, 1, Hkv, len(ids))`` second-pass scores under ``key`` atomically, with the
        seconds their pass took; returns the file's path (None when it could not be written: :meth:`_write`).

        Raises
        ------
        ValueError
            For scores of more than one sequence or of another length than ``ids``.
        """
        if scores.dim() != 4 or scores.shape[1] != 1 or scores.shape[-1] != len(ids):
            raise ValueError(
                f"save_pass_scores takes one prompt's (L, 1, Hkv, {len(ids)}) scores, got {tuple(scores.shape)}"
            )
        data = {"ids": list(ids), "fingerprint": self.fingerprint, "key": key, "scores": _compact(scores)}
        data["seconds"] = float(seconds)
        return self._write(self.pass_path(ids, key), data)

    def _write(self, path: Path, data: dict) -> Path | None:
        """``torch.save`` ``data`` to ``path`` through a temporary file in the same folder, so that a reader never
        sees a partial file; returns ``path``, or None when it could not be written.

        A failed write (a full disk, a folder that became read-only) is not the run's failure: the stored files only
        save work, so the partial file is removed, one warning names the folder and the error, and the store writes
        nothing more in this run (each later try would write up to the free space again) while it still reads.
        """
        if not self.writable:
            return None
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".part", dir=path.parent)
            os.close(fd)
            torch.save(data, tmp)
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:  # torch's zip writer reports a full disk as a RuntimeError
            self.writable = False
            logging.getLogger("slake").warning(
                "slake: --prefill-cache (prefill_cache) could not write %s (%s: %s; is the disk full?); this run "
                "goes on without storing more captures or second-pass scores in %s, and its rows are unchanged",
                path.name,
                type(e).__name__,
                str(e).strip(),
                self.folder,
            )
            return None
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        return path

    def save(self, ids: list[int], capture: PrefillCapture) -> Path | None:
        """Write ``capture`` (of the single prompt ``ids``) atomically; returns its path (None when it could not be
        written: :meth:`_write`)."""
        path = self.path(ids)
        data = {
            "ids": list(ids),
            "fingerprint": self.fingerprint,
            "records": [tuple(_compact(x) for x in r) for r in capture.records],
            "attention_mask": capture.attention_mask,
            "last_logits": _compact(capture.last_logits),
            "prefill_s": capture.prefill_s,
            "hybrid": capture.config is not None,
            "bounded": {k: tuple(_compact(x) for x in v) for k, v in capture.bounded.items()},
        }
        return self._write(path, data)


def _compact(x: Any) -> Any:
    """A tensor that owns exactly its elements (``torch.save`` writes a view's whole storage), else ``x`` itself."""
    if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes() != x.numel() * x.element_size():
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _recording_update(update, bounded: dict, layer: int):
    """A bounded layer's ``update`` that also records the prompt's keys and values it is given."""

    def record(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        bounded[layer] = (key_states, value_states)
        return update(key_states, value_states, *args, **kwargs)

    return record


def stack_captures(captures: list[PrefillCapture], *, release: bool = False) -> PrefillCapture:
    """Left-pad single-sequence captures of different lengths into one batched capture.

    Each sequence's recorded queries/keys/values already carry its own RoPE positions (``0 .. n-1``), so padding
    them on the left gives exactly the records a left-padded batched prefill would have produced, without paying
    for the padded batch's masked attention (on CPU, masked SDPA over a padded batch is much slower than one
    unpadded prefill per sequence). The stacked capture replays into a batched cache whose rows decode together:
    the evaluation runner uses this to decode many samples per (method, budget) pair at once.

    Parameters
    ----------
    captures : list of PrefillCapture
        Captures of batch size 1 (e.g. from :func:`capture_prefill` on one prompt each), same model.
    release : bool
        Drop each input's per-layer records once they are copied (the inputs can no longer be replayed), so the
        peak memory is the stacked records plus one layer instead of twice the records.

    Returns
    -------
    PrefillCapture
        Batch ``len(captures)``, padded to the longest prompt; ``prefill_s`` is the sum of the captures'.

    Raises
    ------
    ValueError
        For an empty list, a capture with batch size > 1 or captures of different models (layer counts).
    """
    if not captures:
        raise ValueError("stack_captures needs at least one capture")
    if any(c.attention_mask.shape[0] != 1 for c in captures):
        raise ValueError("stack_captures takes captures of batch size 1")
    if len({c.num_layers for c in captures}) != 1:
        raise ValueError("captures come from models with different numbers of layers")
    if len(captures) == 1:
        return captures[0]
    S = max(c.prompt_len for c in captures)

    def left_pad(t: torch.Tensor, n: int) -> torch.Tensor:  # pad dim -2 (sequence) of (1, H, n, d) on the left
        return torch.cat([t.new_zeros((*t.shape[:-2], S - n, t.shape[-1])), t], -2) if n < S else t

    records = []
    for layer in range(captures[0].num_layers):
        qs, ks, vs, pads = [], [], [], []
        scaling = captures[0].records[layer][4]
        for c in captures:
            q, k, v, pad, _ = c.records[layer]
            n = k.shape[-2]
            qs.append(left_pad(q, n))
            ks.append(left_pad(k, n))
            vs.append(left_pad(v, n))
            own = pad if pad is not None else torch.zeros(1, n, dtype=torch.bool, device=k.device)
            pads.append(torch.cat([torch.ones(1, S - n, dtype=torch.bool, device=k.device), own], 1))
        records.append((torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(pads), scaling))
        del qs, ks, vs
        if release:
            for c in captures:
                c.records[layer] = None
    if release:
        for c in captures:
            c.records = []
    bounded = {
        layer: (
            torch.cat([left_pad(c.bounded[layer][0], c.bounded[layer][0].shape[-2]) for c in captures]),
            torch.cat([left_pad(c.bounded[layer][1], c.bounded[layer][1].shape[-2]) for c in captures]),
        )
        for layer in captures[0].bounded
    }
    if release:
        for c in captures:
            c.bounded = {}
    masks = [torch.cat([c.attention_mask.new_zeros(1, S - c.prompt_len), c.attention_mask], 1) for c in captures]
    ids = None
    if all(c.input_ids is not None for c in captures):
        ids = torch.cat([torch.cat([c.input_ids.new_zeros(1, S - c.prompt_len), c.input_ids], 1) for c in captures])
    return PrefillCapture(
        records=records,
        attention_mask=torch.cat(masks),
        last_logits=torch.cat([c.last_logits for c in captures]),
        prefill_s=sum(c.prefill_s for c in captures),
        config=captures[0].config,
        bounded=bounded,
        layer_context=captures[0].layer_context,
        input_ids=ids,
    )


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def greedy_decode(
    model,
    capture: PrefillCapture,
    cache: SlakeCache,
    max_new_tokens: int,
    eos_token_ids: list[int] | None = None,
    extra_ids: torch.Tensor | None = None,
    logprobs: list[torch.Tensor] | None = None,
) -> list[list[int]]:
    """Greedy continuation of a replayed cache; returns the new token ids of each sequence (EOS included).

    ``extra_ids`` (``(B, n)``) are fed as one chunk before generating: the question of a question-agnostic run
    (compress the context, then ask). Without it the first token comes from the recorded prefill logits.
    ``logprobs``, when given, receives the ``(B, vocab)`` float32 log-probabilities each token was chosen from.
    """
    eos = set(eos_token_ids or [])
    mask = capture.attention_mask
    B = mask.shape[0]
    real = mask.sum(-1)
    with torch.inference_mode():
        if extra_ids is not None:
            # the question after the compressed context is the protocol, not a later turn the user should redo
            cache.compressor.tell_uncompressed_turns = False
            n = extra_ids.shape[1]
            mask = torch.cat([mask, torch.ones_like(extra_ids)], 1)
            pos = real[:, None] + torch.arange(n, device=mask.device)[None]
            logits = model(
                input_ids=extra_ids, attention_mask=mask, **with_cache(model, cache), position_ids=pos, logits_to_keep=1
            ).logits[:, -1]
            real = real + n
        else:
            logits = capture.last_logits
        tokens: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        for step in range(max_new_tokens):
            if logprobs is not None:
                logprobs.append(torch.log_softmax(logits.float(), -1))
            nxt = logits.argmax(-1)
            for b in range(B):
                if not done[b]:
                    tokens[b].append(int(nxt[b]))
                    done[b] = int(nxt[b]) in eos
            if all(done) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], 1)
            pos = (real + step)[:, None]
            step_out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, **with_cache(model, cache))
            logits = step_out.logits[:, -1]
    cache.check_routed()
    return tokens
