"""The `lora-lab` command line."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
from pathlib import Path

from .diffusion.bounds import MAX_SAMPLE_STEPS
from .diffusion.config import DEFAULT_MODEL
from .diffusion.distributed import resolve_device
from .diffusion.runfile import config_from_file, read_run_file
from .diffusion.sampling import sample_with_without
from .diffusion.trainer import TrainConfig, train
from .errors import LoraLabError
from .formats import COMPONENTS, FORMATS, convert_lora, load_lora
from .merge import merge_loras, save_merged
from .models import KINDS, REAL_MODELS
from .models.kinds import REGISTRY
from .models.real import REAL_DEFAULT, REAL_PREFIX, real_kind
from .planning import PlanError, fit_config, fit_vram, options_table, parse_bytes, plan_memory, plan_options
from .planning.fakedevice import ATTENTION
from .planning.fit import OPTIMIZER_ORDER
from .planning.planner import PLAN_DEFAULTS
from .resize import extract_file, resize_file

# ----------------------------------------------------------------------------- LoRA files


def _checked_by(parse, error: type[Exception]):
    """An argparse type that checks a flag when the flags are read (before any work): the text itself if
    parse(text) raises no `error`, else argparse's one-line error with its message."""
    def check(text: str) -> str:
        try:
            parse(text)
        except error as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return check


_memory_size = _checked_by(parse_bytes, PlanError)  # --vram


def _lora_spec(text: str) -> tuple[Path, float]:
    """FILE[:STRENGTH] -> (path, strength); the strength defaults to 1."""
    path, sep, strength = text.rpartition(":")
    if not (path if sep else text):  # Path("") is ".", the current folder
        raise argparse.ArgumentTypeError(f"{text!r}: expected FILE:STRENGTH, and the file name is empty")
    if not sep:
        return Path(text), 1.0
    try:
        value = float(strength)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FILE:STRENGTH with a number after the "
                                         "colon") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: the strength must be a finite number, got {strength}")
    return Path(path), value


def _check_output(out: Path, inputs: list[Path], overwrite: bool, folders: tuple[Path, ...] = ()) -> None:
    """Refuse an output path that is a folder or inside an input folder `folders` (a diffusers base: a file
    written into it would join the base), or that is one of the command's own inputs (the same file, also
    through a symlink or a hard link) unless --overwrite was given."""
    if out.is_dir():
        raise LoraLabError(f"{out}: is a folder; give the path of a file to write")
    for folder in folders:
        if out.resolve().is_relative_to(folder.resolve()):
            raise LoraLabError(f"{out}: is inside the input folder {folder}; write it outside the input")
    for src in inputs:
        if not overwrite and out.exists() and src.exists() and os.path.samefile(out, src):
            raise LoraLabError(f"{out}: is the input file {src}; refusing to overwrite an input "
                               "(pass --overwrite to replace it)")


