"""`arpo-jax plan`: the memory and communication of every program a config runs."""
