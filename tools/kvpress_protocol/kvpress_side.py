"""kvpress's side of ``slake eval --protocol kvpress`` (runs in the kvpress environment; imports no slake code).

Reads ``DIR/kvpress_requests.json`` (written by ``slake eval --protocol kvpress --out DIR``: every sample's context ids
and question ids exactly as our side prefills them, the compression ratios, the model's location and its stop ids),
runs kvpress's presses on them and appends one line per (sample, press, ratio) to ``DIR/kvpress_outputs.jsonl``; the
next ``slake eval --protocol kvpress --out DIR`` merges them into ``results.jsonl`` as ``kvpress:<press>`` rows.

What runs is kvpress's pipeline (``KVPressTextGenerationPipeline._forward`` and ``generate_answer``, kvpress 0.5.5):
the context is prefilled with the press's hooks on the attention layers (question-agnostic: the question is not in
the prefill), then the question ids are fed at positions ``S, S+1, ...`` and the answer decoded greedily into the
compressed cache, which only grows. The presses are those of kvpress's ``evaluation/evaluate_registry.py`` under the
same names (``PRESSES`` below). Two things are arranged for CPU time, neither changes a token:

* one prefill serves every press and ratio: a forward hook on each attention layer calls every press's own
  ``compress`` on the layer's hidden states, keys and values (what ``BasePress.forward_hook`` hands it) and keeps
  the result, instead of one prefill per (press, ratio). A layer's compression never changes the prefill's outputs
  (the hook runs after the layer's attention, and later layers read only their own cache), so the kept keys and
  values are the ones a separate prefill would give; ``--check-native`` runs kvpress's own ``with press(model)``
  path for the first sample and says whether the generated tokens agree.
* KVzip (``KVzipPress``: a context-reconstruction pass after the prefill, then per-head masking) scores once: its
  ``compress_post`` is called for each ratio on the same scores.

Generation stops at the ids our side stops at (the requests' ``eos_token_ids``), so both sides generate under the
same rule; kvpress's pipeline reads ``model.generation_config.eos_token_id``.

The model: a GGUF file is de-quantised once with transformers (``from_pretrained(..., gguf_file=...)``) and saved as
a local safetensors directory (``--hf-dir``, default ``~/.cache/slake/kvpress-hf/<file stem>-<8 hex digits>``, the
digits a hash of the file's location), which is loaded with ``attn_implementation="sdpa"`` in float32: KVzip reads
the tokenizer from ``model.config.name_or_path``, which needs such a directory. The directory records what it was
made from (``slake_source.json``, written last): a conversion cut short is made again, and a directory made from
another GGUF file is refused.

``--tasks`` (comma-separated, as ``slake eval`` takes them) and ``--samples`` select requests; a task the requests
file does not hold, ``--samples`` below 1, or an empty selection is refused before the model loads.

    /work/venv-kvpress/bin/python tools/kvpress_protocol/kvpress_side.py --dir runs/protocol \\
        --presses no_press,snapkv,pyramidkv,tova,streaming_llm,knorm,keydiff,expected_attention,adakv_snapkv,kvzip
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

OUTPUTS_FILE = "kvpress_outputs.jsonl"
REQUESTS_FILE = "kvpress_requests.json"


def make_press(name: str):
    """kvpress's press of a registry name (``evaluation/evaluate_registry.py``, NVIDIA/kvpress 8bb29b9), or None for
    ``no_press``."""
    from kvpress import (
        AdaKVPress,
        CriticalAdaKVPress,
        CriticalKVPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        KVzipPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    registry = {
        "no_press": lambda: None,
        "snapkv": SnapKVPress,
        "pyramidkv": PyramidKVPress,
        "tova": TOVAPress,
        "streaming_llm": StreamingLLMPress,
        "knorm": KnormPress,
        "keydiff": KeyDiffPress,
        "expected_attention": lambda: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)),
        "expected_attention_plain": ExpectedAttentionPress,  # not in the registry: ExpectedAttention without AdaKV
        "adakv_snapkv": lambda: AdaKVPress(SnapKVPress()),
        "critical_snapkv": lambda: CriticalKVPress(SnapKVPress()),
        "critical_adakv_snapkv": lambda: CriticalAdaKVPress(SnapKVPress()),
        "critical_expected_attention": lambda: CriticalKVPress(ExpectedAttentionPress(use_vnorm=False)),
        "critical_adakv_expected_attention": lambda: CriticalAdaKVPress(ExpectedAttentionPress(use_vnorm=False)),
        "kvzip": KVzipPress,
    }
    if name not in registry:
        raise SystemExit(f"unknown press {name!r}; known: {', '.join(registry)}")
    return registry[name]()


PRESSES = "no_press,snapkv,pyramidkv,tova,streaming_llm,knorm,keydiff,expected_attention,adakv_snapkv,kvzip"


#: written into the de-quantised model's directory last: what it was made from (and that it is complete)
SOURCE_FILE = "slake_source.json"


def default_hf_dir(model_path: str, gguf: str) -> Path:
    """Where a GGUF file is de-quantised to by default: ``~/.cache/slake/kvpress-hf/<file stem>-<8 hex digits>``.

    The digits hash the model's location and file name, so that two GGUF files of the same name in different
    places (``model.gguf`` of two checkpoints) get different directories.

    Parameters
    ----------
    model_path : str
        The requests' ``model_path`` (a directory or hub id).
    gguf : str
        The requests' ``gguf_file`` (a file name inside ``model_path``).

    Returns
    -------
    Path
        The directory (not created).
    """
    digest = hashlib.sha256(json.dumps([str(model_path), str(gguf)]).encode("utf-8")).hexdigest()[:8]
    return Path.home() / ".cache" / "slake" / "kvpress-hf" / f"{Path(gguf).stem}-{digest}"


def hf_dir_source(hf_dir: Path) -> dict | None:
    """What the de-quantised model in ``hf_dir`` was made from (``model_path``, ``gguf_file``), or None when the
    directory holds no complete conversion (none yet, or one interrupted before its source was recorded)."""
    path = hf_dir / SOURCE_FILE
    if not path.is_file():
        return None
    try:
        source = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return source if isinstance(source, dict) else None


def load_model(requests: dict, hf_dir: Path | None):
    """The model and tokenizer, from a local safetensors directory made once from the GGUF file.

    The directory records what it was made from (:data:`SOURCE_FILE`, written after the model and tokenizer): an
    incomplete one is made again, and one made from another GGUF file is refused (SystemExit) rather than loaded in
    its place.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, gguf = requests["model_path"], requests.get("gguf_file")
    if gguf:
        hf_dir = hf_dir or default_hf_dir(path, gguf)
        wanted = {"model_path": str(path), "gguf_file": str(gguf)}
        source = hf_dir_source(hf_dir)
        if source is not None and source != wanted:
            raise SystemExit(
                f"{hf_dir} holds the model de-quantised from {source.get('gguf_file')!r} in "
                f"{source.get('model_path')!r}, not {gguf!r} in {path!r}; give another --hf-dir"
            )
        if source is None:
            model = AutoModelForCausalLM.from_pretrained(path, gguf_file=gguf, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf)
            model.save_pretrained(hf_dir)
            tok.save_pretrained(hf_dir)
            del model
            (hf_dir / SOURCE_FILE).write_text(json.dumps(wanted) + "\n", encoding="utf-8")
        path = str(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


def layers(model):
    return model.model.layers


def reset_masks(model) -> None:
    """kvpress's per-head presses leave ``masked_key_indices`` on the attention modules."""
    for layer in layers(model):
        layer.self_attn.masked_key_indices = None


class Capture:
    """Per (press, ratio): every layer's kept keys and values and its ``masked_key_indices``, from one prefill."""

    def __init__(self, model, presses: dict):
        self.model, self.presses = model, presses  # (name, ratio) -> press (KVzip excluded)
        self.kept: dict = {key: {} for key in presses}
        self.seconds = dict.fromkeys(presses, 0.0)
        self.full: dict = {}

    def hook(self, module, args, kwargs, output):
        """``BasePress.forward_hook`` for every press at once, without writing the cache."""
        cache = kwargs["past_key_values"]
        i = module.layer_idx
        keys, values = cache.layers[i].keys, cache.layers[i].values
        self.full[i] = (keys, values)
        for key, press in self.presses.items():
            start = time.perf_counter()
            module.masked_key_indices = None
            k, v = press.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            self.kept[key][i] = (k, v, getattr(module, "masked_key_indices", None))
            module.masked_key_indices = None
            self.seconds[key] += time.perf_counter() - start
        return output


def cache_of(layers_kv: dict):
    """A ``DynamicCache`` holding the given per-layer keys and values, and the per-layer masks."""
    from transformers import DynamicCache

    cache = DynamicCache()
    masks = []
    for i in sorted(layers_kv):
        k, v, mask = layers_kv[i]
        cache.update(k, v, i)
        masks.append(mask)
    return cache, masks


def generate(model, cache, masks, question_ids: list[int], context_len: int, max_new: int, eos: set[int]):
    """kvpress's ``generate_answer`` (greedy), with the per-head masks of the press set on the modules."""
    for layer, mask in zip(layers(model), masks, strict=True):
        layer.self_attn.masked_key_indices = mask
    q = torch.tensor([question_ids])
    pos = torch.arange(context_len, context_len + q.shape[1]).unsqueeze(0)
    if len({layer.keys.shape[2] for layer in cache.layers}) == 1:
        out = model(input_ids=q, past_key_values=cache, position_ids=pos, logits_to_keep=1)
    else:  # layers of different lengths (PyramidKV): the model's one chunk mask fits one length only, so the
        # question goes in token by token (causal attention: the same result; kvpress on GPU uses FlashAttention,
        # which needs no mask)
        for j in range(q.shape[1]):
            out = model(input_ids=q[:, j : j + 1], past_key_values=cache, position_ids=pos[:, j : j + 1])
    pos = pos[:, -1:] + 1
    ids = [int(out.logits[0, -1].argmax())]
    for i in range(max_new - 1):
        if ids[-1] in eos:
            break
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=pos + i)
        ids.append(int(out.logits[0, -1].argmax()))
    reset_masks(model)
    return ids


