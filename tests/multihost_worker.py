"""One process of a real 2-process JAX run on localhost (4 CPU devices each, one global 8-device mesh).

Usage: python tests/multihost_worker.py PROCESS_ID PORT HF_DIR OUT_DIR
Loads the HF folder sharded over the global mesh, runs a jitted forward, gathers the logits, exports the params
(collective gather, process 0 writes) and saves the logits as OUT_DIR/logits.npy (process 0); then checkpoints with
integrity records, keep-2 retention and a fallback from a damaged step, agreed by both processes.
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
    checkpoints_agree(model, mesh, process_id, os.path.join(out_dir, "ckpt"))
    multihost_utils.sync_global_devices("done")
    print(f"process {process_id}: ok")


def checkpoints_agree(model, mesh, process_id: int, directory: str) -> None:
    """Integrity records, retention and the fallback from a damaged step, decided by process 0 for both."""
    from pathlib import Path

    from arpo_jax import checkpoint

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ckpt = checkpoint.Checkpointer(directory, max_to_keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, params, config=model.config)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3] and ckpt.is_sealed(3), ckpt.all_steps()
    if process_id == 0:  # 64 bytes flipped inside a params file of step 3 (same size)
        victim = max((f for f in (Path(directory) / "3" / "params").rglob("*") if f.is_file()),
                     key=lambda f: f.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[100:164] = bytes(b ^ 0xFF for b in data[100:164])
        victim.write_bytes(bytes(data))
    multihost_utils.sync_global_devices("damaged")
    step, _ = ckpt.restore_newest_intact(lambda s: ckpt.restore(s, mesh=mesh))
    assert step == 2 and ckpt.all_steps() == [2], (step, ckpt.all_steps())
    ckpt.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
