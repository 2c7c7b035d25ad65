#!/bin/bash
# Device call 1: packages, libseccomp, a copy of the repo in /tmp, the first part, gpu_scale in the background.
set -x
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/whl/*.whl || exit 1
mkdir -p /tmp/seccomp /tmp/parts /tmp/repo && dpkg -x .dev/deb/*.deb /tmp/seccomp || exit 1
tar --exclude=./.dev -cf - . | tar -xf - -C /tmp/repo
bash benchmarks/device/part.sh
export PYTHONPATH=/tmp/site:/tmp/repo PYTHONUNBUFFERED=1
python3 -c "import jax, arpo_jax, gguf, math_verify, ml_collections; print(jax.devices())"
if [ -n "${GS_CASES:-}" ]; then
  cd /tmp && setsid nohup python3 /tmp/repo/benchmarks/device/gpu_scale.py --cases "$GS_CASES" --budget-s "$GS_BUDGET" \
    --out /tmp/gpu_scale.jsonl > /tmp/gpu_scale.log 2>&1 < /dev/null &
fi
echo "call 1: $(( $(date +%s) - T0 )) s"
