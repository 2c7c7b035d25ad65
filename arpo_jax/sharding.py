"""Device mesh, the one logical-axis rules table, and the devices a config can name (`mesh.device`).

Mesh axes (always these three, in this order):
  data    pure data parallelism: the batch is split, params are replicated across it.
  fsdp    data parallelism with fully-sharded params and optimizer state (ZeRO-3): the batch is split over it too,
          and each param is split along its `embed` dimension, all-gathered just in time by XLA.
  tensor  Megatron-style tensor parallelism: heads, MLP width and vocab are split; activations stay split inside
          attention and MLP blocks.

Parameters and activations name *logical* axes ("embed", "q_heads", "batch", ...). A rules table maps each logical
axis to zero or more mesh axes. Changing the parallelism strategy means choosing or editing a table here, nothing
else. A dimension that the mapped mesh axes do not divide (e.g. 4 KV heads on tensor=8) is replicated instead of
failing, because a real model's head counts rarely divide every mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Param axes first, then activation axes.
RULES: dict[str, dict[str, tuple[str, ...]]] = {
    # FSDP only: every param is split along `embed` over fsdp; nothing uses the tensor axis.
    "fsdp": {
        "vocab": (),
        "embed": ("fsdp",),
        "q_heads": (),
        "kv_heads": (),
        "head_dim": (),
        "mlp": (),
        "norm": (),
        "batch": ("data", "fsdp"),
        "batch_replicas": ("data",),  # the batch over the param replicas only (rows gathered over fsdp)
        "seq": (),
        "act_embed": (),
        "act_heads": (),
        "act_kv_heads": (),
        "act_mlp": (),
        "act_vocab": (),
    },
    # FSDP + tensor parallelism: params split along embed over fsdp and along heads / mlp / vocab over tensor.
    "fsdp_tp": {
        "vocab": ("tensor",),
        "embed": ("fsdp",),
        "q_heads": ("tensor",),
        "kv_heads": ("tensor",),
        "head_dim": (),
        "mlp": ("tensor",),
        "norm": (),
        "batch": ("data", "fsdp"),
        "batch_replicas": ("data",),  # the batch over the param replicas only (rows gathered over fsdp)
        "seq": (),
        "act_embed": (),
        "act_heads": ("tensor",),
        "act_kv_heads": ("tensor",),
        "act_mlp": ("tensor",),
        "act_vocab": ("tensor",),
    },
}


def get_rules(name: str) -> dict[str, tuple[str, ...]]:
    if name not in RULES:
        raise ValueError(f"sharding rules {name!r} unknown; allowed: {sorted(RULES)}")
    return RULES[name]


def make_mesh(shape: Sequence[int] = (1, -1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ('data', 'fsdp', 'tensor') mesh. One entry may be -1: it takes all remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    shape = list(shape)
    if len(shape) != 3:
        raise ValueError(f"mesh shape must have 3 entries for {MESH_AXES}, got {shape}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh shape {shape}: entries must be positive, with at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape}: {len(devices)} devices are not divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} has {math.prod(shape)} devices, but {len(devices)} are available")
    # Auto axes: XLA's sharding propagation (GSPMD) fills in what the constraints leave open.
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def logical_to_spec(
    axes: Sequence[str | None], shape: Sequence[int] | None, mesh_shape: dict[str, int], rules: dict
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec; drops mesh axes that are used twice or do not divide the dim."""
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        mesh_axes = [] if name is None else list(rules.get(name, ()))
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no entry in the sharding rules table")
        kept: list[str] = []
        for ax in mesh_axes:
            size = mesh_shape.get(ax, 1)
            if ax in used or size == 1:
                continue
            if shape is not None and shape[i] % (math.prod(mesh_shape[a] for a in kept) * size):
                continue
            kept.append(ax)
        used.update(kept)
        spec.append(tuple(kept) if len(kept) > 1 else (kept[0] if kept else None))
    return PartitionSpec(*spec)


def param_sharding(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: dict) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, dict(mesh.shape), rules))


def state_shardings(abstract_state, mesh: Mesh, rules: dict, *, abstract: bool = False):
    """NamedSharding (or, with `abstract`, a sharded ShapeDtypeStruct) for every nnx.Variable, from its `axes`."""
    from flax import nnx

    def one(var):
        axes = var.get_metadata().get("axes", (None,) * len(var.shape))
        s = param_sharding(axes, var.shape, mesh, rules)
        return var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=s) if abstract else s)

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _stack(*xs):
    return jax.numpy.stack(xs)


