"""The `lora-lab` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lora-lab",
        description="Adapter (LoRA/DoRA) training on frozen models: LoRA files, merging, diffusion training.",
    )
    ap.add_subparsers(dest="command", metavar="COMMAND")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
