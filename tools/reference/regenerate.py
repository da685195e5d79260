"""Regenerate the reference fixtures end to end (issue 22): capture -> reference code -> comparison.

Runs ``capture.py`` and ``compare.py`` with this interpreter (slake's environment, ``PYTHONPATH=src``) and
``reference_side.py`` with the reference environment's interpreter (``--kvpress-venv``). Every reference is optional;
what is not given is not run (and its fixtures keep their committed content only if you do not overwrite them).

    PYTHONPATH=src python tools/reference/regenerate.py --kvpress-venv /path/to/venv-kvpress \\
        --kvcache-factory /path/to/KVCache-Factory --adakv /path/to/AdaKV --cake /path/to/cakekv \\
        --lava /path/to/Lava [--work /tmp/slake-ref]

Pinned versions used for the committed fixtures: kvpress 0.5.5 (PyPI, transformers 5.2.0, torch 2.13.0 CPU),
Zefan-Cai/KVCache-Factory c97f9d706d63d1b56e980f8b81b2a924c21162b3, FFY0/AdaKV
efe4e2eea0099bf497f0c175ac5440a915d89f83, antgroup/cakekv c4675ce21b1d6f62d262f9a8dc0ad1e1e8ee4edd,
MGDDestiny/Lava 71d3cc89dfd10edf524e7eee2bb417b4a129f1b8.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpress-venv", type=Path, required=True, help="virtual environment with kvpress installed")
    ap.add_argument("--kvcache-factory", type=Path)
    ap.add_argument("--adakv", type=Path)
    ap.add_argument("--cake", type=Path)
    ap.add_argument("--lava", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/slake-ref"))
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[1] / "src"))
    subprocess.run([sys.executable, str(HERE / "capture.py"), "--out", str(args.work)], check=True, env=env)
    cmd = [str(args.kvpress_venv / "bin" / "python"), str(HERE / "reference_side.py"), "--cases", str(args.work),
           "--out", str(args.work / "ref.pt")]
    for name in ("kvcache_factory", "adakv", "cake", "lava"):
        if getattr(args, name):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    subprocess.run(cmd, check=True)
    subprocess.run([sys.executable, str(HERE / "compare.py"), "--cases", str(args.work), "--ref",
                    str(args.work / "ref.pt")], check=True, env=env)


if __name__ == "__main__":
    main()