def _os_error(e: OSError) -> str:
    """One line naming the path(s) an OSError is about: 'out.safetensors: No space left on device'."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    return f"{where}: {e.strerror}" if where and e.strerror else str(e)


def _inspect(args) -> int:
    print(load_lora(args.file).summary())
    return 0


def _convert(args) -> int:
    _check_output(args.dst, [args.src], args.overwrite)
    out = convert_lora(args.src, args.dst, to=args.to, base=args.base)
    print(f"wrote {out} ({args.to}, {len(load_lora(out).modules)} modules)")
    return 0


def _merge(args) -> int:
    _check_output(args.out, [args.base, *(path for path, _ in args.lora)], args.overwrite)
    merged = merge_loras(args.base, args.lora, component=args.component, strict=not args.no_strict)
    # e.g. --component text_encoder for a UNet-only LoRA: a copy of BASE would be a silent no-op
    if not merged.patched:
        raise LoraLabError(f"{args.base}: the --lora file(s) change none of its weights"
                           f"{f' (component {args.component})' if args.component else ''}; nothing written")
    save_merged(merged, args.out)
    print(f"wrote {args.out}: {len(merged.patched)} of {len(merged)} weights changed by "
          f"{len(args.lora)} LoRA file(s)")
    return 0


def _resize(args) -> int:
    _check_output(args.dst, [args.src], args.overwrite)
    report = resize_file(args.src, args.dst, args.rank, args.energy, args.report)
    print(report.table() + f"\nwrote {args.dst}")
    return 0


def _extract(args) -> int:
    _check_output(args.dst, [args.tuned, args.base], False)
    report = extract_file(args.tuned, args.base, args.dst, REGISTRY[args.model], args.rank, args.energy,
                          alpha=args.alpha, format=args.to, report=args.report)
    print(report.table() + f"\nwrote {args.dst}")
    return 0


def add_lowrank_parsers(sub) -> None:
    """`lora-lab resize`, `lora-lab extract`: a truncated SVD per layer (resize.py)."""
    def target(p):
        p.add_argument("--rank", type=int, help="the rank to keep (with --energy: the most a layer keeps)")
        p.add_argument("--energy", type=float,
                       help="per layer, the fewest ranks keeping this share of the change's squared norm")
        p.add_argument("--report", type=Path, help="also write the per-layer report as JSON here")

    p = sub.add_parser("resize", help="a LoRA file at a lower rank: fixed, or per layer by energy kept")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    target(p)
    p.add_argument("--overwrite", action="store_true", help="allow DST to be SRC (replaced atomically)")
    p.set_defaults(func=_resize)

    p = sub.add_parser("extract", help="a LoRA from a fine-tuned model minus its base (the denoiser)")
    p.add_argument("tuned", type=Path, help="the fine-tuned model: a diffusers folder, a single file, or "
                   "the denoiser's safetensors")
    p.add_argument("base", type=Path, help="its base, in any of the same forms")
    p.add_argument("dst", type=Path)
    p.add_argument("--model", required=True, choices=KINDS)
    target(p)
    p.add_argument("--alpha", type=float, help="the file's alpha (default: each layer's rank)")
    p.add_argument("--to", default="kohya", choices=FORMATS)
    p.set_defaults(func=_extract)


def add_lora_file_parsers(sub) -> None:
    """`lora-lab inspect`, `lora-lab convert`, `lora-lab merge`."""
    p = sub.add_parser("inspect", help="show a LoRA file's format, modules, ranks, alphas and metadata")
    p.add_argument("file", type=Path)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("convert", help="convert a LoRA file between kohya/ComfyUI and PEFT/diffusers")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--to", required=True, choices=FORMATS)
    p.add_argument("--base", choices=KINDS, help="base model kind (sets lora_te_/lora_te1_)")
    p.add_argument("--overwrite", action="store_true", help="allow DST to be SRC (replaced atomically)")
    p.set_defaults(func=_convert)

    p = sub.add_parser("merge", help="merge LoRA files at strengths into a base weights file")
    p.add_argument("base", type=Path,
                   help="safetensors weights of one component (a UNet, a transformer, ...)")
    p.add_argument("out", type=Path, help="where to write the merged weights (safetensors, base dtype)")
    p.add_argument("--lora", action="append", required=True, type=_lora_spec, metavar="FILE:STRENGTH",
                   help="a LoRA file and its strength (default 1); repeat to stack")
    p.add_argument("--component", choices=COMPONENTS,
                   help="which component BASE is (default: the one the LoRA modules match)")
    p.add_argument("--no-strict", action="store_true",
                   help="skip LoRA modules that match no weight (with a warning)")
    p.add_argument("--overwrite", action="store_true",
                   help="allow OUT to be BASE or a --lora file (replaced atomically)")
    p.set_defaults(func=_merge)


# ----------------------------------------------------------------------------- the parser


def build_parser(flag_defaults: bool = True) -> argparse.ArgumentParser:
    """The `lora-lab` parser; flag_defaults=False: train's TrainConfig flags have none (what was given)."""
    ap = argparse.ArgumentParser(
        prog="lora-lab",
        description="Adapter (LoRA/DoRA) training on frozen models: LoRA files, merging, diffusion training.",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    add_lora_file_parsers(sub)
    add_lowrank_parsers(sub)
    add_train_parser(sub, flag_defaults)
    add_sample_parser(sub)
    add_plan_parser(sub, flag_defaults)
    return ap


# ----------------------------------------------------------------------------- lora-lab train


def add_run_flags(p: argparse.ArgumentParser, flag_defaults: bool = True,
                  defaults: dict | None = None) -> None:
    """A run's flags, the same on `lora-lab train` and `lora-lab plan`: --config, one --flag per TrainConfig
    field (same name, dashes) with its help and default (`defaults` over TrainConfig's), and --vram."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a run file (TOML, or a run's config.json): every setting below by its name "
                   "(sample_every or sample-every), [[datasets]] tables of path, repeats, caption_extension, "
                   "is_reg; the flags given override it")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        default = (defaults or {}).get(f.name, f.default)
        # without flag_defaults, a flag not given is absent: the run file's value (or the default) stays
        unset = default if flag_defaults else argparse.SUPPRESS
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        helptext = f.metadata["help"]  # says its default itself where "None" would not tell it
        if f.name in (defaults or {}):
            helptext = helptext.split(" (default:")[0] + f" (default: {default})"
        helptext += "" if "(default:" in helptext else f" (default: {default})"
        if f.name == "datasets":  # tables: a --config file only
            continue
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=unset, help=helptext)
        elif f.name == "gradient_checkpointing":  # a flag alone means "full"
            p.add_argument(flag, nargs="?", const="full", default=unset, metavar="POLICY", help=helptext)
            p.add_argument("--no-" + flag[2:], dest=f.name, action="store_const", const=False,
                           default=unset, help=argparse.SUPPRESS)
        elif f.name == "sample_prompts":
            p.add_argument(flag, nargs="+", default=unset, metavar="PROMPT", help=helptext)
        else:
            # int | None -> int
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            p.add_argument(flag, type=base, default=unset, help=helptext)
    p.add_argument("--vram", default=None, metavar="SIZE", type=_memory_size,
                   help="the card's memory, e.g. 24GiB: let the memory planner choose checkpointing, "
                   "optimizer, micro-batch and VAE tiling so that every phase fits (--batch-size x "
                   "--grad-accum is then the effective batch)")


def _run_config(args: argparse.Namespace, defaults: dict | None = None, real: bool = False) -> TrainConfig:
    """The TrainConfig of a run's flags: the flags, or a run file over `defaults` with the flags given (not
    their defaults) over it. real (`lora-lab plan`): without a base, the real model of the model named (a
    kind, or a real model's name)."""
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "datasets"]
    if args.config is None:
        given, file = {name: getattr(args, name) for name in names}, {}
    else:
        parsed = build_parser(flag_defaults=False).parse_args(args.argv)
        given, file = {name: getattr(parsed, name) for name in names if hasattr(parsed, name)}, \
            read_run_file(args.config)
    if real:
        settings = {**(defaults or {}), **file, **given}
        given = {**given, **_real_base(settings.get("model") or DEFAULT_MODEL, settings.get("base"))}
    if args.config is None:
        return TrainConfig(**given)
    return config_from_file(args.config, given, defaults)


