"""Greedy tokens end to end on the default model: kvpress's presses against slake's matching methods (issue 22).

Three steps, each in the environment it needs (``run`` chains them):

* ``prepare`` (slake's environment, ``PYTHONPATH=src``): reads the prompt files (``slake make-prompt`` output: context
  and question, no chat template), applies the chat template as ``slake.generate`` does (``format_prompt``, then the
  tokenizer without special tokens), and writes ``cases.json``: the token ids, the budgets, and our PyramidKV layer
  schedule (used by the ``pyramidkv@our_schedule`` variant below);
* ``kvpress`` (the kvpress environment; imports no slake code): loads the same GGUF file with transformers
  (``attn_implementation="sdpa"``; ``"eager"`` for ``ObservedAttentionPress``, which needs the attention weights),
  compresses the whole prompt with each press (``with press(model): model(ids, past_key_values=DynamicCache())``:
  the question is inside the observation window, query-aware like slake), then decodes greedily the way kvpress's
  own pipeline does (``KVPressTextGenerationPipeline.generate_answer``: first token from the prefill logits, then one
  token per forward with explicit ``position_ids``, append-only cache, stop at EOS) and writes ``kvpress.json``;
* ``ours`` (slake's environment): ``slake.generate`` with the matching spec (every hyperparameter explicit, and
  ``decode_eviction=false``: kvpress compresses once after prefill and only appends while decoding) on the same
  prompt, into ``ours.json``;
* ``compare`` (slake's environment): writes ``tests/fixtures/reference/tokens.json``: both token lists and their
  agreement (tokens equal up to the first divergence, share of positions equal, texts equal).

Budgets: ``b`` = 128 kept tokens per layer and KV head (window included) in slake; kvpress gets
``compression_ratio = 1 - (b + 0.5) / S`` so that its ``int(S * (1 - ratio))`` keeps exactly ``b``. PyramidKV:
kvpress's ``PyramidKVPress`` counts the window inside its layer budget (``max_capacity_prompt = window +
S * (1 - ratio)``), so ``ratio = 1 - b / S`` gives the same mean kept count ``b`` per layer but a different schedule
from ours; the variant ``pyramidkv@our_schedule`` runs kvpress's press with its ``get_layer_budget`` returning our
schedule (window + our selectable count of the layer), which isolates the scoring from the schedule.

    PYTHONPATH=src python tools/reference/tokens.py run --kvpress-venv /path/to/venv-kvpress \\
        --prompts /tmp/reftok/needle.txt /tmp/reftok/niah_single_2.txt /tmp/reftok/vt.txt [--work /tmp/reftok]

Prompts used for the committed fixture (``slake make-prompt ... --seed 0``): ``--task needle --length 1000``,
``--task niah_single_2 --length 1500``, ``--task vt --length 1200``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "reference" / "tokens.json"

BUDGET = 128
WINDOW = 32
MAX_NEW_TOKENS = 32

#: press key -> our spec (every hyperparameter that matters set explicitly; profiles cannot change them)
OURS = {
    "full": "full",
    "snapkv": f"snapkv[window={WINDOW},kernel=5,pooling=avg,sinks=0,decode_eviction=false]",
    "streamingllm": "streamingllm[sinks=4,window=0,decode_eviction=false]",
    "tova": "tova[window=1,sinks=0,decode_eviction=false]",
    "observed": "h2o[window=0,sinks=0,decode_eviction=false]",
    "pyramidkv": f"pyramidkv[window={WINDOW},kernel=5,pooling=avg,sinks=0,decode_eviction=false]",
    "pyramidkv@our_schedule": f"pyramidkv[window={WINDOW},kernel=5,pooling=avg,sinks=0,decode_eviction=false]",
    "adakv_snapkv": f"ada-snapkv[window={WINDOW},kernel=5,pooling=avg,sinks=0,decode_eviction=false]",
    # issue 34
    "keydiff": "keydiff[window=0,sinks=0,decode_eviction=false]",
    "expected_attention": "ada-expected-attention[window=0,sinks=4,epsilon=0.01,decode_eviction=false]",
    "critical_snapkv": f"criticalkv[window={WINDOW},kernel=5,pooling=avg,sinks=0,decode_eviction=false]",
    "kvzip": "kvzip[window=0,sinks=4,chunk_size=2048,keep_prefix=false,decode_eviction=false]",
}

#: press key -> how kvpress is called (documentation, stored in the fixture)
KVPRESS = {
    "full": "no press (DynamicCache)",
    "snapkv": f"SnapKVPress(compression_ratio=1-(b+0.5)/S, window_size={WINDOW}, kernel_size=5)",
    "streamingllm": "StreamingLLMPress(compression_ratio=1-(b+0.5)/S, n_sink=4)",
    "tova": "TOVAPress(compression_ratio=1-(b+0.5)/S)",
    "observed": "ObservedAttentionPress(compression_ratio=1-(b+0.5)/S), eager attention",
    "pyramidkv": f"PyramidKVPress(compression_ratio=1-b/S, window_size={WINDOW}, kernel_size=5)",
    "pyramidkv@our_schedule": f"PyramidKVPress(window_size={WINDOW}, kernel_size=5), get_layer_budget = window + "
                              f"slake's pyramidkv selectable count of the layer",
    "adakv_snapkv": f"AdaKVPress(SnapKVPress(compression_ratio=1-(b+0.5)/S, window_size={WINDOW}, kernel_size=5), "
                    f"alpha_safeguard=0.2)",
    "keydiff": "KeyDiffPress(compression_ratio=1-(b+0.5)/S)",
    "expected_attention": "AdaKVPress(ExpectedAttentionPress(compression_ratio=1-(b+0.5)/S, epsilon=1e-2)) "
                          "(kvpress's registry entry expected_attention)",
    "critical_snapkv": f"CriticalKVPress(SnapKVPress(compression_ratio=1-(b+0.5)/S, window_size={WINDOW}, "
                       f"kernel_size=5))",
    "kvzip": "KVzipPress(compression_ratio=(LH(S-b)+0.5)/(LH S)) (kvpress's own reconstruction pass over the whole prompt, its "
             "tokenizer's chat template; the first token from the exact prefill's logits)",
}


# ====================================================================== slake side
def prepare(prompts: list[Path], work: Path) -> None:
    import slake
    from slake.engines.transformers.generate import format_prompt
    from slake.engines.transformers.models import default_gguf_path
    from slake.methods import make_method

    model, tokenizer = slake.load_model(device="cpu", dtype="float32")
    cases = []
    for p in prompts:
        text = p.read_text()
        ids = tokenizer(format_prompt(tokenizer, text), add_special_tokens=False)["input_ids"]
        S = len(ids)
        L = model.config.num_hidden_layers
        m = make_method(OURS["pyramidkv"])
        sched = [int(x) for x in m.pyramid_schedule(L, BUDGET - WINDOW, S)]
        cases.append({"name": p.stem, "prompt": text, "input_ids": ids, "S": S, "budget": BUDGET, "window": WINDOW,
                      "our_pyramid_selectable": sched})
    gguf = default_gguf_path()
    (work / "cases.json").write_text(json.dumps({"gguf": str(gguf), "max_new_tokens": MAX_NEW_TOKENS,
                                                 "cases": cases}))
    print("prepared", [(c["name"], c["S"]) for c in cases])


def ours_tokens(model, tokenizer, prompt: str, spec: str, budget: int, max_new_tokens: int) -> tuple[list, list]:
    """Our greedy tokens (prompt ids, new ids) for one case, through ``slake.generate``; a second-pass method (KVzip)
    through the engine's prefill-once path instead, which compresses the whole prompt after its pass and takes the
    first token from the exact prefill's logits, as kvpress's pipeline does (``slake.generate`` reads the prompt's
    last token after the compression)."""
    import slake

    if slake.make_method(spec).second_pass is not None:
        import torch

        from slake.engines.transformers.generate import eos_token_ids, format_prompt
        from slake.engines.transformers.prefill_once import capture_prefill, greedy_decode
        from slake.engines.transformers.reconstruction import ReconstructionPrompt, run_second_pass

        ids = tokenizer(format_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]
        cap = capture_prefill(model, torch.tensor([ids]))
        run_second_pass(model, cap, slake.make_method(spec), ReconstructionPrompt.from_tokenizer(tokenizer))
        new = greedy_decode(model, cap, cap.replay(spec, budget), max_new_tokens, eos_token_ids(model, tokenizer))
        return ids, new[0]
    res = slake.generate(model, tokenizer, prompt, method=spec, budget=budget, max_new_tokens=max_new_tokens)
    S = res.prompt_tokens[0]
    seq = res.sequences[0].tolist()
    return seq[:S], seq[S:S + res.new_tokens[0]]


def agreement(ours: list[int], ref: list[int]) -> dict:
    """Tokens equal up to the first divergence, share of positions equal (over the longer list), lists equal."""
    n = 0
    while n < min(len(ours), len(ref)) and ours[n] == ref[n]:
        n += 1
    same = sum(a == b for a, b in zip(ours, ref))
    return {"equal_prefix": n, "equal_share": same / max(len(ours), len(ref), 1), "equal": ours == ref}


def ours_side(work: Path, only: list[str] | None = None) -> None:
    """Our tokens for every case (or those named in ``only``, in that order) and press key into ``ours.json``
    (independent of kvpress's run)."""
    import slake

    cases = json.loads((work / "cases.json").read_text())
    by_name = {c["name"]: c for c in cases["cases"]}
    unknown = [n for n in only or [] if n not in by_name]
    if unknown:  # before the model loads
        raise SystemExit(f"--cases {' '.join(unknown)}: not in {work / 'cases.json'} ({', '.join(by_name)})")
    todo = cases["cases"] if not only else [by_name[n] for n in only]
    model, tokenizer = slake.load_model(device="cpu", dtype="float32")
    path = work / "ours.json"
    res = json.loads(path.read_text()) if path.exists() else {}  # resumes: written after every case
    for case in todo:
        for key, spec in OURS.items():
            if key in res.get(case["name"], {}):
                continue
            ids, ours = ours_tokens(model, tokenizer, case["prompt"], spec, case["budget"], cases["max_new_tokens"])
            if ids != case["input_ids"]:
                raise RuntimeError(f"{case['name']}: slake.generate tokenised the prompt differently")
            res.setdefault(case["name"], {})[key] = {"tokens": ours,
                                                     "text": tokenizer.decode(ours, skip_special_tokens=True)}
            print(f"{case['name']:>14} {key:>22}: {res[case['name']][key]['text'][:60]!r}", flush=True)
            path.write_text(json.dumps(res))


def compare(work: Path, out: Path) -> None:
    """Both sides' tokens and their agreement into the committed fixture."""
    cases = json.loads((work / "cases.json").read_text())
    ref = json.loads((work / "kvpress.json").read_text())
    ours_all = json.loads((work / "ours.json").read_text())
    rows = []
    for case in cases["cases"]:
        for key, spec in OURS.items():
            r, o = ref["results"][case["name"]][key], ours_all[case["name"]][key]
            a = agreement(o["tokens"], r["tokens"])
            a["text_equal"] = o["text"].strip() == r["text"].strip()
            rows.append({"case": case["name"], "press": key, "spec": spec, "kvpress": KVPRESS[key],
                         "budget": case["budget"], "kvpress_tokens": r["tokens"], "kvpress_text": r["text"],
                         "ours_tokens": o["tokens"],
                         "ours_text": o["text"], **a})
            print(f"{case['name']:>14} {key:>22}: equal prefix {a['equal_prefix']:2d}/{len(r['tokens'])}, "
                  f"share {a['equal_share']:.2f}, text equal {a['text_equal']}", flush=True)
    fixture = {"what": "greedy tokens of kvpress's presses and slake's matching methods on the default model "
                       "(tools/reference/tokens.py, docs/faithfulness.md)",
               "versions": ref["versions"], "chat_template_ids_equal": ref["chat_template_ids_equal"],
               "max_new_tokens": cases["max_new_tokens"],
               "prompts": {c["name"]: {"prompt": c["prompt"], "S": c["S"], "input_ids": c["input_ids"],
                                       "our_pyramid_selectable": c["our_pyramid_selectable"]}
                           for c in cases["cases"]},
               "rows": rows}
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    print("wrote", out)


# ====================================================================== kvpress side (no slake imports)
def make_presses(case: dict, layer_heads: int) -> dict:
    """press key -> (kvpress press, attention implementation) for one prompt (see ``KVPRESS``); ``layer_heads``:
    layers x KV heads (KVzip prunes ``int(layer_heads * S * ratio)`` entries over all of them)."""
    from kvpress import (AdaKVPress, CriticalKVPress, ExpectedAttentionPress, KeyDiffPress, KVzipPress,
                         ObservedAttentionPress, PyramidKVPress, SnapKVPress, StreamingLLMPress, TOVAPress)
    S, b, w = case["S"], case["budget"], case["window"]
    ratio = 1.0 - (b + 0.5) / S
    sched = case["our_pyramid_selectable"]
    ours_sched = PyramidKVPress(compression_ratio=1.0 - b / S, window_size=w, kernel_size=5)
    ours_sched.get_layer_budget = lambda module, q_len, s=sched, w=w: w + s[module.layer_idx]
    return {
        "full": (None, "sdpa"),
        "snapkv": (SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=5), "sdpa"),
        "streamingllm": (StreamingLLMPress(compression_ratio=ratio, n_sink=4), "sdpa"),
        "tova": (TOVAPress(compression_ratio=ratio), "sdpa"),
        "observed": (ObservedAttentionPress(compression_ratio=ratio), "eager"),
        "pyramidkv": (PyramidKVPress(compression_ratio=1.0 - b / S, window_size=w, kernel_size=5), "sdpa"),
        "pyramidkv@our_schedule": (ours_sched, "sdpa"),
        "adakv_snapkv": (AdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=5),
                                    alpha_safeguard=0.2), "sdpa"),
        "keydiff": (KeyDiffPress(compression_ratio=ratio), "sdpa"),
        "expected_attention": (AdaKVPress(ExpectedAttentionPress(compression_ratio=ratio, epsilon=1e-2)), "sdpa"),
        "critical_snapkv": (CriticalKVPress(SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=5)),
                            "sdpa"),
        # global over layers and heads: the numbers of entries kept, b per layer and head, fix the ratio
        "kvzip": (KVzipPress(compression_ratio=(layer_heads * (S - b) + 0.5) / (layer_heads * S)), "sdpa"),
    }


