"""`arpo-jax` command line: `convert` and `quickstart` (train, sft, eval and demo arrive with their issues)."""

from __future__ import annotations

import argparse
import json
import sys


def _convert(args) -> dict:
    from arpo_jax import convert

    if args.direction == "hf-to-orbax":
        return convert.hf_to_orbax(args.hf, args.out, dtype=args.dtype, step=args.step or 0)
    return convert.orbax_to_hf(args.ckpt, args.out, step=args.step, tokenizer=args.tokenizer, dtype=args.dtype)


def _quickstart(args) -> dict:
    from arpo_jax import quickstart

    return quickstart.run(args.workdir, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arpo-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="convert between HuggingFace folders and orbax checkpoints")
    conv_sub = conv.add_subparsers(dest="direction", required=True)
    h2o = conv_sub.add_parser("hf-to-orbax", help="HF folder -> orbax checkpoint (step 0 unless --step)")
    h2o.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    h2o.add_argument("--out", required=True, help="checkpoint directory to create")
    o2h = conv_sub.add_parser("orbax-to-hf", help="orbax checkpoint -> HF folder (latest step unless --step)")
    o2h.add_argument("--ckpt", required=True, help="checkpoint directory (holds step folders)")
    o2h.add_argument("--out", required=True, help="HF folder to write (replaced atomically if it exists)")
    o2h.add_argument("--tokenizer", default=None, help="folder with tokenizer files to include")
    for p in (h2o, o2h):
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="weight dtype (default: the source's)")
        p.add_argument("--step", type=int, default=None)
    conv.set_defaults(func=_convert)

    qs = sub.add_parser("quickstart", help="tiny model end to end: build, convert, check parity, sample")
    qs.add_argument("--workdir", default="runs/quickstart")
    qs.add_argument("--seed", type=int, default=0)
    qs.set_defaults(func=_quickstart)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"arpo-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))  # the final line is machine-readable
    return 0


if __name__ == "__main__":
    sys.exit(main())
