"""The `lora-lab` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .params import LoraLabError

# ----------------------------------------------------------------------------- LoRA files (issue 4)


def _lora_spec(text: str) -> tuple[Path, float]:
    """FILE[:STRENGTH] -> (path, strength); the strength defaults to 1."""
    path, sep, strength = text.rpartition(":")
    if not sep:
        return Path(text), 1.0
    try:
        return Path(path), float(strength)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FILE:STRENGTH with a number after the colon") from None


def _inspect(args) -> int:
    from .formats import load_lora

    print(load_lora(args.file).summary())
    return 0


def _convert(args) -> int:
    from .formats import convert_lora, load_lora

    out = convert_lora(args.src, args.dst, to=args.to, base=args.base)
    print(f"wrote {out} ({args.to}, {len(load_lora(out).modules)} modules)")
    return 0


def _merge(args) -> int:
    from .merge import merge_loras, save_merged

    merged = merge_loras(args.base, args.lora, component=args.component, strict=not args.no_strict)
    save_merged(merged, args.out)
    print(f"wrote {args.out}: {len(merged.patched)} of {len(merged)} weights changed by {len(args.lora)} LoRA file(s)")
    return 0


def add_lora_file_parsers(sub) -> None:
    """`lora-lab inspect`, `lora-lab convert`, `lora-lab merge`."""
    p = sub.add_parser("inspect", help="show a LoRA file's format, modules, ranks, alphas and metadata")
    p.add_argument("file", type=Path)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("convert", help="convert a LoRA file between kohya/ComfyUI and PEFT/diffusers")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--to", required=True, choices=["kohya", "peft"])
    p.add_argument("--base", choices=["sd15", "sdxl", "sd3", "flux"], help="base model kind (sets lora_te_/lora_te1_)")
    p.set_defaults(func=_convert)

    p = sub.add_parser("merge", help="merge LoRA files at strengths into a base weights file")
    p.add_argument("base", type=Path, help="safetensors weights of one component (a UNet, a transformer, ...)")
    p.add_argument("out", type=Path, help="where to write the merged weights (safetensors, base dtype)")
    p.add_argument("--lora", action="append", required=True, type=_lora_spec, metavar="FILE:STRENGTH",
                   help="a LoRA file and its strength (default 1); repeat to stack")
    p.add_argument("--component", choices=["unet", "transformer", "text_encoder", "text_encoder_2", "text_encoder_3"],
                   help="which component BASE is (default: the one the LoRA modules match)")
    p.add_argument("--no-strict", action="store_true", help="skip LoRA modules that match no weight (with a warning)")
    p.set_defaults(func=_merge)


# ----------------------------------------------------------------------------- the parser


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lora-lab",
        description="Adapter (LoRA/DoRA) training on frozen models: LoRA files, merging, diffusion training.",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    add_lora_file_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 0
    try:
        return args.func(args)
    except LoraLabError as e:  # a user's mistake (a bad file, a wrong name): one line, exit code 2
        print(f"lora-lab: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
