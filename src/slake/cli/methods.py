"""``slake methods``: the registered compression methods, their papers and hyperparameters."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_methods_parser", "cmd_methods"]


def add_methods_parser(sub: Any) -> None:
    """Register ``slake methods``."""
    p = sub.add_parser("methods", help="list the compression methods")
    p.add_argument("--json", action="store_true", help="print JSON")


def cmd_methods(args: argparse.Namespace) -> int:
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
    return 0
