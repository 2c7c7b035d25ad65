#!/bin/bash
# One machine, one process (all of its GPUs, or TPU chips, or the CPU):
#
#   launch/local.sh builtin:toy_cpu runs/toy --config.trainer.max_steps=2
#   ARPO_COMMAND=sft launch/local.sh builtin:sft_qwen25_7b runs/sft_7b
#
# Env: ARPO_DATA, ARPO_MODELS, BRIGHTDATA_API_KEY (brightdata search only; or in ARPO_ENV_FILE, default
# ~/.arpo_env), ARPO_COMMAND (train | sft, default train). The Python: ARPO_VENV's, else the checkout's .venv, else
# python3 on PATH (arpo-jax runs as `$PYTHON -m arpo_jax.cli`). Runs from anywhere.
set -euo pipefail

CONFIG=${1:?usage: launch/local.sh CONFIG WORKDIR [--config.x=y ...]}
WORKDIR=${2:?usage: launch/local.sh CONFIG WORKDIR [--config.x=y ...]}
shift 2
cd "$(dirname "$0")/.."

ENV_FILE=${ARPO_ENV_FILE:-$HOME/.arpo_env}
# shellcheck disable=SC1090
[[ -f "$ENV_FILE" ]] && source "$ENV_FILE"

if [[ -n "${ARPO_VENV:-}" ]]; then
  PYTHON=$ARPO_VENV/bin/python
elif [[ -x .venv/bin/python ]]; then
  PYTHON=$PWD/.venv/bin/python
else
  PYTHON=$(command -v python3)
fi

# A co-located vLLM (rollout.engine=vllm) shares the GPUs: keep JAX below what it leaves free (its planned peak
# + 10%; the CUDA contexts and NCCL's buffers in the rest). NVLink SHARP off unless set: its buffers would come
# after vLLM's share (launch/README.md, "GPU memory").
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if [[ -z "${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ]]; then
  XLA_PYTHON_CLIENT_MEM_FRACTION=$("$PYTHON" launch/mem_fraction.py --config="$CONFIG" "$@" | tail -n 1)
  export XLA_PYTHON_CLIENT_MEM_FRACTION
fi
export TOKENIZERS_PARALLELISM=false
# Preflight (`arpo-jax doctor`, seconds): what would fail later, with what to do. ARPO_SKIP_DOCTOR=1 skips it.
if [[ "${ARPO_SKIP_DOCTOR:-0}" != 1 ]]; then
  "$PYTHON" -m arpo_jax.cli doctor --mode="${ARPO_COMMAND:-train}" --config="$CONFIG" --workdir="$WORKDIR" "$@"
fi
exec "$PYTHON" -m arpo_jax.cli "${ARPO_COMMAND:-train}" --config="$CONFIG" --workdir="$WORKDIR" "$@"
