"""The ``slake calibrate`` sub-command (search in :mod:`slake.quality.calibrate`, profiles in
:mod:`slake.methods.profiles`)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from slake.cli.options import add_model_args

__all__ = ["add_calibrate_parser", "cmd_calibrate"]


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``slake calibrate``."""
    p = sub.add_parser(
        "calibrate",
        help="tune VABS alpha/beta and CAKE tau1/tau2 for a model; write its profile",
        description="Search slake's VABS (alpha, beta) and cake's (tau1, tau2) at each budget on "
        "calibration prompts from text no evaluation suite uses, minimising the mean "
        "KL(full || compressed) of the next-token distributions, and write the values to "
        "the model's profile, which generate/eval/bench/fidelity then use.",
    )
    p.add_argument(
        "--methods",
        default="slake,cake",
        help="methods to calibrate: slake and/or cake, variants allowed (slake[vabs_split=uniform])",
    )
    p.add_argument("--budgets", default="128", help="comma-separated budgets (tokens or ratios in (0, 1))")
    p.add_argument("--length", type=int, default=2048, help="calibration prompt length in tokens")
    p.add_argument("--samples", type=int, default=2, help="prompts of each kind (text continuation, answer)")
    p.add_argument("--tokens", type=int, default=16, help="continuation tokens per prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the calibration prompts")
    p.add_argument("--no-refine", action="store_true", help="grid only, no local refinement")
    p.add_argument(
        "--out-dir",
        default=None,
        help="profile folder (default: $SLAKE_PROFILE_DIR or ~/.cache/slake/profiles, the folder slake reads "
        "profiles from; a profile written elsewhere applies once SLAKE_PROFILE_DIR names its folder)",
    )
    p.add_argument("--alias", action="append", default=[], help="another name the profile's model answers to")
    p.add_argument("--json", action="store_true", help="print the profile entries as JSON")
    add_model_args(p)


def _profile_folder(out_dir: str | None) -> Path:
    """The folder the profile is written to: ``--out-dir`` (``~`` expanded), else the user profile folder."""
    from slake.methods.profiles import profile_dir

    return profile_dir() if out_dir is None else Path(out_dir).expanduser()


def _check_out_dir(out_dir: str | None) -> None:
    """Raise ValueError unless the profile folder can be created and written (before the slow model load): an empty
    ``--out-dir``, a path that is a file or below one, or whose nearest existing folder is not writable. Creates
    nothing (the folder is made when the run starts)."""
    from slake.cli.options import check_out_folder

    what = "--out-dir" if out_dir is not None else "the profile folder ($SLAKE_PROFILE_DIR or ~/.cache/slake/profiles)"
    check_out_folder(_profile_folder(out_dir) if out_dir is None or out_dir.strip() else out_dir, what)


def _tell_where_read(folder: Path | None) -> None:
    """Say on stderr, when the profile went to an ``--out-dir`` that is not the folder slake reads profiles from,
    how to use it: generate/eval/bench/fidelity read ``$SLAKE_PROFILE_DIR`` (or ``~/.cache/slake/profiles``) only,
    and ran on the former values after a calibration into another folder without a word."""
    from slake.methods.profiles import profile_dir

    if folder is None or folder.resolve() == profile_dir().expanduser().resolve():
        return
    print(
        f"slake calibrate: slake reads profiles from {profile_dir()}, not {folder}: run with "
        f"SLAKE_PROFILE_DIR={folder} for this profile to apply",
        file=sys.stderr,
    )


