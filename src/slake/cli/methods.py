"""``slake methods``: the registered compression methods, their papers and hyperparameters."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_methods_parser", "cmd_methods", "format_defaults"]


def add_methods_parser(sub: Any) -> None:
    """Register ``slake methods``."""
    p = sub.add_parser("methods", help="list the compression methods")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_methods(args: argparse.Namespace) -> int:
    """Run ``slake methods``: three lines per method (name and summary, paper, hyperparameters with their defaults),
    or with ``--json`` one object with every method's fields."""
    from slake.methods import available_methods

    rows: list[dict[str, Any]] = []
    for name, cls in available_methods().items():
        m = cls()
        rows.append(
            {
                "name": name,
                "summary": cls.summary,
                "paper": cls.paper,
                "layer_budgets": cls.layer_budgets,
                "linear_cache": m.linear_cache,
                "hyperparameters": m.hyperparameters(),
            }
        )
    if args.json:
        print(json.dumps({"methods": rows}, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['summary']}")
        print(f"{'':<{width}}  paper: {r['paper']}")
        print(f"{'':<{width}}  hyperparameters: {format_defaults(r['hyperparameters'])}")
    return 0


def format_defaults(hyperparameters: dict[str, Any]) -> str:
    """A method's hyperparameters and defaults on one line, as ``--set`` and method specs spell them: ``window=32
    sinks=0 linear_cache=false pooling=avg`` (values as JSON literals, strings bare)."""
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in hyperparameters.items())
