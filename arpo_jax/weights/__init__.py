"""Weights in and out: checkpoints, HF folders, GGUF, named models, pretrained loading, LoRA files, the
policy of a config."""