def counts(layers_kv: dict, context_len: int, n_heads: int) -> tuple[float, float, int]:
    """(entries a layer and KV head attends to, entries it stores, bytes stored), means over layers and heads."""
    attended, held, nbytes = [], [], 0
    for k, v, mask in layers_kv.values():
        stored = k.shape[2]
        held.append(stored)
        attended.append(stored - (0 if mask is None else len(mask[0]) / n_heads))
        nbytes += k.numel() * k.element_size() + v.numel() * v.element_size()
    return sum(attended) / len(attended), sum(held) / len(held), nbytes


def run_request(model, tok, req: dict, names: list[str], ratios: list[float], eos: set[int]) -> list[dict]:
    """Every (press, ratio) of one sample from one prefill (KVzip: one reconstruction pass)."""
    ids = torch.tensor([req["prefill_ids"]])
    S = ids.shape[1]
    H = model.config.num_key_value_heads
    presses = {}
    for name in names:
        if name in ("no_press", "kvzip"):
            continue
        for r in ratios:
            p = make_press(name)
            p.compression_ratio = r
            p.post_init_from_model(model)
            presses[(name, r)] = p
    cap = Capture(model, presses)
    lm = model.model
    for layer in lm.layers:  # what BasePress.__call__ sets before hooking
        layer.self_attn.rotary_emb = lm.rotary_emb
    kvzip_scores = None
    kvzip = make_press("kvzip") if "kvzip" in names else None
    from transformers import DynamicCache

    cache = DynamicCache()
    start = time.perf_counter()
    with torch.inference_mode():
        recorded = []
        if kvzip is not None:
            kvzip.compression_ratio = ratios[0]  # > 0, so that it scores; compress_post is replaced below
            kvzip.compress_post = lambda m: recorded.append(kvzip.score_val.clone())
        with kvzip(model) if kvzip is not None else contextlib.nullcontext():
            hooks = [layer.self_attn.register_forward_hook(cap.hook, with_kwargs=True) for layer in lm.layers]
            try:
                lm(input_ids=ids, past_key_values=cache)
            finally:
                for h in hooks:
                    h.remove()
            prefill_end = time.perf_counter()
        kvzip_s = time.perf_counter() - prefill_end
        # the prefill alone: the hook's calls of every press's compress ran inside it (each is in its compress_s)
        prefill_s = prefill_end - start - sum(cap.seconds.values())
        if kvzip is not None:
            kvzip_scores = recorded[0]
    full = {i: (k, v, None) for i, (k, v) in cap.full.items()}
    configs: list[tuple[str, float | None, dict, float]] = []
    if "no_press" in names:
        configs.append(("no_press", None, full, 0.0))
    for (name, r), kept in cap.kept.items():
        configs.append((name, r, kept, cap.seconds[(name, r)]))
    if kvzip is not None:
        from kvpress import KVzipPress

        for r in ratios:
            start = time.perf_counter()
            kvzip.compression_ratio = r
            kvzip.score_val = kvzip_scores.clone()
            KVzipPress.compress_post(kvzip, model)
            kept = {i: (k, v, layers(model)[i].self_attn.masked_key_indices) for i, (k, v, _) in full.items()}
            reset_masks(model)
            configs.append(("kvzip", r, kept, kvzip_s + time.perf_counter() - start))
    order = {n: i for i, n in enumerate(names)}
    configs.sort(key=lambda c: (order[c[0]], -1.0 if c[1] is None else c[1]))
    out = []
    for name, r, kept, compress_s in configs:
        cache_r, masks = cache_of(kept)
        start = time.perf_counter()
        with torch.inference_mode():
            gen = generate(model, cache_r, masks, req["question_ids"], S, req["max_new_tokens"], eos)
        attended, held, nbytes = counts(kept, S, H)
        press = presses.get((name, r)) if name != "kvzip" else kvzip
        out.append(
            {
                "sample_id": req["sample_id"],
                # echoed so that slake takes this output only for the prompt it was made from
                "sample_digest": req.get("sample_digest"),
                "press": name,
                "compression_ratio": r,
                "tokens": gen,
                "text": tok.decode(gen, skip_special_tokens=True),
                "prefill_s": round(prefill_s, 5),
                "compress_s": round(compress_s, 5),
                "decode_s": round(time.perf_counter() - start, 5),
                "kept": round(attended, 3),
                "held": round(held, 3),
                "kv_bytes": nbytes,
                "press_repr": repr(press) if press is not None else "None",
            }
        )
    return out


