"""The config, on the ground floor: its schema (`schema`: every field, its default and meaning), the command line
(`args`), where the experiment files are (`experiments`) and redaction before logging (`redaction`)."""
