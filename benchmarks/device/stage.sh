#!/bin/bash
# Here, before the device calls: .dev/{whl,deb,parts,blob.sha256} from a study dir (data/, sft_adapter/). See README.md.
set -euo pipefail
STUDY=$(realpath "$1"); GGUF=${GGUF:-$HOME/.cache/arpo-jax/gguf/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf}
EVAL=${ARPO_EVAL_DATA:-../shared/data/eval}; PY=${PY:-python}
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || echo "/.dev/" >> .git/info/exclude
rm -rf .dev/parts .dev/blob && mkdir -p .dev/whl .dev/deb .dev/parts .dev/blob/eval
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .dev/whl ml_collections==1.1.0 bm25s==0.3.16 \
  gguf==0.19.0 latex2sympy2_extended==1.11.0 math-verify==0.9.0 antlr4-python3-runtime==4.13.2 tensorboardX==2.6.5
(cd .dev/deb && apt-get download libseccomp2)
cp -r "$STUDY/data" "$STUDY/sft_adapter" .dev/blob/ && cp -r "$EVAL/gsm8k" "$EVAL/math500" .dev/blob/eval/
cp "$GGUF" .dev/blob/
$PY benchmarks/device/bf16_adapter.py .dev/blob/sft_adapter  # the GPU run is bf16
(cd .dev/blob && tar -cf ../blob.tar *) && sha256sum .dev/blob.tar > .dev/blob.sha256 && rm -rf .dev/blob
# Each call carries the work tree too (tracked and untracked-not-ignored files: ~20 MiB with the committed GSM8K
# adapter) within its 64 MiB; the first call also the wheels and the .deb (~0.9 MiB).
export TREE_BYTES=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
$PY - <<'PY'  # gzip parts within each call's budget
import gzip, os
data, MiB = open(".dev/blob.tar", "rb").read(), 1048576
part_budget = 63.5 * MiB - int(os.environ["TREE_BYTES"])
pos, i = 0, 0
while pos < len(data):
    budget = int(part_budget - (0.9 * MiB if i == 0 else 0))
    size = min(len(data) - pos, int(budget / 0.97))
    while True:
        z = gzip.compress(data[pos:pos + size], 6, mtime=0)
        if len(z) <= budget and (pos + size == len(data) or len(z) > budget - 400_000):
            break
        size = int(size * (budget - 150_000) / len(z))
    open(f".dev/parts/p{i:02d}", "wb").write(z)
    pos, i = pos + size, i + 1
print(f"{i} parts")
PY
rm .dev/blob.tar; ls -l .dev/parts
