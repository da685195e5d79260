"""``slake generate``: compressed-cache generation of one prompt, with cache statistics, on any engine."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from slake.budgets.budget import Budget
from slake.cli.options import add_engine_arg, add_model_args, engine_from_args, method_overrides

__all__ = ["add_generate_parser", "cmd_generate"]


def add_generate_parser(sub: Any) -> None:
    """Register ``slake generate``."""
    p = sub.add_parser("generate", help="generate with a compressed KV cache and print cache statistics")
    p.add_argument("--method", default="snapkv", help="compression method (see 'slake methods')")
    p.add_argument(
        "--budget",
        default="128",
        help="average cached tokens per layer and KV head, window included, or a ratio in (0, 1)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a file holding the prompt ('-' for standard input)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as is")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None, help="with --sample: sampling temperature (default: 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="with --sample: nucleus sampling's mass (default: 1.0)")
    p.add_argument(
        "--seed", type=int, default=None, help="with --sample: seed of the draws (default: torch's generator unseeded)"
    )
    p.add_argument(
        "--linear-cache",
        action="store_true",
        default=None,
        help="fold evicted tokens into SLAKE's Taylor linear state (PTAA)",
    )
    p.add_argument(
        "--no-linear-cache",
        dest="linear_cache",
        action="store_false",
        help="disable the linear state of a method that has one (ablation)",
    )
    p.add_argument(
        "--charge-linear-state",
        action="store_true",
        help="count the linear state against the budget (equal-memory comparison; refused for a method without one)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prefill in chunks of this many tokens, compressing after each (bounded prefill memory)",
    )
    p.add_argument(
        "--set",
        nargs="*",
        action="extend",
        metavar="NAME=VALUE",
        help="method hyperparameters, e.g. window=16 (repeatable; a name given twice is refused)",
    )
    p.add_argument(
        "--allow-long-context",
        action="store_true",
        help="run a prompt longer than the model's context (max_position_embeddings); quality degrades",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        help="store kept keys/values in 8 bits: int8 or fp8_e4m3 (per-token "
        "scales, dequantised in attention); default: the model's dtype",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode with fixed shapes and run every decode step as one compiled graph (torch.compile, "
        "fullgraph; CUDA graphs on CUDA); the first step compiles (docs/compile.md)",
    )
    p.add_argument(
        "--kernels",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="the decode step's implementation: Triton's fused kernels (auto: on NVIDIA GPUs) or the torch "
        "step "
        "(docs/gpu.md#the-fused-decode-step)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_arg(p, "generate")
    add_model_args(p)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run ``slake generate``; the prompt was read and the method checked by
    :func:`slake.cli.validation.validate_args`."""
    from slake.cache.quant import parse_kv_dtype
    from slake.methods import make_method

    hyper = method_overrides(args)
    budget = Budget(args.budget)
    kv_dtype = parse_kv_dtype(args.kv_dtype)
    engine = engine_from_args(args)
    engine.check(
        sample=args.sample,
        prefill_chunk=args.prefill_chunk,
        charge_linear_state=args.charge_linear_state,
        linear_cache=args.linear_cache,
        kv_dtype=kv_dtype,
        compile=args.compile,
        kernels=None if args.kernels == "auto" else args.kernels,
        allow_long_context=args.allow_long_context,
    )
    method = make_method(args.method, **hyper)
    if args.charge_linear_state and not method.linear_cache:
        # charged nothing: the equal-memory comparison asked for would be the plain method's, labelled as charged
        raise ValueError(
            f"--charge-linear-state charges a linear state against the budget, and {args.method} keeps none "
            "(add --linear-cache, or leave the flag out)"
        )
    engine.check_pair(method, budget)
    res = engine.generate(
        args.prompt,
        method=args.method,
        budget=budget,
        max_new_tokens=args.max_new_tokens,
        chat_template=not args.no_chat_template,
        do_sample=args.sample,
        temperature=1.0 if args.temperature is None else args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p,
        seed=args.seed,
        charge_linear_state=args.charge_linear_state,
        prefill_chunk=args.prefill_chunk,
        allow_long_context=args.allow_long_context,
        kv_dtype=kv_dtype,
        **({"compile": True} if args.compile else {}),
        **({"kernels": args.kernels} if args.kernels != "auto" else {}),
        **hyper,
    )
    out = {
        "text": res.text,
        "prompt_tokens": res.prompt_tokens[0],
        "new_tokens": res.new_tokens[0],
        "method": res.method,
        "budget": res.budget,
        "compressed": res.compressed,
        "kv_bytes": res.kv_bytes,
        "kept_tokens_per_layer": res.kept_tokens_per_layer,
        "layer_budgets": res.layer_budgets,
        "prefill_s": round(res.prefill_s, 4),
        "decode_ms_per_token": timed_decode_ms(res.decode_ms_per_token),
        "hyperparameters": res.hyperparameters or make_method(args.method, **hyper).hyperparameters(),
        "profile": res.profile,
        "kernels": res.extra.get("kernels"),
        "engine": res.engine,
        **res.extra,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(res.text)
    print()
    print(
        f"method {res.method}  budget {res.budget}"
        + (f"  kv {res.extra['kv_dtype']}" if res.extra.get("kv_dtype") else "")
        + f"  prompt {out['prompt_tokens']} tokens  "
        f"generated {out['new_tokens']} tokens{_eviction_note(res.method, res.compressed)}"
    )
    print(kv_bytes_line(res.kv_bytes))
    mean_kept = sum(res.kept_tokens_per_layer) / max(len(res.kept_tokens_per_layer), 1)
    print(
        f"kept tokens per layer (mean over heads): mean {mean_kept:.1f}, "
        f"min {min(res.kept_tokens_per_layer):.1f}, max {max(res.kept_tokens_per_layer):.1f}"
    )
    decode_ms = out["decode_ms_per_token"]
    print(f"prefill {res.prefill_s:.2f} s  decode {'n/a' if decode_ms is None else f'{decode_ms:.1f} ms/token'}")
    return 0


def _eviction_note(method: str, compressed: bool) -> str:
    """Why nothing was evicted, when nothing was: the full method keeps every token; another method's budget held
    the whole prompt."""
    if method == "full":
        return "  (the full method keeps every token)"
    return "" if compressed else "  (prompt fits in the budget: no eviction, same as the full cache)"


def kv_bytes_line(kv_bytes: dict) -> str:
    """One line of a result's ``kv_bytes``: what an uncompressed cache would hold (``full``), what this cache holds
    in all (:func:`slake.engines.result.held_bytes`, the same sum ``slake demo`` prints), then each part of it.

    Parameters
    ----------
    kv_bytes : dict
        ``GenerationResult.kv_bytes``; a part it lacks (``sliding`` on a model without sliding layers) is left out.

    Returns
    -------
    str
        e.g. ``KV bytes: full 1,024  held 700 = kept 512 + padding 0 + slack 128 + metadata 60 + linear state 0``.
    """
    from slake.engines.result import STORED_PARTS, held_bytes

    parts = " + ".join(f"{k.replace('_', ' ')} {kv_bytes[k]:,}" for k, _ in STORED_PARTS if k in kv_bytes)
    return f"KV bytes: full {kv_bytes['full']:,}  held {held_bytes(kv_bytes):,} = {parts}"


def timed_decode_ms(ms: float) -> float | None:
    """``decode_ms_per_token`` for the output, rounded: None when no decode step was timed (one new token, or two
    with ``--compile``, whose first step compiles), which the result gives as 0.0 (NaN from the vLLM engine)."""
    return round(ms, 3) if math.isfinite(ms) and ms > 0 else None
