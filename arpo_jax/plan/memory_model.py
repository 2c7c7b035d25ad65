"""The itemised memory model behind `arpo-jax plan` (`plan.py`): per device and per program, the bytes of each
thing alive at that program's peak, from the config's shapes and the run's sharding rules; no device, no compile.

Programs: the policy update, the old/ref log-prob forward, the critic's update (`adv_estimator=gae`) and, with the
JAX engine, the sampler's prefill and decode. Items: params, optimizer state, gradient buffers (float32 accumulator
+ one micro-batch's), the gathered layer and unembedding and their gradients, the activations remat keeps, the
recomputed layer's working set, the attention workspace, the log-prob head's chunk, KV cache and sampler weights.
Sharded sizes are exact; activation sizes are a model of what a GPU/TPU compiler keeps (plan.py's docstring gives
the model, and benchmarks/RESULTS.md how it compares with compiled figures).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from arpo_jax import models, sharding
from arpo_jax.experience import tree_packing
from arpo_jax.models.transformer import blockwise_blocks, resolve_attention
from arpo_jax.sharding import DEVICES

GB = 1024**3
HEADROOM = 0.10  # a program fits when its peak leaves this share of JAX's budget free
# The share of a GPU kept out of JAX's pool beside a co-located vLLM where the plan cannot itemise it (`mesh.device`
# names no GPU type, or the model's config is not there yet); `gpu_reserve_gib` itemises it for the known GPUs.
CUDA_RESERVE = 0.05
# The share of each GPU left out of JAX's pool and vLLM's share beside what `gpu_reserve_gib` itemises: XLA's
# command-buffer graphs, cuBLASLt/cuDNN workspaces outside JAX's pool, NCCL's proxy and P2P buffers beyond
# `GpuReserve.nccl` (all estimates until measured: benchmarks/RESULTS.md "Not yet run on a GPU"). 1.6 GiB of an
# 80 GB GPU. `fit.evaluate` caps JAX's pool to leave it, and the engines' largest share leaves it too.
MARGIN = 0.02


@dataclasses.dataclass(frozen=True)
class GpuReserve:
    """GiB one GPU holds outside both budgets: JAX's pool (XLA_PYTHON_CLIENT_MEM_FRACTION) and a co-located vLLM's
    `gpu_memory_utilization`, which vLLM 0.32 counts from a snapshot taken after its own CUDA context and NCCL set-up
    exist (v1/worker/gpu_worker.py `init_device`; CUDA graphs are inside its budget)."""

    # One process's CUDA context on one GPU: driver state, the kernels loaded (lazily since CUDA 11.7), cuBLAS/cuDNN
    # handles and workspaces. PyTorch reports 0.3-0.4 GB per process (pytorch#20532), 0.2-0.7 GB across machines
    # (pytorch#28113), ~0.3 GB with lazy loading and over 1 GB without it (pytorch#107667); more SMs hold more
    # per-SM state, so Hopper gets the larger figure. Upper ends, to be replaced by the nvidia-smi readings that
    # benchmarks/RESULTS.md lists under "Not yet run on a GPU".
    cuda_context: float
    # One process's NCCL communicators on one GPU with NVLS off, allocated at the first collective of each replica
    # group XLA makes a communicator for (the FSDP axis, the data axis; a stream kind each), i.e. after vLLM took its
    # share. A communicator's buffers grow linearly with its channels, and NVLink-rich GPUs use more channels
    # (sjeaugey in nccl#986): one communicator with an all-reduce took ~1.6 GB, three ~6 GB (nccl#864); 8 x H100
    # went from 1.06 to 4.34 GB on its first all-to-all (32 channels per peer, nccl#1685). Two to three
    # communicators of ~1 GiB each on Hopper, fewer channels on A100.
    nccl: float
    # More per GPU when NCCL's NVLink SHARP is on (Hopper with NVSwitch): multicast buffers bound per communicator
    # (1 GiB in nccl-tests#216's log) x the step's communicators. NCCL_NVLS_ENABLE=0 is the default here (cli.py);
    # JAX-Toolbox#383, NeMo-Framework-Launcher#127 and sglang#631 turned NVLS off for the same memory.
    nvls: float


GPU_RESERVES: dict[str, GpuReserve] = {
    "a100-40gb": GpuReserve(0.6, 2.0, 0.0), "a100-80gb": GpuReserve(0.6, 2.0, 0.0),  # no NVLS before Hopper
    "h100-80gb": GpuReserve(0.75, 3.0, 3.0), "h200": GpuReserve(0.75, 3.0, 3.0),
}


def nvls_on() -> bool:
    """Whether NCCL will use NVLink SHARP: only where NCCL_NVLS_ENABLE says so (the CLI sets 0 unless it is set)."""
    return os.environ.get("NCCL_NVLS_ENABLE", "0").strip() not in ("0", "")


def gpu_reserve_gib(device: str, engine: str, engine_tp: int = 1, nvls: bool | None = None,
                    reload_gib: float = 0.0) -> dict[str, float]:
    """Each item of what one GPU of `device` holds outside both budgets, and their `total`, in GiB: JAX's CUDA
    context and NCCL buffers, and beside a vLLM engine the engine process's context (plus its own NCCL buffers with
    tensor parallelism) and its weight reload's transient (`reload_gib`, `engine_reload_gib`). {} for devices without
    a figure (TPU, CPU)."""
    r = GPU_RESERVES.get(device)
    if r is None:
        return {}
    nvls = nvls_on() if nvls is None else nvls
    out = {"jax_cuda_context": r.cuda_context, "jax_nccl": r.nccl + (r.nvls if nvls else 0.0)}
    if engine == "vllm":
        out |= _engine_items(r, engine_tp, nvls, reload_gib)
    return out | {"total": round(sum(out.values()), 3)}


def engine_reserve_gib(device: str, engine_tp: int = 1, nvls: bool | None = None,
                       reload_gib: float = 0.0) -> dict[str, float]:
    """What a GPU of the engines' own (`rollout.vllm.placement=split`) holds outside vLLM's share: the engine
    process's CUDA context, plus its NCCL buffers with tensor parallelism, and its weight reload's transient; and
    their `total`. {} without a figure."""
    r = GPU_RESERVES.get(device)
    if r is None:
        return {}
    out = _engine_items(r, engine_tp, nvls_on() if nvls is None else nvls, reload_gib)
    return out | {"total": round(sum(out.values()), 3)}


def _engine_items(r: GpuReserve, engine_tp: int, nvls: bool, reload_gib: float) -> dict[str, float]:
    out = {"engine_cuda_context": r.cuda_context}
    if engine_tp > 1:
        out["engine_nccl"] = r.nccl + (r.nvls if nvls else 0.0)
    if reload_gib:
        out["engine_reload"] = round(reload_gib, 3)
    return out


def engine_reload_gib(c: models.Config, engine_bytes: int, engine_tp: int) -> float:
    """GiB one engine GPU holds beyond vLLM's share while it reloads weights in place: vLLM 0.32 rebuilds each module
    on the device, loads it, then copies it into the old storage (model_loader/reload/layerwise.py; through torch's
    caching allocator, which keeps it), so one copy of the largest module: the embedding or the LM head for every
    model here (Qwen2.5-7B: 152064 x 3584 in bf16, 1.02 GiB), split over tensor parallelism."""
    d = c.hidden_size
    largest = max(c.vocab_size * d, 2 * c.intermediate_size * d, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * d)
    return largest * engine_bytes / engine_tp / GB


def device_hbm_gib(name: str) -> float:
    dev = DEVICES[name]
    if dev.kind == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    return dev.hbm_gib


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard, i.e. device 0's)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def total_bytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------------------------------
# Sizes: what one device holds of the params, from the run's rules table (no devices needed)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    params: int  # elements of all params on one device
    layer_params: int  # of which decoder layers
    total_params: int  # elements of the whole model
    layer_full: int  # elements of one whole layer (what FSDP gathers), per tensor shard
    unembed_full: int  # V x D per tensor shard
    tensor: int  # tensor-parallel degree of heads / MLP / vocab activations


@functools.lru_cache(maxsize=64)  # an abstract model per call is ~1 s; `_fitting_settings` asks many times
def param_sizes(model_cfg: models.Config, mesh_shape: tuple[int, int, int]) -> Sizes:
    """Per-device param elements under `model_cfg.sharding_rules` on a mesh of `mesh_shape` (exact shard shapes)."""
    rules = sharding.get_rules(model_cfg.sharding_rules)
    mesh = dict(zip(sharding.MESH_AXES, mesh_shape))
    state = nnx.state(models.abstract_model(model_cfg), nnx.Param)
    dev = layers = total = 0
    for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        axes = var.get_metadata().get("axes", (None,) * len(var.shape))
        spec = sharding.logical_to_spec(axes, var.shape, mesh, rules)
        shard = 1
        for dim, entry in zip(var.shape, tuple(spec) + (None,) * (len(var.shape) - len(spec))):
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            shard *= dim // math.prod(mesh[a] for a in names)
        dev += shard
        total += math.prod(var.shape)
        if any(getattr(k, "key", None) == "layers" for k in path):
            layers += shard
    tensor = mesh["tensor"] if rules["act_heads"] else 1
    c = model_cfg
    n_layer = (total - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)) // c.num_layers
    return Sizes(dev, layers, total, n_layer // tensor, c.vocab_size * c.hidden_size // tensor, tensor)


# --------------------------------------------------------------------------------------------------
# The itemised model of each program
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What a run's programs are sized by (from the experiment config, `shapes_of`)."""

    command: str  # "train" | "sft"
    rows: float  # rows of one micro-batch per batch device
    seq: int  # T, tokens per row
    micro_batches: int  # micro-batches a mini-batch computes (an estimate: one trajectory a row, the tree saving)
    logprob_chunk: int
    engine: str  # "vllm" | "jax" | "" (sft)
    gpu_memory_utilization: float
    critic: bool
    ref_on_device: bool
    processes: int
    sampler_batch: int  # B of one sampler call (a bucket), whole process
    sampler_len: int  # S of one sampler call (a bucket)
    prefill_chunk: int
    min_seq: int = 1  # the smallest token budget a row may have (one whole trajectory / SFT example)
    # Tree training (`actor.tree_training`, `tree_packing`): rows of T tree tokens, attention by the tree rule (no
    # [T, T] mask), per row T heads and 8T loss entries (`tree_packing.max_entries_per_row`).
    tree: bool = False
    tree_saving: float = 1.0  # flat tokens / tree tokens: a lower bound from the config (`plan.tree_saving`)
    fixed_micro_batches: int = 0  # M of the batch arrays, as the run fixes it (`global_batch.micro_batches`); 0: above
    engine_tp: int = 1  # GPUs per vLLM engine (rollout.vllm.tensor_parallel_size): > 1 adds its NCCL buffers
    # A KL loss with model.ref_on_host: the reference lives in pinned host memory and is put back on the devices,
    # sharded as the params, for each log-prob pass (train/trainer.py `offload`): on device during that pass only.
    ref_offloaded: bool = False
    placement: str = "colocated"  # rollout.vllm.placement: "split" = the engines on GPUs of their own
    engine_bytes: int = 2  # bytes of a vLLM engine's weights and KV cache entries (rollout.vllm.dtype)
    kv_bytes: int = 0  # bytes of a JAX engine's KV cache entry (rollout.jax.kv_dtype); 0: the compute dtype's
    # The share of the cache a JAX engine's decode call copies at most (rollout.jax.decode_lengths: a call over the
    # first half of the slots works on a copy of them, `jax_decode._window`); 0 with one length.
    kv_window: float = 0.0


