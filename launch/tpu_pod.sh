#!/bin/bash
# A Cloud TPU slice (single- or multi-host): the same command on every TPU VM worker.
#
#   launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [--config.x=y ...]
#   ARPO_SETUP=1 launch/tpu_pod.sh my-v4-32 us-central2-b builtin:arpo_qwen3_14b_tpu_v4_32 /mnt/shared/runs/14b
#
# ARPO_SETUP=1 first copies this repository to ARPO_REMOTE_DIR (default ~/arpo-jax) on every worker, installs it
# with the TPU extra into ARPO_REMOTE_DIR/.venv, and copies ARPO_ENV_FILE (default ~/.arpo_env: `export` lines
# for ARPO_DATA, ARPO_MODELS, BRIGHTDATA_API_KEY) to each worker with mode 600, so the key never appears on a
# command line. Every worker must see ARPO_DATA and ARPO_MODELS at the same paths (a persistent disk, Filestore,
# or gcsfuse mount), and WORKDIR must be shared too (a folder every worker mounts at the same path; a gs:// URL
# is refused at start): checkpoints are written by all hosts together. jax.distributed.initialize() finds the slice's workers from the TPU VM metadata by itself.
set -euo pipefail

TPU=${1:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [--config.x=y ...]}
ZONE=${2:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [--config.x=y ...]}
CONFIG=${3:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [--config.x=y ...]}
WORKDIR=${4:?usage: launch/tpu_pod.sh TPU_NAME ZONE CONFIG WORKDIR [--config.x=y ...]}
shift 4
REMOTE=${ARPO_REMOTE_DIR:-arpo-jax}  # relative to the remote home
ENV_FILE=${ARPO_ENV_FILE:-$HOME/.arpo_env}
COMMAND=${ARPO_COMMAND:-train}
REPO=$(cd "$(dirname "$0")/.." && pwd)
on_all() { gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command="$1"; }

if [[ "${ARPO_SETUP:-0}" == 1 ]]; then
  tarball=$(mktemp --suffix=.tar.gz)
  tar -C "$REPO" --exclude=.git --exclude=.venv --exclude=runs --exclude='__pycache__' -czf "$tarball" .
  gcloud compute tpus tpu-vm scp "$tarball" "$TPU":arpo-jax.tar.gz --zone="$ZONE" --worker=all
  rm -f "$tarball"
  if [[ -f "$ENV_FILE" ]]; then
    gcloud compute tpus tpu-vm scp "$ENV_FILE" "$TPU":.arpo_env --zone="$ZONE" --worker=all
  fi
  on_all "set -e; chmod 600 ~/.arpo_env 2>/dev/null || true; mkdir -p $REMOTE && tar -xzf arpo-jax.tar.gz -C $REMOTE \
    && cd $REMOTE && python3 -m venv .venv && .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e '.[tpu]'"
fi

# Quote every argument for the remote shell (overrides such as --config.mesh.shape="(1,8,2)" contain parentheses).
ARGS=$(printf ' %q' "$COMMAND" --config="$CONFIG" --workdir="$WORKDIR" "$@")
# On a GCE TPU VM the worker list lives in the metadata server, not in the environment; arpo_jax.assemble.policy decides
# whether to call jax.distributed.initialize() from TPU_WORKER_HOSTNAMES, so export it (with TPU_WORKER_ID, which
# JAX then reads as this worker's process id). worker-network-endpoints is "host,..." or "name:id:ip,...".
MD='http://metadata.google.internal/computeMetadata/v1/instance/attributes'
WORKERS="export TPU_WORKER_ID=\$(curl -sf -H Metadata-Flavor:Google $MD/agent-worker-number); \
  export TPU_WORKER_HOSTNAMES=\$(curl -sf -H Metadata-Flavor:Google $MD/worker-network-endpoints \
    | tr , '\n' | awk -F: '{print \$NF}' | paste -sd, -)"
on_all "set -e; cd $REMOTE; if [ -f ~/.arpo_env ]; then . ~/.arpo_env; fi; $WORKERS; \
  export TOKENIZERS_PARALLELISM=false; exec .venv/bin/arpo-jax$ARGS"