def _real_base(model: str, base: str | None) -> dict:
    """The model and base of a plan without a base: the real model of `model` (sd3: REAL_DEFAULT's)."""
    name = model if model in REAL_MODELS else REAL_DEFAULT.get(model, model)
    if base is not None or name not in REAL_MODELS:
        return {}
    return {"model": real_kind(name), "base": f"{REAL_PREFIX}{name}"}


# ----------------------------------------------------------------------------- lora-lab train


def add_train_parser(sub, flag_defaults: bool = True) -> argparse.ArgumentParser:
    """`lora-lab train`: a run's flags (`add_run_flags`), --dry-run."""
    p = sub.add_parser(
        "train",
        help=f"train a LoRA/DoRA on a diffusion model ({' | '.join(KINDS)})",
        description="Train a LoRA on a diffusion model. Example: lora-lab train --model sdxl --dataset DIR "
        "--output DIR --rank 32 --steps 1000. Runs data-parallel under torchrun.",
    )
    add_run_flags(p, flag_defaults)
    p.add_argument("--dry-run", action="store_true",
                   help="plan the run instead of running it: each phase's predicted peak (the trainer's own "
                   "stages on fake tensors; with --base real:NAME at real size), then exit; writes nothing "
                   "but the plan cache")
    p.set_defaults(func=_run_train)
    return p


