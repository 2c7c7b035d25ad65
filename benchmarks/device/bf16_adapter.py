"""A PEFT adapter folder's tensors rewritten in bfloat16, in place: half the bytes of float32, for what travels to
and from a device call (a rank-16 adapter of Qwen2.5-0.5B: 35 -> 17.6 MB) and what is committed. `load_peft` reads
it back as float32. Usage: python bf16_adapter.py ADAPTER_DIR [...]"""

import sys

import ml_dtypes
import safetensors
from safetensors.numpy import load_file, save_file

for folder in sys.argv[1:]:
    path = f"{folder}/adapter_model.safetensors"
    meta = safetensors.safe_open(path, "np").metadata()
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(path).items()}, path, metadata=meta)
