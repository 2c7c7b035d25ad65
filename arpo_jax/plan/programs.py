"""The programs a run compiles before its first step (`train/warmup.py`), from the config alone: each one's name,
shapes, runs per step and the itemised model's peak per device (`plan.analyse`'s `programs`, printed by
`arpo-jax plan`). The update side's shapes are `global_batch.GlobalBatch`'s (the micro-batch count for the worst
case, T heads and 8T loss entries a tree row); the JAX engine's are its own (`jax_sampler.abstract_programs`)."""

from __future__ import annotations

import math

from flax import nnx

from arpo_jax import models, sharding
from arpo_jax.experience import tree_packing
from arpo_jax.plan.memory_model import GB, Shapes

# The itemised model's program whose peak a JAX engine program has (`memory_model.sampler_items`).
_SAMPLER_PEAKS = {"prefill": "sampler_prefill", "decode": "sampler_decode"}


def run_programs(cfg, sh: Shapes, model_cfg: models.Config, mesh_shape, peaks: dict[str, float]) -> list[dict]:
    """[{name, shapes, runs (per step), peak_gib}] of every program `cfg`'s run compiles; `peaks`: bytes per device
    per itemised program (`itemise`)."""
    rows = batch_rows(sh, mesh_shape, model_cfg.sharding_rules)
    batch = batch_shapes(sh, rows)
    gib = lambda name: round(peaks[name] / GB, 2)
    if sh.command == "sft":
        return [_entry("sft_update", batch, "1 a step (M: the step's own)", gib("update"))]
    minis = max(1, cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)
    separate_ref = bool(cfg.actor.kl_coef) and (bool(model_cfg.lora_rank) or bool(cfg.model.ref_on_host))
    same_ref = bool(cfg.actor.kl_coef) and not separate_ref
    out = [_entry("policy_update", batch, f"{minis * cfg.actor.ppo_epochs}", gib("update")),
           _entry("logprob_forward", batch, f"{minis}" + (f" + {minis} (the reference's)" if same_ref else ""),
                  gib("logprob_forward"))]
    if separate_ref:
        out.append(_entry("reference_logprobs", batch, f"{minis}", gib("logprob_forward")))
    if sh.critic:
        flat_m = _flat_micro_batches(cfg, sh, rows)
        out.append(_entry("critic_values", f"[{minis}, {flat_m}, {rows}, {sh.seq}]", "1", gib("critic_update")))
        out.append(_entry("critic_update", batch, f"{minis * cfg.actor.ppo_epochs}", gib("critic_update")))
    if sh.engine == "jax":
        out += sampler_programs(cfg, model_cfg, mesh_shape, sh.processes, peaks)
    return out


def format_programs(progs: list[dict]) -> list[str]:
    """`run_programs`' list as `arpo-jax plan` prints it."""
    if not progs:
        return []
    width = max(len(p["name"]) for p in progs)
    return [f"programs compiled before the first step ({len(progs)}; shapes, runs a step, peak GiB per device):"] + \
        [f"  {p['name']:{width}s}  {p['shapes']}  x {p['runs']}  {p['peak_gib']:.2f}" for p in progs]


def _entry(name: str, shapes: str, runs: str, peak_gib: float) -> dict:
    return {"name": name, "shapes": shapes, "runs": runs, "peak_gib": peak_gib}


def batch_rows(sh: Shapes, mesh_shape, rules: str) -> int:
    """B: the global batch's rows per micro-batch."""
    mesh = dict(zip(sharding.MESH_AXES, mesh_shape))
    return max(1, round(sh.rows * math.prod(mesh[a] for a in sharding.get_rules(rules)["batch"])))


def batch_shapes(sh: Shapes, rows: int) -> str:
    """A mini-batch's shapes: [M, B, T] tokens, with tree training also [M, B, U] heads and [M, B, E] entries."""
    m = sh.fixed_micro_batches or sh.micro_batches
    out = f"[{m}, {rows}, {sh.seq}]"
    if sh.tree:
        out += (f" + heads [{m}, {rows}, {tree_packing.max_heads_per_row(sh.seq)}]"
                f" + entries [{m}, {rows}, {tree_packing.max_entries_per_row(sh.seq)}]")
    return out


def _flat_micro_batches(cfg, sh: Shapes, rows: int) -> int:
    """The flat layout's M (the critic's values forward is flat under tree training too)."""
    from arpo_jax.assemble.components import pack_config
    from arpo_jax.experience import global_batch

    workers = cfg.rollout.workers or sh.processes
    return global_batch.micro_batches(pack_config(cfg), workers, max(1, rows // workers), tree=False)


def sampler_programs(cfg, model_cfg: models.Config, mesh_shape, processes: int, peaks: dict[str, float]
                     ) -> list[dict]:
    """The JAX engine's programs (`jax_sampler.abstract_programs`: its fixed slots, prefill lengths, copy and decode)
    with their argument shapes; the peak of the itemised program of their kind (prefill, decode; the others, the
    cache's init and the row copy, hold the same weights and cache as the decode: its peak bounds theirs)."""
    from arpo_jax.assemble.components import engine_kwargs
    from arpo_jax.rollout.jax_sampler import abstract_programs

    # With LoRA the engine samples with the merged weights, on the base model's graph (`components.sampler_params`).
    graphdef, abstract = nnx.split(models.abstract_model(model_cfg.replace(lora_rank=0)))
    local = max(1, math.prod(mesh_shape) // processes)
    out = []
    kw, max_len = engine_kwargs(cfg, processes), cfg.data.max_prompt_length + cfg.data.max_response_length
    for name, (_, args) in abstract_programs(kw, max_len, graphdef, abstract, batch_multiple=local).items():
        kind = _SAMPLER_PEAKS.get(name.split("_")[0], "sampler_decode")
        out.append(_entry(f"sampler_{name}", _arg_shapes(args), "per call", round(peaks[kind] / GB, 2)))
    return out


def _arg_shapes(args) -> str:
    """The shapes of the single-array arguments (the weights, the decode state and the knobs left out)."""
    import jax

    arrays = [a for a in args if a is not None and len(jax.tree.leaves(a)) == 1 and hasattr(a, "shape")]
    return " ".join(f"[{', '.join(map(str, a.shape))}]" for a in arrays) or "-"
