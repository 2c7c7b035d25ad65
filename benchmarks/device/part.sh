#!/bin/bash
# Device call: each carried part .dev/pNN (a gzip stream of the blob's NN-th slice) -> /tmp/parts/rNN (the slice).
for p in .dev/p[0-9][0-9]; do
  [ -f "$p" ] || continue
  n=$(basename $p)
  python3 -c "import gzip,shutil,sys; shutil.copyfileobj(gzip.open(sys.argv[1]), open(sys.argv[2]+'.tmp','wb'))" $p /tmp/parts/r${n#p} \
    && mv /tmp/parts/r${n#p}.tmp /tmp/parts/r${n#p} && rm -f $p && echo "part ${n#p} ok"
done
ls -la /tmp/parts; [ -f /tmp/gpu_scale.log ] && tail -c 600 /tmp/gpu_scale.log
