"""Experiment configs: the command line (`args`), validation (`validate`), the files a command needs
(`files`) and redaction before logging (`redaction`)."""
