"""The runs: the RL trainer, cold-start SFT, their shared skeleton, the run guard, metrics."""
