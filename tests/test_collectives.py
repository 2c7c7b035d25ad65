"""The communication `arpo-jax plan` reports: collectives read from the partitioned program, counted per loop
iteration, at the ring algorithms' bytes (hand-computed here); and the log-prob head's gradient, whose traffic
must not grow with the number of chunks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from arpo_jax import sharding
from arpo_jax.plan import collectives
from arpo_jax.update import logprobs


def test_replica_group_formats():
    assert collectives.replica_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert collectives.replica_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert collectives.replica_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Shardy's mesh form: devices 0..7 as a [2, 4] mesh; groups vary the named axis, the others fixed.
    assert collectives.replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert collectives.replica_groups("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # ... with the devices in another order: mesh position i holds device_ids[i] (an iota [2, 8] transposed).
    assert collectives.replica_groups("mesh['axis_0'=8,'axis_1'=2], device_ids=([2,8]T(1,0)) {'axis_0'}") == \
        [list(range(8)), list(range(8, 16))]
    assert collectives.replica_groups("something else") is None


def test_bytes_per_device_and_loop_iterations_by_hand():
    """A [8, 16] float32 array sharded 4 ways, gathered in each of a 3-step scan (512 bytes gathered, 3/4 of it
    received per device per step: 1152 bytes), then summed over its sharded axis once (an all-reduce of [16]
    float32: 2 x 3/4 x 64 = 96 bytes)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    split, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    def f(w):
        def body(c, _):
            c = jax.lax.with_sharding_constraint(jnp.sin(c), whole)  # gathered every iteration
            return jax.lax.with_sharding_constraint(c, split), None

        w = jax.lax.scan(body, w, None, length=3)[0]
        return jax.lax.with_sharding_constraint(w.sum(0), whole)

    w = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=split)
    # Twice, with the suite's persistent compilation cache on (conftest), as a repeated `arpo-jax plan` with
    # JAX_COMPILATION_CACHE_DIR set: the second compile must not come back from the cache without its dump.
    jax.jit(f).lower(w).compile()
    assert collectives.compile_partitioned(jax.jit(f).lower(w))[1]
    _, hlo = collectives.compile_partitioned(jax.jit(f).lower(w))
    items, exact = collectives.collectives(hlo, per_host=2)
    assert exact
    gathers = [c for c in items if c.kind == "all-gather"]
    assert [(c.buffer_bytes, c.group, c.runs) for c in gathers] == [(512, 4, 3)]
    s = collectives.summary(items)
    assert s["all-gather"] == pytest.approx(1152)
    assert s["all-reduce"] == pytest.approx(96)
    assert s["across_hosts"] == pytest.approx(s["total"])  # groups of 4 devices span two hosts of 2


def _head_gradient_traffic(chunk: int) -> dict:
    """Collective bytes of the log-prob head's gradient (hidden and unembedding) on 4 devices splitting B."""
    mesh = sharding.make_mesh((1, 4, 1), devices=jax.devices()[:4])
    b, t, d, v = 8, 64, 32, 256
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def loss(h, w, tg):
        logp, ent = logprobs.token_logprobs_and_entropy_from_hidden(h, w, tg, chunk_size=chunk, rules="fsdp")
        return logp.sum() + 0.1 * ent.sum()

    args = (jax.ShapeDtypeStruct((b, t, d), jnp.float32, sharding=rows),
            jax.ShapeDtypeStruct((d, v), jnp.float32, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows))
    with jax.set_mesh(mesh):
        _, hlo = collectives.compile_partitioned(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args))
    items, exact = collectives.collectives(hlo)
    assert exact
    return collectives.summary(items)


def test_head_gradient_traffic_does_not_grow_with_the_chunks():
    """The unembedding's gradient sums over the batch rows the mesh splits: one reduction of [V, D] per call, not one
    per chunk (GSPMD all-reduces a replicated loop carry every iteration: 8x the traffic at 8 chunks)."""
    one, eight = _head_gradient_traffic(64), _head_gradient_traffic(8)
    grad_bytes = 256 * 32 * 4
    assert one["total"] == pytest.approx(eight["total"], rel=0.05)
    assert one["total"] < 3 * grad_bytes  # one all-reduce of the float32 [V, D] gradient (1.5x its bytes) + scalars


def test_head_gradients_equal_unsharded():
    """The per-shard partials sum to the single-device gradient."""
    mesh = sharding.make_mesh((1, 4, 1), devices=jax.devices()[:4])
    keys = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(keys[0], (8, 24, 16))
    w = jax.random.normal(keys[1], (16, 64)) * 0.3
    tg = jax.random.randint(keys[2], (8, 24), 0, 64)

    def grads(rules):
        loss = lambda h, w: sum(x.sum() for x in logprobs.token_logprobs_and_entropy_from_hidden(
            h, w, tg, chunk_size=8, rules=rules))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(h, w)

    ref = grads(None)
    with jax.set_mesh(mesh):
        got = grads("fsdp")
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
