"""One process of a real 2-process JAX run on localhost (4 CPU devices each, one global 8-device mesh).

Usage: python tests/multihost_worker.py PROCESS_ID PORT HF_DIR OUT_DIR
Loads the HF folder sharded over the global mesh, runs a jitted forward, gathers the logits, exports the params
(collective gather, process 0 writes) and saves the logits as OUT_DIR/logits.npy (process 0).
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import arpo_jax  # noqa: E402
from arpo_jax import sharding  # noqa: E402


def main(process_id: int, port: int, hf_dir: str, out_dir: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = sharding.make_mesh((2, 2, 2))
    model = arpo_jax.from_pretrained(hf_dir, mesh=mesh)
    ids = np.random.RandomState(0).randint(0, 512, (8, 16))  # the same global batch on every process
    ids = jax.make_array_from_callback(ids.shape, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))),
                                       lambda idx: ids[idx])
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    logits = multihost_utils.process_allgather(logits, tiled=True)
    arpo_jax.save_pretrained(model, os.path.join(out_dir, "export"))
    if process_id == 0:
        np.save(os.path.join(out_dir, "logits.npy"), np.asarray(logits))
    multihost_utils.sync_global_devices("done")
    print(f"process {process_id}: ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