def kvpress_side(work: Path) -> None:
    from importlib.metadata import version

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    cases = json.loads((work / "cases.json").read_text())
    gguf = Path(cases["gguf"])
    max_new = cases["max_new_tokens"]
    kw = {"gguf_file": gguf.name, "dtype": torch.float32}
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    models = {impl: AutoModelForCausalLM.from_pretrained(gguf.parent, attn_implementation=impl, **kw).eval()
              for impl in ("sdpa", "eager")}
    # KVzipPress reloads the tokenizer from config.name_or_path, which a GGUF file does not serve: a saved copy does
    tok.save_pretrained(work / "tokenizer")
    for m in models.values():
        m.config._name_or_path = str(work / "tokenizer")
    eos = models["sdpa"].generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])

    def generate(model, ids, press):
        """kvpress's pipeline decode (generate_answer), with the whole prompt compressed at prefill."""
        cache = DynamicCache()
        x = torch.tensor([ids])
        S = x.shape[1]
        with torch.inference_mode():
            with press(model) if press is not None else _null():
                out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            kept = [int(layer.keys.shape[2]) for layer in cache.layers]
            if any(getattr(layer.self_attn, "masked_key_indices", None) is not None for layer in model.model.layers):
                kept = []  # AdaKVPress: full-length cache, entries masked per head; mean kept per KV head
                for layer in model.model.layers:
                    mk = getattr(layer.self_attn, "masked_key_indices", None)
                    H = model.config.num_key_value_heads
                    kept.append(S - (0 if mk is None else len(mk[0]) / H))
            gen = [int(out.logits[0, -1].argmax())]
            pos = torch.tensor([[S]])
            for i in range(max_new - 1):
                if gen[-1] in eos:
                    break
                out = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=cache, position_ids=pos + i)
                gen.append(int(out.logits[0, -1].argmax()))
        for layer in model.model.layers:  # AdaKVPress leaves its mask on the module
            if hasattr(layer.self_attn, "masked_key_indices"):
                layer.self_attn.masked_key_indices = None
        return gen, kept

    results, ids_equal = {}, {}
    for case in cases["cases"]:
        ids = case["input_ids"]
        templ = tok.apply_chat_template([{"role": "user", "content": case["prompt"]}], add_generation_prompt=True,
                                        tokenize=False)
        ids_equal[case["name"]] = tok.encode(templ, add_special_tokens=False) == ids
        cfg = models["sdpa"].config
        presses = make_presses(case, cfg.num_hidden_layers * cfg.num_key_value_heads)
        res = results[case["name"]] = {}
        for key, (press, impl) in presses.items():
            gen, kept = generate(models[impl], ids, press)
            res[key] = {"tokens": gen, "text": tok.decode(gen, skip_special_tokens=True), "kept_per_layer": kept}
            print(f"{case['name']:>14} {key:>22}: {res[key]['text'][:60]!r}", flush=True)
    versions = {"kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__}
    (work / "kvpress.json").write_text(json.dumps({"versions": versions, "chat_template_ids_equal": ids_equal,
                                                   "results": results}))
    print("wrote", work / "kvpress.json", kvpress.__name__)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ====================================================================== driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["run", "prepare", "kvpress", "ours", "compare"])
    ap.add_argument("--cases", nargs="+", help="prompt names our side runs, in this order (default: all)")
    ap.add_argument("--prompts", type=Path, nargs="+")
    ap.add_argument("--work", type=Path, default=Path("/tmp/reftok"))
    ap.add_argument("--kvpress-venv", type=Path)
    ap.add_argument("--out", type=Path, default=FIXTURE)
    args = ap.parse_args()
    if args.step in ("run", "prepare") and not args.prompts:
        ap.error(f"{args.step} needs --prompts")
    if args.step == "run" and args.kvpress_venv is None:
        ap.error("run needs --kvpress-venv (the kvpress step runs with its interpreter)")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.step == "prepare":
        prepare(args.prompts, args.work)
    elif args.step == "kvpress":
        kvpress_side(args.work)
    elif args.step == "ours":
        ours_side(args.work, args.cases)
    elif args.step == "compare":
        compare(args.work, args.out)
    else:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        me = str(Path(__file__).resolve())
        subprocess.run([sys.executable, me, "prepare", "--work", str(args.work), "--prompts",
                        *map(str, args.prompts)], check=True, env=env)
        subprocess.run([str(args.kvpress_venv / "bin" / "python"), me, "kvpress", "--work", str(args.work)],
                       check=True)
        subprocess.run([sys.executable, me, "ours", "--work", str(args.work)], check=True, env=env)
        subprocess.run([sys.executable, me, "compare", "--work", str(args.work), "--out", str(args.out)], check=True,
                       env=env)


if __name__ == "__main__":
    main()