def _check_args(args: argparse.Namespace) -> tuple[list[str], list, list]:
    """Validate the arguments before the model loads; return the method specs, the built methods and the budgets."""
    from slake.budgets.budget import Budget
    from slake.cli.options import refuse_duplicates
    from slake.methods.base import canonical_method_spec, make_method, parse_method_list
    from slake.methods.budget_check import check_budget_at_length
    from slake.methods.profiles import SEARCHED, searched_hyperparameters
    from slake.methods.spec import parse_method_spec

    specs = parse_method_list(args.methods)
    refuse_duplicates("--methods", specs, [canonical_method_spec(m) for m in specs])
    methods = [make_method(m) for m in specs]
    for spec, m in zip(specs, methods, strict=True):
        if m.name not in SEARCHED:
            raise ValueError(f"slake calibrate tunes {', '.join(sorted(SEARCHED))}, not {m.name!r}")
        fixed = [k for k in SEARCHED[m.name] if k in parse_method_spec(spec)[1]]
        if fixed:
            # the search would set them anyway, and the entry it writes would apply to the spec without them
            raise ValueError(
                f"--methods {spec}: slake calibrate searches {', '.join(SEARCHED[m.name])}; drop "
                f"{', '.join(fixed)} from the spec (the other hyperparameters stay and make the entry's context)"
            )
        if not searched_hyperparameters(m):
            # known before the model loads: the search found it only after measuring every candidate, and wrote nothing
            raise ValueError(
                f"--methods {spec}: with vabs=false slake allocates its layers' budgets by CAKE's preference, which "
                f"does not read alpha and beta: every candidate would measure the same distance and no entry would be "
                f"written; calibrate slake with VABS, or cake"
            )
    budget_texts = [b.strip() for b in str(args.budgets).split(",") if b.strip()]
    budgets = [Budget(b).value for b in budget_texts]
    if not budgets:
        raise ValueError("no budget given; use e.g. --budgets 128,256")
    refuse_duplicates("--budgets", budget_texts, budgets)
    blank = [a for a in args.alias if not a.strip()]
    if blank:
        raise ValueError(f"--alias {blank[0]!r} is blank; give the name the profile's model should answer to")
    if args.length < 256:
        raise ValueError(f"--length must be >= 256, got {args.length}")
    if args.samples < 1 or args.tokens < 2:
        raise ValueError(f"need --samples >= 1 and --tokens >= 2 (got {args.samples}, {args.tokens})")
    for b in budgets:
        if isinstance(b, int) and b >= args.length:
            raise ValueError(
                f"budget {b} keeps every token of the {args.length}-token calibration prompts (--length), so it "
                f"evicts nothing and measures nothing; use a budget below --length, or a longer --length"
            )
    for m in methods:
        for b in budgets:
            if isinstance(b, int) and b < m.protected:
                raise ValueError(f"budget {b} is below {m.name}'s window/sinks ({m.protected} tokens)")
            check_budget_at_length(m, b, args.length)  # a ratio of the calibration prompts
    _check_out_dir(args.out_dir)
    return specs, methods, budgets


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Run the search and write the profile; exit code 2 with one line for bad input."""
    from tqdm.auto import tqdm

    from slake import __version__
    from slake.engines.context import check_context, context_limit
    from slake.engines.transformers.models import load_model
    from slake.methods.profiles import defaults_untold, model_identity, resolve_method, write_entry
    from slake.quality.calibrate import (
        CALIBRATION_SOURCE,
        GRIDS,
        NothingMeasured,
        calibrate_method,
        calibration_reference,
    )

    specs, methods, budgets = _check_args(args)  # before the slow model load
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, gguf_file=args.gguf_file)
    check_context(
        context_limit(model.config),
        args.length,
        args.tokens,
        what="each calibration prompt (--length) has",
        can_allow=False,
    )
    identity = model_identity(model)
    _profile_folder(args.out_dir).mkdir(parents=True, exist_ok=True)  # the run starts: its folder is made now
    folder = None if args.out_dir is None else _profile_folder(args.out_dir)  # None: the profile folder
    # what is in force before calibrating (user or shipped profile, papers' values, defaults): the "before" point,
    # resolved before any entry is written so that a new entry does not become the "before" of a nearby budget
    with defaults_untold():  # "no profile: run slake calibrate" is not news to slake calibrate
        in_force = {(i, b): resolve_method(spec, b, model) for i, spec in enumerate(specs) for b in budgets}
    print(f"calibration prompts: {2 * args.samples} of {args.length} tokens from {CALIBRATION_SOURCE}", file=sys.stderr)
    ref = calibration_reference(model, tokenizer, args.length, args.samples, args.tokens, args.seed)
    per = {
        m.name: 1 + len(GRIDS[m.name][next(iter(GRIDS[m.name]))]) ** 2 + (0 if args.no_refine else 8) for m in methods
    }
    bar = tqdm(
        total=sum(per[m.name] for m in methods) * len(budgets),
        desc="slake calibrate",
        unit="candidate",
        file=sys.stderr,
    )
    entries, paths, skipped = [], set(), []
    planned = 0  # candidates the bar counts for the searches done: a search measures fewer when its "before" point
    # is a grid point or its refinement meets measured ones, and the bar ended short of its total (33/34)
    try:
        for i, m in enumerate(methods):
            for b in budgets:
                bar.set_postfix_str(f"{m.name} @ {b}")
                before, applied = in_force[(i, b)]
                planned += per[m.name]
                try:
                    entry = calibrate_method(model, ref, before, b, refine=not args.no_refine, on_candidate=bar.update)
                except NothingMeasured as err:  # no entry from a search that measured nothing
                    skipped.append(f"{specs[i]} @ {b}: {err}")
                    print(f"slake calibrate: skipped {specs[i]} @ {b}: {err}", file=sys.stderr)
                    continue
                finally:
                    bar.update(max(planned - bar.n, 0))
                entry["before"]["source"] = applied["source"] if applied else "defaults"
                entry["calibration"] = {
                    "source": CALIBRATION_SOURCE,
                    "length": args.length,
                    "samples_per_kind": args.samples,
                    "tokens": args.tokens,
                    "seed": args.seed,
                    "slake_version": __version__,
                    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                }
                paths.add(write_entry(identity, entry, folder, aliases=args.alias))
                entries.append(entry)
    finally:
        bar.close()
    if not entries:
        raise ValueError(f"no profile entry written: {'; '.join(skipped)}")
    _tell_where_read(folder)
    if args.json:
        print(json.dumps({"model": identity["name"], "profiles": sorted(map(str, paths)), "entries": entries}))
        return 0
    print("| method | budget | values before | KL before | values after | KL after | ΔNLL before -> after |")
    print("|---|---:|---|---:|---|---:|---|")
    for e in entries:
        fmt = lambda v: ", ".join(f"{k}={x:g}" for k, x in v.items())  # noqa: E731
        num = lambda x, spec: "n/a" if x is None else format(x, spec)  # noqa: E731  (None: not a finite number)
        print(
            f"| {e['method']} | {e['budget']} | {fmt(e['before']['values'])} | {num(e['before']['kl'], '.4f')} | "
            f"{fmt(e['after']['values'])} | {num(e['after']['kl'], '.4f')} | "
            f"{num(e['before']['delta_nll'], '+.4f')} -> {num(e['after']['delta_nll'], '+.4f')} |"
        )
    for p in sorted(paths):
        print(f"profile written: {p}")
    return 0
