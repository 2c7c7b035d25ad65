"""HF folder -> orbax checkpoint. Same as `arpo-jax convert hf-to-orbax --hf DIR --out DIR [--dtype D] [--step N]`."""

import sys

from arpo_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "hf-to-orbax", *sys.argv[1:]]))