def check_native(model, tok, req: dict, names: list[str], ratio: float, eos: set[int]) -> None:
    """kvpress's own path (``with press(model): model.model(context)``, one prefill per press) for one sample at one
    ratio, against :func:`run_request`'s tokens."""
    from transformers import DynamicCache

    ours = {o["press"]: o["tokens"] for o in run_request(model, tok, req, names, [ratio], eos)}
    S = len(req["prefill_ids"])
    for name in names:
        press = make_press(name)
        if press is not None:
            press.compression_ratio = ratio
        cache = DynamicCache()
        with torch.inference_mode():
            with press(model) if press is not None else contextlib.nullcontext():
                model.model(input_ids=torch.tensor([req["prefill_ids"]]), past_key_values=cache)
            masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in layers(model)]
            gen = generate(model, cache, masks, req["question_ids"], S, req["max_new_tokens"], eos)
        print(f"check-native {name:>22} @ {ratio}: tokens equal {gen == ours[name]}", flush=True)


def select_requests(requests: list[dict], tasks: str | None, samples: int | None) -> list[dict]:
    """The requests ``--tasks`` and ``--samples`` select, in the file's order.

    Parameters
    ----------
    requests : list of dict
        The requests file's ``requests``.
    tasks : str or None
        ``--tasks``: comma-separated task names (spaces around a name ignored); None for every task.
    samples : int or None
        ``--samples``: the first N requests of each task; None for all.

    Returns
    -------
    list of dict
        The selected requests.

    Raises
    ------
    SystemExit
        For a task the file does not hold (naming those it holds), ``--samples`` below 1, or nothing selected.
    """
    todo = list(requests)
    if tasks is not None:
        wanted = [t.strip() for t in tasks.split(",") if t.strip()]
        known = list(dict.fromkeys(r["task"] for r in requests))
        unknown = [t for t in wanted if t not in known]
        if not wanted or unknown:
            raise SystemExit(
                f"--tasks {tasks!r}: no requests of {', '.join(unknown) or 'any task'}; the requests file holds "
                f"{', '.join(known) or 'none'}"
            )
        todo = [r for r in todo if r["task"] in wanted]
    if samples is not None:
        if samples < 1:
            raise SystemExit(f"--samples must be at least 1, got {samples}")
        seen: dict[str, int] = {}
        kept = []
        for r in todo:
            seen[r["task"]] = seen.get(r["task"], 0) + 1
            if seen[r["task"]] <= samples:
                kept.append(r)
        todo = kept
    if not todo:
        raise SystemExit("the requests file holds no request to run")
    return todo


