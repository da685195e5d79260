"""The ``slake`` command.

Sub-commands: ``methods`` (list the methods), ``generate`` (compressed-cache generation with cache statistics),
``fidelity``, ``eval``, ``make-prompt``, ``bench`` (latency and memory vs context length, :mod:`slake.bench`) and
``calibrate`` (per-model VABS/CAKE exponents, :mod:`slake.calibrate`) and ``demo`` (full cache vs SLAKE on one
question, :mod:`slake.demo`).
Every sub-command accepts ``--json`` for machine-readable output; errors go to stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .budget_spec import Budget
from .cli_args import add_model_args as _add_model_args
from .bench.command import add_bench_parser, cmd_bench
from .calibrate_command import add_calibrate_parser, cmd_calibrate
from .demo import add_demo_parser, cmd_demo
from .eval.command import add_eval_parser, add_make_prompt_parser, cmd_eval, cmd_make_prompt
from .validation import validate_args


def _hyperparameters(pairs: list[str]) -> dict:
    from .methods.spec import parse_value

    out = {}
    for item in pairs or []:
        if "=" not in item:
            raise ValueError(f"--set expects NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = parse_value(v)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``slake`` command."""
    parser = argparse.ArgumentParser(prog="slake", description="KV-cache compression for transformers models")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the compression methods")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("generate", help="generate with a compressed KV cache and print cache statistics")
    p.add_argument("--method", default="snapkv", help="compression method (see 'slake methods')")
    p.add_argument("--budget", default="128",
                   help="average cached tokens per layer and KV head, window included, or a ratio in (0, 1)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a file holding the prompt ('-' for standard input)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as is")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--linear-cache", action="store_true", default=None,
                   help="fold evicted tokens into SLAKE's Taylor linear state (PTAA)")
    p.add_argument("--no-linear-cache", dest="linear_cache", action="store_false",
                   help="disable the linear state of a method that has one (ablation)")
    p.add_argument("--charge-linear-state", action="store_true",
                   help="count the linear state against the budget (equal-memory comparison)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill in chunks of this many tokens, compressing after each (bounded prefill memory)")
    p.add_argument("--set", nargs="*", metavar="NAME=VALUE", help="method hyperparameters, e.g. window=16")
    p.add_argument("--allow-long-context", action="store_true",
                   help="run a prompt longer than the model's context (max_position_embeddings); quality degrades")
    p.add_argument("--kv-dtype", default=None, help="store kept keys/values in 8 bits: int8 or fp8_e4m3 (per-token "
                   "scales, dequantised in attention); default: the model's dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="run with transformers (default) or vLLM with the slake plugin (needs slake[vllm])")
    _add_model_args(p)
    p = sub.add_parser("fidelity", help="relative error of attention outputs vs the full cache, per layer")
    p.add_argument("--methods", default="cake,slake", help="comma-separated methods; variants as name[key=value,...], e.g. slake[vabs=false]")
    p.add_argument("--budgets", default="64,128,256", help="comma-separated budgets")
    p.add_argument("--length", type=int, default=4096, help="prompt length in tokens (generated needle document)")
    p.add_argument("--prompt-file", help="use this prompt instead of a generated document")
    p.add_argument("--steps", type=int, default=16, help="decode steps whose queries are measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--linear-cache", choices=["default", "on", "off", "both"], default="default",
                   help="force the PTAA linear cache on/off for every method, or measure both")
    p.add_argument("--kv-dtype", default=None, help="comma-separated storage of kept keys/values to measure: auto "
                   "(model dtype), int8, fp8_e4m3; e.g. auto,int8")
    p.add_argument("--output-tokens", type=int, default=32,
                   help="output-level fidelity: continuation tokens per prompt, teacher-forced (0: skip)")
    p.add_argument("--output-samples", type=int, default=2,
                   help="output-level fidelity: prompts of each kind (essay continuation, full cache's answer)")
    p.add_argument("--out", help="folder for fidelity.json, fidelity.md, fidelity_per_layer.png and "
                                 "output_kl_vs_budget.png")
    p.add_argument("--json", action="store_true", help='print {"rows": [...]}')
    _add_model_args(p)
    add_eval_parser(sub)
    add_make_prompt_parser(sub)
    add_bench_parser(sub)
    add_calibrate_parser(sub)
    add_demo_parser(sub)
    return parser


def cmd_methods(args: argparse.Namespace) -> int:
    from .methods import available_methods

    rows = []
    for name, cls in available_methods().items():
        m = cls()
        rows.append({"name": name, "summary": cls.summary, "paper": cls.paper, "layer_budgets": cls.layer_budgets,
                     "linear_cache": m.linear_cache, "hyperparameters": m.hyperparameters()})
    if args.json:
        print(json.dumps({"methods": rows}, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['summary']}")
        print(f"{'':<{width}}  paper: {r['paper']}")
    return 0


def _read_prompt(args: argparse.Namespace) -> str:
    from .validation import read_prompt

    return read_prompt(args.prompt, args.prompt_file)


def cmd_generate(args: argparse.Namespace) -> int:
    from .hf.generate import generate
    from .methods import make_method
    from .models import load_model

    hyper = _hyperparameters(args.set)
    if args.linear_cache is not None:
        hyper["linear_cache"] = args.linear_cache
    make_method(args.method, **hyper)  # validates before the slow model load
    budget = Budget(args.budget)
    from .cache.quant import parse_kv_dtype

    kv_dtype = parse_kv_dtype(args.kv_dtype)
    prompt = _read_prompt(args)
    if args.engine == "vllm":
        from .vllm.generate import generate_from_args

        if kv_dtype is not None:
            raise ValueError("--kv-dtype is not supported with --engine vllm (the plugin stores vLLM's own cache dtype)")
        res = generate_from_args(args, hyper, budget, prompt)
    else:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file)
        res = generate(model, tokenizer, prompt, method=args.method, budget=budget,
                       max_new_tokens=args.max_new_tokens, chat_template=not args.no_chat_template,
                       do_sample=args.sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                       charge_linear_state=args.charge_linear_state, prefill_chunk=args.prefill_chunk,
                       allow_long_context=args.allow_long_context, kv_dtype=kv_dtype, **hyper)
    out = {"text": res.text, "prompt_tokens": res.prompt_tokens[0], "new_tokens": res.new_tokens[0],
           "method": res.method, "budget": res.budget, "compressed": res.compressed, "kv_bytes": res.kv_bytes,
           "kept_tokens_per_layer": res.kept_tokens_per_layer, "layer_budgets": res.layer_budgets,
           "prefill_s": round(res.prefill_s, 4), "decode_ms_per_token": round(res.decode_ms_per_token, 3),
           "hyperparameters": (res.hyperparameters if getattr(res, "hyperparameters", None)
                               else make_method(args.method, **hyper).hyperparameters()),
           "profile": getattr(res, "profile", None), **getattr(res, "engine_extra", {})}
    if args.json:
        print(json.dumps(out))
        return 0
    kv = res.kv_bytes
    print(res.text)
    print()
    note = "" if res.compressed else "  (prompt fits in the budget: no eviction, same as the full cache)"
    print(f"method {res.method}  budget {res.budget}  prompt {out['prompt_tokens']} tokens  "
          f"generated {out['new_tokens']} tokens{note}")
    print(f"KV bytes: full {kv['full']:,}  kept {kv['kept']:,}  padding {kv['padding']:,}  "
          f"linear state {kv['linear_state']:,}")
    mean_kept = sum(res.kept_tokens_per_layer) / max(len(res.kept_tokens_per_layer), 1)
    print(f"kept tokens per layer (mean over heads): mean {mean_kept:.1f}, "
          f"min {min(res.kept_tokens_per_layer):.1f}, max {max(res.kept_tokens_per_layer):.1f}")
    print(f"prefill {res.prefill_s:.2f} s  decode {res.decode_ms_per_token:.1f} ms/token")
    return 0


def _split(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"expected a comma-separated list, got {text!r}")
    return items


def cmd_fidelity(args: argparse.Namespace) -> int:
    from . import fidelity
    from .hf.generate import format_prompt
    from .methods.spec import parse_method_list
    from .models import load_model

    methods = parse_method_list(args.methods)
    budgets = [Budget(b).value for b in _split(args.budgets)]
    lin_modes = {"default": [None], "on": [True], "off": [False], "both": [False, True]}[args.linear_cache]
    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    if args.output_tokens < 0 or args.output_tokens == 1 or args.output_samples < 1:
        raise ValueError("--output-tokens must be 0 (skip) or >= 2, and --output-samples >= 1")
    from .cache.quant import parse_kv_dtype

    kv_dtypes = [parse_kv_dtype(k) for k in _split(args.kv_dtype or "auto")]
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file)
    if args.prompt_file:
        text = getattr(args, "prompt_text", None) or _read_prompt(argparse.Namespace(prompt=None,
                                                                                      prompt_file=args.prompt_file))
    else:
        from .eval.needle import needle_sample

        sample = needle_sample(tokenizer, args.length, 50.0, kind="number", seed=args.seed)
        text = sample.context + sample.question
    ids = tokenizer(format_prompt(tokenizer, text), return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(model.device)
    print(f"recording the full-cache run ({ids.shape[1]} prompt tokens, {args.steps} decode steps)...",
          file=sys.stderr)
    rec = fidelity.record(model, ids, args.steps)
    rows = []
    for m in methods:
        for kvd in kv_dtypes:
            for lin in lin_modes:
                for b in budgets:
                    rows += fidelity.measure(rec, m, b, linear_cache=lin, kv_dtype=kvd, profile_model=model)
    for r in rows:
        r["prompt_tokens"] = int(ids.shape[1])
    output_rows = _output_fidelity(args, model, tokenizer, methods, budgets, lin_modes) if args.output_tokens else []
    output_md = ""
    if output_rows:
        from . import output_fidelity

        output_md = (f"\n\n## Output level ({args.length}-token prompts, {args.output_tokens} teacher-forced tokens, "
                     f"{args.output_samples} essay continuations + {args.output_samples} answers)\n\n"
                     + output_fidelity.summary_table(output_rows))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fidelity.json").write_text(json.dumps({"rows": rows, "output_rows": output_rows}, indent=1))
        (out / "fidelity.md").write_text(
            f"# Attention fidelity ({ids.shape[1]} prompt tokens, {args.steps} decode steps)\n\n"
            + fidelity.summary_table(rows) + output_md + "\n\n## Per layer (decode queries)\n\n"
            + fidelity.per_layer_table(rows) + "\n")
        fidelity.plot_per_layer(rows, str(out / "fidelity_per_layer.png"))
        if output_rows:
            output_fidelity.plot_kl_vs_budget(output_rows, str(out / "output_kl_vs_budget.png"))
    if args.json:
        print(json.dumps({"rows": rows, "output_rows": output_rows}))
    else:
        print(fidelity.summary_table(rows) + output_md)
        print()
        print(fidelity.per_layer_table(rows))
    return 0


def _output_fidelity(args: argparse.Namespace, model, tokenizer, methods: list[str], budgets: list,
                     lin_modes: list) -> list[dict]:
    """Output-level rows (:mod:`slake.output_fidelity`) for every (method, linear cache, budget)."""
    from . import output_fidelity
    from .continuations import EVALUATION_QUESTIONS, answer_continuations, evaluation_text, text_continuations
    from .methods.spec import canonical_method_spec
    from .profiles import resolve_method

    text = evaluation_text()
    print(f"output level: {2 * args.output_samples} prompts of {args.length} tokens, "
          f"{args.output_tokens} continuation tokens each...", file=sys.stderr)
    conts = text_continuations(tokenizer, text, args.length, args.output_tokens, args.output_samples,
                               seed=args.seed, name="essay")
    conts += answer_continuations(model, tokenizer, text, args.length, args.output_tokens, args.output_samples,
                                  EVALUATION_QUESTIONS, seed=args.seed, name="answer")
    ref = output_fidelity.prepare_reference(model, conts)
    rows: list[dict] = []
    for m in methods:
        for lin in lin_modes:
            for b in budgets:
                extra = {} if lin is None else {"linear_cache": lin}
                built, _ = resolve_method(m, b, model, **extra)
                label = canonical_method_spec(m, drop=("linear_cache",))
                for r in output_fidelity.measure_outputs(model, ref, built, b, label=label):
                    r["linear_cache"] = built.linear_cache
                    rows.append(r)
    return rows


COMMANDS = {"methods": cmd_methods, "generate": cmd_generate, "fidelity": cmd_fidelity,
            "eval": cmd_eval, "make-prompt": cmd_make_prompt, "bench": cmd_bench, "calibrate": cmd_calibrate,
            "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slake`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args)  # every argument, before any model load or file write
        return COMMANDS[args.command](args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"slake {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