@functools.lru_cache(maxsize=64)
def _stacker(target):
    return jax.jit(_stack, out_shardings=target)  # one wrapper per sharding: compiled once per shape


def stack_onto(arrays: Sequence[jax.Array], target: jax.sharding.Sharding | None) -> jax.Array:
    """`jnp.stack(arrays)` placed straight into `target` (e.g. per-layer arrays -> a stacked weight)."""
    return _stacker(target)(*arrays)


def constrain(x: jax.Array, axes: Sequence[str | None], rules_name: str) -> jax.Array:
    """Activation sharding constraint by logical names; a no-op outside a mesh context (`jax.set_mesh`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(axes, x.shape, auto_axes(mesh), get_rules(rules_name))
    return jax.lax.with_sharding_constraint(x, spec)


def batch_spec(mesh: Mesh, rules_name: str) -> PartitionSpec:
    """[M, B, T] batch arrays: rows split over the mesh axes of the logical ``batch`` axis."""
    axes = tuple(a for a in get_rules(rules_name)["batch"] if mesh.shape[a] > 1)
    return PartitionSpec(None, axes or None, None)


def batch_shards(rows: int, rules_name: str | None) -> int:
    """Devices the logical "batch" axis spans in the current mesh context (`jax.set_mesh`); 1 outside one, without
    rules, or when it does not divide `rows`."""
    mesh = jax.sharding.get_abstract_mesh()
    if rules_name is None or mesh.empty:
        return 1
    n = math.prod(auto_axes(mesh).get(a, 1) for a in get_rules(rules_name)["batch"])
    return n if rows % n == 0 else 1


_TAKEN: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("taken_mesh_axes", default=frozenset())


@contextlib.contextmanager
def axes_taken(*axes: str):
    """Inside (while tracing), `constrain` and `batch_shards` leave `axes` alone: an enclosing `jax.vmap(...,
    spmd_axis_name=axes)` splits its mapped dimension over them (e.g. the update's data-parallel groups)."""
    token = _TAKEN.set(_TAKEN.get() | set(axes))
    try:
        yield
    finally:
        _TAKEN.reset(token)


def auto_axes(mesh) -> dict[str, int]:
    """The sizes of `mesh`'s axes that activation constraints may use: all but those `axes_taken` reserved."""
    taken = _TAKEN.get()
    return {a: n for a, n in dict(mesh.shape).items() if a not in taken}


def describe(abstract_state, mesh: Mesh, rules: dict) -> dict[str, str]:
    """`{param path: 'shape -> PartitionSpec'}`, the reviewable golden dump of a sharding plan."""
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(abstract_state):
        spec = param_sharding(var.get_metadata()["axes"], var.shape, mesh, rules).spec
        out[".".join(map(str, path))] = f"{tuple(var.shape)} -> {tuple(spec)}"  # stable across jax versions
    return out


@dataclasses.dataclass(frozen=True)
class Device:
    kind: str  # "gpu" | "tpu" | "cpu"
    hbm_gib: float  # what one device has (the bytes limit its runtime reports); 0 = this host's RAM
    per_host: int = 1 << 30  # devices per host, i.e. per JAX process (one process per host)


# `mesh.device`: the hardware a config runs on. GPU sizes are what nvidia-smi reports (A100-80GB 81920 MiB, H100
# SXM 81559 MiB, H200 143771 MiB); TPU sizes the per-chip HBM JAX reports as its bytes limit (v4 and v5e slightly
# under 32 / 16 GiB, v5p 95 GB).
DEVICES: dict[str, Device] = {
    "a100-40gb": Device("gpu", 40.0, 8), "a100-80gb": Device("gpu", 80.0, 8), "h100-80gb": Device("gpu", 79.6, 8),
    "h200": Device("gpu", 140.4, 8), "tpu-v4": Device("tpu", 31.75, 4), "tpu-v5e": Device("tpu", 15.75, 4),
    "tpu-v5p": Device("tpu", 88.5, 4), "cpu": Device("cpu", 0.0),
}