def done_keys(path: Path) -> set[tuple]:
    """``(sample_id, sample_digest, press)`` of every output already in ``path`` (none when it does not exist), for a
    resumed run to skip. A line that is not an output (cut short by a killed run, edited, another record) is passed
    over with a note on stderr, and its (sample, press) is run again: before 2026-12-02 a line of valid JSON without
    an output's keys stopped the run with a KeyError or TypeError."""
    done: set[tuple] = set()
    if not path.is_file():
        return done
    bad = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            o = json.loads(line)
        except json.JSONDecodeError:
            o = None
        if not isinstance(o, dict) or not isinstance(o.get("sample_id"), str) or not isinstance(o.get("press"), str):
            bad += 1
            continue
        done.add((o["sample_id"], o.get("sample_digest"), o["press"]))
    if bad:
        print(f"{path}: {bad} line(s) are not outputs and were passed over; their samples run again", file=sys.stderr)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="the --out folder of slake eval --protocol kvpress")
    ap.add_argument("--presses", default=PRESSES, help=f"comma-separated registry names (default {PRESSES})")
    ap.add_argument("--hf-dir", type=Path, default=None, help="where the de-quantised model is saved")
    ap.add_argument("--tasks", default=None, help="only these tasks (default: every request)")
    ap.add_argument("--samples", type=int, default=None, help="only the first N samples of each task")
    ap.add_argument("--check-native", action="store_true", help="compare with kvpress's own path on one sample")
    args = ap.parse_args()
    requests = json.loads((args.dir / REQUESTS_FILE).read_text(encoding="utf-8"))
    names = list(dict.fromkeys(n.strip() for n in args.presses.split(",") if n.strip()))
    if not names:
        raise SystemExit("--presses names no press")
    for n in names:
        make_press(n)  # unknown names fail before the model loads
    todo = select_requests(requests["requests"], args.tasks, args.samples)  # so do unknown tasks
    ratios = [float(r) for r in requests["compression_ratios"]]
    eos = set(requests["eos_token_ids"])
    model, tok = load_model(requests, args.hf_dir)
    if args.check_native:
        check_native(model, tok, todo[0], [n for n in names if n != "kvzip"], 0.5, eos)
        return
    path = args.dir / OUTPUTS_FILE
    done = done_keys(path)
    from importlib.metadata import version

    versions = {"kvpress": version("kvpress"), "transformers": version("transformers"), "torch": torch.__version__}
    for req in todo:
        missing = [n for n in names if (req["sample_id"], req.get("sample_digest"), n) not in done]
        if not missing:
            continue
        rows = run_request(model, tok, req, missing, ratios, eos)
        with open(path, "a", encoding="utf-8") as fh:
            if fh.tell() and not path.read_bytes().endswith(b"\n"):
                fh.write("\n")  # a run cut mid-line: the new rows start on their own lines, not glued to it
            for o in rows:
                o["versions"] = versions
                fh.write(json.dumps(o) + "\n")
        for o in rows:
            print(f"{o['sample_id']:>24} {o['press']:>20} {o['compression_ratio']}: {o['text'][:50]!r}", flush=True)


if __name__ == "__main__":
    main()
