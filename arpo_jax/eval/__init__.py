"""Evaluation (spec section 13): benchmark loaders, the eval prompt, per-output scoring and pass@k aggregation.

``benchmarks`` reads the 13 benchmark files into ``EvalSample``s and builds the chat messages (the training
prompt, spec B17); ``scoring`` extracts a prediction from a model output, scores it, and aggregates pass@k.
``runner`` / ``agent`` run a model (plus a LoRA adapter) on any benchmark slice; ``cold_start`` samples a model's own
tool-using solutions through them (rejection sampling for SFT) and ``math_tool`` writes the maths-with-Python
recipe's data files.
"""
