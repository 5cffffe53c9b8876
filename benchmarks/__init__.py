"""Benchmarks, each run as `python -m benchmarks.<name>` (benchmarks/README.md)."""
from __future__ import annotations

import argparse


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, object]) -> argparse.Namespace:
    """`p`'s arguments plus `--quick`: a smoke run whose defaults are `quick` (dest -> value; options
    given on the command line still win). Without --quick every default is the full run's."""
    shown = " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in quick.items())
    p.add_argument("--quick", action="store_true", help=f"a smoke run at small sizes: {shown}")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    return args