def _run_train(args: argparse.Namespace) -> int:
    config, plan = _run_config(args), None
    if args.vram is not None:
        config, why, plan = fit_config(config, args.vram)
        print(f"lora-lab train --vram {args.vram}: {why}")
    if args.dry_run:  # the plan fit chose is this run's (the same options), not planned again
        same = plan is not None and plan.options == plan_options(config)
        print((plan if same else plan_memory(config)).table())
        return 0
    config.validate()  # a bad flag's error comes alone, before the line below
    if config.base_dtype == "auto" and os.environ.get("RANK", "0") == "0":
        device = resolve_device(config.device)
        dtype = str(config.base_torch_dtype(device)).removeprefix("torch.")
        print(f"lora-lab train: the frozen base loads in {dtype} (--base-dtype auto on {device.type}; the "
              "adapters train in fp32)", file=sys.stderr)
    result = train(config)
    if result.is_main:
        print(f"wrote {', '.join(str(p) for p in result.outputs.values())}")
    return 0


# ----------------------------------------------------------------------------- lora-lab plan


def add_plan_parser(sub, flag_defaults: bool = True) -> argparse.ArgumentParser:
    """`lora-lab plan`: a run's flags (those of `lora-lab train`, with a plan's defaults), --attention; the
    run's plan, its variants' peaks, and with --vram the fastest variant that fits."""
    p = sub.add_parser(
        "plan",
        help="predict the GPU memory of a LoRA training run (real SDXL / SD3.5 / Flux sizes) and choose "
        "options that fit",
        description="Plans the run `lora-lab train` would make of the same flags: the trainer's stages "
        "(caching, loading, training step, saving, sampling) on fake tensors (no weights, no GPU), each "
        "phase's peak; then the variants with and without checkpointing and 8-bit AdamW. --model is a kind "
        f"or a real model ({' | '.join(REAL_MODELS)}); without --base, the real model (real:NAME; sd3: "
        f"{REAL_DEFAULT['sd3']}). Example: lora-lab plan --model sdxl --resolution 1024 --rank 16 "
        "--vram 24GiB",
    )
    add_run_flags(p, flag_defaults, PLAN_DEFAULTS)
    p.add_argument("--attention", default="auto", choices=list(ATTENTION),
                   help="attention kernel (default: auto, what PyTorch picks on the device)")
    p.set_defaults(func=_run_plan)
    return p