def attention_kernel(impl: str, t: int, backend: str, *, tree: bool = False) -> dict:
    """What the training self-attention runs for T = `t` on `backend` (`Attention.attend`): the kernel, whether it
    skips the blocks no query sees, its query (and, skipping, key) block, and the mask it reads ("tree rule": one
    int per key, `TreeMask`; "[T, T]": the boolean mask the model builds from segment ids)."""
    out = {"kernel": impl, "skip_blocks": False, "block": 0, "mask": "tree rule" if tree else "[T, T]"}
    if impl == "blockwise":
        blocks = blockwise_blocks(t, backend)
        out["skip_blocks"] = bool(blocks.get("skip_blocks"))
        out["block"] = min(t, blocks["block_size"]) if out["skip_blocks"] else \
            max(blocks.get("block_size", 128), -(-t // blocks.get("max_blocks", 8)))
    elif impl == "xla":
        out["block"] = t
    if tree and impl != "blockwise":
        out["mask"] = "[T, T] (TreeMask.dense)"
    return out


def attention_workspace(model_cfg: models.Config, impl: str, t: int, rows: float, tensor: int, backend: str, *,
                        backward: bool, tree: bool = False) -> float:
    """Bytes of one layer's attention at its peak: float32 score-sized arrays (3 in the backward, 2 forward-only)
    of the largest block (skipping: one [N, block, block] pair; unskipped: [N, block, T]), the [T, T] boolean
    mask the model builds (none for the blockwise kernel under the tree rule: one int per key) and, in the blockwise
    backward, its float32 gradient accumulators [N + 2K, T, H]. cuDNN (flash: no scores) is given the mask as a
    [T, T] bias in the compute dtype, counted beside the boolean mask."""
    heads = model_cfg.num_heads // tensor
    k = attention_kernel(impl, t, backend, tree=tree)
    keys = k["block"] if k["skip_blocks"] else t
    mask = 4 * t if k["mask"] == "tree rule" else t * t
    if impl == "cudnn":
        mask += t * t * jnp.dtype(model_cfg.dtype).itemsize
    # The blockwise backward's float32 dq, dk, dv accumulators (whole T; the inputs are in the layer's items).
    grads = 4 * t * model_cfg.head_dim * (heads + 2 * max(1, model_cfg.num_kv_heads // tensor)) \
        if backward and impl == "blockwise" else 0
    return rows * ((3 if backward else 2) * 4 * heads * k["block"] * keys + mask + grads)


def batch_bytes(sh: Shapes, arrays: int) -> float:
    """The micro-batches' arrays on one device: `arrays` int32/float32 [M, rows, T] arrays flat; with tree training
    the token arrays (ids, positions, tree_end), the heads (U: slot, target) and the loss entries (E per row: index,
    segment and `arrays - 3` float arrays), U and E as the run fixes them (`tree_packing.max_heads_per_row`,
    `max_entries_per_row`)."""
    micro = sh.fixed_micro_batches or sh.micro_batches
    if not sh.tree:
        return micro * sh.rows * arrays * sh.seq * 4
    per_row = 3 * sh.seq + 2 * tree_packing.max_heads_per_row(sh.seq) + \
        (arrays - 1) * tree_packing.max_entries_per_row(sh.seq)
    return micro * sh.rows * per_row * 4


def _per_layer_widths(c: models.Config, tensor: int) -> tuple[int, int, int]:
    return c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim // tensor, c.intermediate_size // tensor


def _remat_saved(c: models.Config, tensor: int) -> int:
    """Elements per token one layer keeps for the backward under `c.remat`."""
    d, qkv, f = _per_layer_widths(c, tensor)
    return {"full": d, "dots": 3 * d + qkv + 2 * f, "dots_no_batch": 3 * d + qkv + 2 * f}.get(c.remat,
                                                                                       8 * d + 3 * qkv + 4 * f)


def update_items(c: models.Config, s: Sizes, sh: Shapes, backend: str, impl: str) -> dict[str, float]:
    """Bytes per device alive at the peak of one optimizer step (the backward of one micro-batch)."""
    pb, cb = jnp.dtype(c.param_dtype).itemsize, jnp.dtype(c.dtype).itemsize
    d, qkv, f = _per_layer_widths(c, s.tensor)
    t, r = sh.seq, sh.rows
    return {
        "params": s.params * pb,
        "optimizer_state": 2 * s.params * pb,  # AdamW mu and nu, shaped and sharded like the params
        "grad_accumulator": s.params * 4,  # float32, sharded like the params
        "micro_batch_grads": s.params * pb,  # one micro-batch's gradients before they are added
        "gathered_layer_and_grad": s.layer_full * (cb + 4),  # FSDP: one whole layer in compute dtype + its grad
        "gathered_unembed_and_grad": s.unembed_full * (cb + 4),
        "remat_activations": c.num_layers * r * t * _remat_saved(c, s.tensor) * cb,
        "layer_working_set": r * t * (6 * d + 2 * qkv + 5 * f) * cb,  # the layer recomputed in the backward
        "attention_workspace": attention_workspace(c, impl, t, r, s.tensor, backend, backward=True, tree=sh.tree),
        "logprob_head": 3 * r * sh.logprob_chunk * c.vocab_size // s.tensor * 4,  # [rows, chunk, V] float32
        "batch": batch_bytes(sh, 9),
    }


def forward_items(c: models.Config, s: Sizes, sh: Shapes, backend: str, impl: str) -> dict[str, float]:
    """Bytes per device at the peak of the old/ref log-prob forward (train state resident, no gradients)."""
    pb, cb = jnp.dtype(c.param_dtype).itemsize, jnp.dtype(c.dtype).itemsize
    d, qkv, f = _per_layer_widths(c, s.tensor)
    t, r = sh.seq, sh.rows
    return {
        "params": s.params * pb, "optimizer_state": 2 * s.params * pb,
        "gathered_layer_and_grad": s.layer_full * cb,
        "gathered_unembed_and_grad": s.unembed_full * cb,
        "layer_working_set": r * t * (4 * d + qkv + 3 * f) * cb,
        "attention_workspace": attention_workspace(c, impl, t, r, s.tensor, backend, backward=False, tree=sh.tree),
        "logprob_head": 2 * r * sh.logprob_chunk * c.vocab_size // s.tensor * 4,
        "batch": 2 * batch_bytes(sh, 6),
    }


def engine_cache(jax_cfg, kind: str) -> tuple[int, float]:
    """(`Shapes.kv_bytes`, `Shapes.kv_window`) of a config's `rollout.jax` on a device of `kind`, as
    `jax_decode.kv_cache_dtype` and `decode_length_buckets` resolve them there."""
    kv, lengths = jax_cfg.kv_dtype, jax_cfg.decode_lengths
    entry = 0 if kv == "compute" or (kv == "auto" and kind == "cpu") else 4 if kv == "float32" else 2
    window = 0.5 if lengths == "halves" or (lengths == "auto" and kind != "cpu") else 0.0
    return entry, window


def kv_cache_bytes(c: models.Config, sh: Shapes, local_devices: int) -> float:
    """The JAX sampler's dense cache: k and v [L, B, K, S, H] in its dtype (`Shapes.kv_bytes`), B split over the
    local devices."""
    return 2 * c.num_layers * sh.sampler_batch * c.num_kv_heads * sh.sampler_len * c.head_dim * \
        (sh.kv_bytes or jnp.dtype(c.dtype).itemsize) / local_devices


def sampler_items(c: models.Config, s: Sizes, sh: Shapes, local_devices: int) -> dict[str, dict[str, float]]:
    """Bytes per device of the JAX engine's programs (prefill, decode; `jax_decode.engine_programs`) for an engine
    of `sampler_batch` rows (`rollout.jax.max_tokens_per_call` bounds it), train state resident.

    The engine holds a copy of the weights in the compute dtype (`jax_sampler.decode_weights`: the whole model over
    each process's local devices; the layers stored stacked, so no per-call copy) and its cache between calls. A
    prefill call takes `prefill_chunk` tokens (G rows x T, G at most `prefill_chunk / 32`, the shortest length's),
    written into the cache in place; each layer reads its G rows ([G, K, S, H], one layer at a time) and attends over
    them: float32 scores [G, N, T, S]."""
    pb, cb = jnp.dtype(c.param_dtype).itemsize, jnp.dtype(c.dtype).itemsize
    resident = {"params": s.params * pb, "optimizer_state": 2 * s.params * pb,
                "sampler_params": s.total_params * cb / local_devices}
    kv = kv_cache_bytes(c, sh, local_devices)
    rows = min(sh.sampler_batch, max(1, sh.prefill_chunk // 32))  # the most rows one prefill call gathers
    b_dev = sh.sampler_batch / local_devices
    return {
        "sampler_prefill": resident | {
            "kv_cache": kv,
            "kv_rows_gathered": kv / c.num_layers / max(b_dev, 1.0) * rows,
            "prefill_scores": 2 * 4 * c.num_heads * sh.prefill_chunk * sh.sampler_len},
        "sampler_decode": resident | {
            "kv_cache": kv,
            "kv_window": kv * sh.kv_window,
            "decode_logits": 3 * 4 * b_dev * c.vocab_size},
    }


def itemise(c: models.Config, mesh_shape: tuple[int, int, int], sh: Shapes, backend: str) -> dict:
    """{program: {item: bytes per device}} for every program the run executes (module docstring)."""
    s = param_sizes(c, tuple(mesh_shape))
    impl = resolve_attention(c.attention_impl, backend, c.dtype)
    n_dev = math.prod(mesh_shape)
    local = max(1, n_dev // sh.processes)
    pb = jnp.dtype(c.param_dtype).itemsize
    programs = {"update": update_items(c, s, sh, backend, impl)}
    extra = {}
    if sh.command == "train":
        programs["logprob_forward"] = forward_items(c, s, sh, backend, impl)
        if sh.ref_offloaded:
            programs["logprob_forward"]["ref_params"] = s.params * pb
        if sh.ref_on_device:
            extra["ref_params"] = s.params * pb
        if sh.critic:  # a value model of the policy's size, with its own AdamW state, resident throughout
            extra["critic_params_and_optimizer"] = 3 * s.params * pb
            critic = update_items(c, s, sh, backend, impl)
            programs["critic_update"] = {k: v for k, v in critic.items() if k not in ("params", "optimizer_state")}
            programs["critic_update"] |= {"params": s.params * pb, "optimizer_state": 2 * s.params * pb}
        if sh.engine == "jax":
            # Not resident during the log-prob forward and the update: the trainer puts the sampler to sleep
            # (`Sampler.sleep` frees its weights and cache) until the weight sync that follows the update.
            programs |= sampler_items(c, s, sh, local)
    for items in programs.values():
        for k, v in extra.items():
            items.setdefault(k, v)
    kernel = attention_kernel(impl, sh.seq, backend, tree=sh.tree)
    attention = {p: kernel if not p.startswith("sampler") else {"kernel": "cached_attention", "skip_blocks": False}
                 for p in programs}
    return {"programs": programs, "sizes": dataclasses.asdict(s), "attention": impl, "attention_by_program": attention}
