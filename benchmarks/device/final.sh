#!/bin/bash
# Device's last call: the last part, the blob joined and checked, the GPU freed, the study's RL runs side by side
# (each time-limited) and their evaluations, what came back under $OUT.
set -x
T0=$(date +%s)
bash benchmarks/device/part.sh
cat /tmp/parts/r* > /tmp/blob.tar && grep -q "$(cut -c1-64 .dev/blob.sha256)" <(sha256sum /tmp/blob.tar) \
  || { echo BLOB-MISMATCH; ls -la /tmp/parts; exit 1; }
mkdir -p /tmp/w && tar -xf /tmp/blob.tar -C /tmp/w && rm /tmp/blob.tar /tmp/parts/r*
# The study's three processes preallocate 30% of the GPU each: nothing else may hold it (a gpu_scale case still
# running made one fail on 2026-11-28). Stop gpu_scale, then wait for its memory to come back.
pkill -TERM -f gpu_scale.py; for i in $(seq 30); do
  [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)" -lt 2000 ] && break; sleep 1; done
cp /tmp/gpu_scale.jsonl /tmp/gpu_scale.log $OUT/ 2>/dev/null
rm -rf /tmp/repo_final && mkdir /tmp/repo_final && tar --exclude=./.dev -cf - . | tar -xf - -C /tmp/repo_final
export PYTHONPATH=/tmp/site:/tmp/repo_final PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=/tmp/seccomp/usr/lib/x86_64-linux-gnu
export ARPO_EVAL_DATA=/tmp/w/eval ARPO_CACHE=/tmp/cache TOKENIZERS_PARALLELISM=false
W=/tmp/study; mkdir -p $W && cp -r /tmp/w/data /tmp/w/sft_adapter $W/
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 5 > $W/nvidia_smi.csv 2>&1 &
echo "setup: $(( $(date +%s) - T0 )) s"
cd /tmp/repo_final && timeout -s TERM "$HARD_S" python3 benchmarks/studies/gsm8k_tool.py --size gpu --parallel \
  --model "/tmp/w/$(basename /tmp/w/*.gguf)" --workdir $W --phases rl,eval,report \
  --set trainer.time_limit_minutes="${RL_MIN:-3.5}" ${EXTRA:-} > $W/study.log 2>&1
echo "study rc $? at $(( $(date +%s) - T0 )) s"
pkill -TERM -f gsm8k_tool.py && sleep 8; pkill -KILL -f gsm8k_tool.py
tail -c 3000 $W/study.log; for f in $W/parallel_*.log; do echo "== $f"; tr '\r' '\n' < $f | grep -v '^\s*$' | tail -n 8; done
# What comes back: at most 8 files of 16 MiB, 64 MiB together. The study first (a name that sorts first), then each
# run's adapter in bf16 in 15 MiB pieces (on 2026-11-28 two float32 adapters filled the 64 MiB and the study's tarball
# did not come back).
cd /tmp && tar --exclude='*/checkpoints' --exclude='*.safetensors' --exclude='hf_model*' -czf $OUT/0_study.tgz study
for run in $W/parallel/*/*_s0; do
  [ -d $run/adapter ] && python3 /tmp/repo_final/benchmarks/device/bf16_adapter.py $run/adapter \
    && (cd $run && tar -cf - adapter | split -b 15M - $OUT/$(basename $run)_adapter.tar.); done
ls -la $OUT; echo "final: $(( $(date +%s) - T0 )) s"