def _run_plan(args: argparse.Namespace) -> int:
    config = _run_config(args, PLAN_DEFAULTS, real=True)
    policy = config.checkpointing_policy() or "full"  # the variants with checkpointing
    # the optimizers fit chooses between, or the run's own (Prodigy, Adafactor)
    optimizers = OPTIMIZER_ORDER if config.optimizer in OPTIMIZER_ORDER else (config.optimizer,)
    variants = [dataclasses.replace(config, gradient_checkpointing=ck and policy, optimizer=opt)
                for ck in (False, True) for opt in optimizers
                if ck or not config.blocks_to_swap]  # swapping recomputes: only with checkpointing
    plans = [plan_memory(v, attention=args.attention) for v in variants]
    own = plan_options(config, args.attention)  # the run as given: one of the variants, or planned
    plan = next((p for p in plans if p.options == own), None) or plan_memory(config, attention=args.attention)
    print(plan.table())
    print()
    print(options_table(plans, args.vram))
    if args.vram is not None:
        result = fit_vram(args.vram, config, plans=plans, checkpointing=policy, attention=args.attention)
        print(result.reason())
        print(result.chosen.table())
    return 0


# ----------------------------------------------------------------------------- lora-lab sample


def add_sample_parser(sub) -> argparse.ArgumentParser:
    """`lora-lab sample`: images from a base model with and without LoRA files at given strengths."""
    p = sub.add_parser(
        "sample",
        help="make images with a diffusion model, with and without LoRAs",
        description="Make images from one prompt and seed with the base model, and with the base plus the "
        "given LoRA files (FILE:STRENGTH, kohya/ComfyUI or diffusers format) applied at run time.",
    )
    p.add_argument("--model", required=True, choices=KINDS, help="model kind")
    p.add_argument("--base", default=None,
                   help="local diffusers folder or single file (default: tiny base in data/)")
    p.add_argument("--lora", action="append", default=[], type=_lora_spec, metavar="FILE[:STRENGTH]",
                   help="a LoRA file and its strength (repeat to stack several)")
    p.add_argument("--prompt", required=True, help="the prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial noise (default: 0)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps (default: 20)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's)")
    p.add_argument("--output", default="sample.png", help="PNG to write: [base | base+LoRAs] side by side")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--overwrite", action="store_true", help="allow --output to be a --lora or --base file")
    p.set_defaults(func=_run_sample)
    return p


def _run_sample(args: argparse.Namespace) -> int:
    for path, _ in args.lora:
        if not path.is_file():
            raise LoraLabError(f"--lora {path}: no such file")
    if not 1 <= args.steps <= MAX_SAMPLE_STEPS:
        raise LoraLabError(f"--steps {args.steps}: must be an integer in [1, {MAX_SAMPLE_STEPS}] (the "
                           "schedulers' training timesteps)")
    if args.guidance is not None and not math.isfinite(args.guidance):
        raise LoraLabError(f"--guidance {args.guidance}: must be a finite number")
    if not -(2**63) <= args.seed < 2**64:  # what torch.manual_seed takes
        raise LoraLabError(f"--seed {args.seed}: must be an integer in [-2**63, 2**64)")
    resolve_device(args.device)  # before the pipeline is built
    base = [Path(args.base)] if args.base else []
    _check_output(Path(args.output), [path for path, _ in args.lora] + base, args.overwrite,
                  tuple(p for p in base if p.is_dir()))
    if Path(args.output).suffix.lower() != ".png":  # it wrote PNG bytes into out.jpg
        raise LoraLabError(f"--output {args.output}: the grid is a PNG; give a file name ending in .png")
    out = sample_with_without(
        model=args.model, base=args.base, loras=args.lora, prompts=[args.prompt], seed=args.seed,
        steps=args.steps, guidance=args.guidance, device=args.device, path=Path(args.output),
    )
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.command is None:
        ap.print_help()
        return 0
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except BrokenPipeError:  # `lora-lab inspect F | head`: the reader has gone, not an error of the command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet too
        return 1
    except LoraLabError as e:  # a user's mistake (a bad file, a wrong name): one line, exit code 2
        print(f"lora-lab: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # the file system said no (read-only, full, a folder or file in the way): one line
        print(f"lora-lab: error: {_one_line(_os_error(e))}", file=sys.stderr)
        return 2


def _one_line(message: str) -> str:
    """An error message on one line: a wrapped third-party message (diffusers' hub errors have several)
    joined."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
