"""The policy update: RL maths, log-probs, micro-batch accumulation, the jitted train step, LoRA, the
critic's value model."""
