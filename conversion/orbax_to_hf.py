"""Orbax checkpoint -> HF folder. Same as `arpo-jax convert orbax-to-hf --ckpt DIR --out DIR [--tokenizer DIR]`."""

import sys

from arpo_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", "orbax-to-hf", *sys.argv[1:]]))
