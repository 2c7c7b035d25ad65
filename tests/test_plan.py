"""`arpo-jax plan`: every shipped config fits the device it names; a config that does not is refused with its
largest items and a fix; the itemised state matches what XLA compiles; the default attention never builds the
whole [T, T] scores on an accelerator."""

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arpo_jax.assemble import validate as config
from arpo_jax.config import args
from arpo_jax.models.attention import blockwise_causal_attention
from arpo_jax.models.transformer import blockwise_blocks, resolve_attention
from arpo_jax.plan import memory_model, plan

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("*.py") if p.stem not in ("__init__", "base"))


def _analyse(name: str, *overrides: str) -> dict:
    cfg = args.load_config([f"--config=builtin:{name}", *overrides])
    shape = tuple(cfg.mesh.shape)
    return plan.analyse(cfg, devices=math.prod(shape) if -1 not in shape else 8)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_fits_its_device(name):
    """The itemised model at the config's full depth and sizes (no compile: it is arithmetic over the exact shard
    shapes; `test_itemised_state_is_what_xla_compiles` checks it against compiled programs)."""
    r = _analyse(name)
    assert r["headroom"] >= memory_model.HEADROOM, (name, r["peak_program"], r["peak_gib"], r["budget_gib"],
                                                    r["items_gib"])
    assert r["fits"]
    if r["engine"] == "vllm" and r["device"] != "cpu":  # the engine's share and JAX's planned share add up
        cfg = args.load_config([f"--config=builtin:{name}"])
        jax_fraction = plan.jax_mem_fraction(cfg)  # what the launch scripts set
        # The largest program with the headroom, as a share of the HBM rounded up to a hundredth (1e-4: peak_gib's
        # rounding to 0.01 GiB).
        need = r["peak_gib"] / (1 - memory_model.HEADROOM) / r["hbm_gib"]
        assert need - 1e-4 <= jax_fraction < need + 0.01 + 1e-4, (jax_fraction, need)
        reserve = r["reserve_gib"]["total"] / r["hbm_gib"]  # CUDA contexts and NCCL, per GPU type
        split = cfg.rollout.vllm.placement == "split"  # the engines' share is on other GPUs
        # ... and leave the margin for what the reserve does not itemise (review 2026-11-28 finding 5: the 14B split
        # had 0.23 GiB of an H100 left).
        total = jax_fraction + (0 if split else cfg.rollout.vllm.gpu_memory_utilization) + reserve
        assert total <= 1.0 - memory_model.MARGIN + 1e-9
        limit = r["engines"]["fraction_max"] if split else r["engine_fraction_max"]
        assert cfg.rollout.vllm.gpu_memory_utilization <= limit
        assert r["engines"]["fits"] and r["engines"]["trajectories"] >= 1  # the weights and a trajectory's cache


def test_the_14b_v4_config_without_its_token_budget_is_refused_for_its_sampler():
    """The engine has the rows the budget allows (16 of a worker's 192 trajectories); without the budget (a row per
    trajectory) its KV cache alone is 60 GiB a chip, and the plan finds the budget that fits."""
    fits = _analyse("arpo_qwen3_14b_tpu_v4_32")
    assert fits["sampler_batch"] == 16 and fits["programs_gib"]["sampler_prefill"]["kv_cache"] == 5.0
    r = _analyse("arpo_qwen3_14b_tpu_v4_32", "--config.rollout.jax.max_tokens_per_call=0")
    assert not r["fits"] and r["peak_program"].startswith("sampler") and r["sampler_batch"] == 192
    assert list(r["items_gib"])[0] == "kv_cache" and r["items_gib"]["kv_cache"] == 60.0
    assert r["fitting_settings"]["rollout.jax.max_tokens_per_call"] == 24 * 8192  # of 192, 96, 48, 24 rows
    assert any("kv_cache" in f and "rollout.jax.max_tokens_per_call" in f for f in r["fixes"])


def test_the_review_figures_of_the_7b_update():
    """Review B1's arithmetic for 7B FSDP-8: f32 params 3.55, AdamW 7.09, accumulator 3.55, one micro-batch's
    grads 3.55 GiB per device; remat 'full' keeps 28 x 11264 x 3584 bf16 = 2.1 GiB. The review's stacked layer
    copy (3.04) is gone: the layers are stored stacked (issue 31 item 3)."""
    items = _analyse("arpo_qwen25_7b_reasoning")["programs_gib"]["update"]
    expected = {"params": 3.55, "optimizer_state": 7.09, "grad_accumulator": 3.55, "micro_batch_grads": 3.55,
                "remat_activations": 2.1}
    for k, v in expected.items():
        assert items[k] == pytest.approx(v, abs=0.01), k
    assert "stacked_layers" not in items


def test_a_kl_reference_is_counted_where_it_lives():
    """A KL loss: the reference's params (sharded as the policy's) are resident on device throughout without
    `model.ref_on_host`; with it (the 7B config's setting) they are on device during the log-prob pass only."""
    offloaded = _analyse("arpo_qwen25_7b_reasoning", "--config.actor.kl_coef=0.1")["programs_gib"]
    assert offloaded["logprob_forward"]["ref_params"] == offloaded["update"]["params"] == 3.547
    assert "ref_params" not in offloaded["update"]
    resident = _analyse("arpo_qwen25_7b_reasoning", "--config.actor.kl_coef=0.1",
                        "--config.model.ref_on_host=false")["programs_gib"]
    assert resident["update"]["ref_params"] == resident["logprob_forward"]["ref_params"] == 3.547
    assert "ref_params" not in _analyse("arpo_qwen25_7b_reasoning")["programs_gib"]["logprob_forward"]


def test_gpu_memory_outside_both_budgets_is_itemised_per_gpu_type(monkeypatch):
    """Beside vLLM each GPU holds, outside JAX's pool and vLLM's share: JAX's and the engine's CUDA contexts and
    JAX's NCCL buffers (an engine with tensor parallelism: its own too), plus NVLS's multicast buffers when
    NCCL_NVLS_ENABLE is on (Hopper only), and the engine's weight-reload transient. Hand-computed from the GpuReserve
    table."""
    from arpo_jax import cli

    h100, a100 = memory_model.GPU_RESERVES["h100-80gb"], memory_model.GPU_RESERVES["a100-80gb"]
    off = plan.gpu_reserve_gib("h100-80gb", "vllm", nvls=False)
    assert off == {"jax_cuda_context": 0.75, "jax_nccl": 3.0, "engine_cuda_context": 0.75, "total": 4.5}
    assert off["total"] == 2 * h100.cuda_context + h100.nccl
    assert plan.gpu_reserve_gib("h100-80gb", "vllm", nvls=True)["total"] == 4.5 + h100.nvls
    assert plan.gpu_reserve_gib("h100-80gb", "vllm", engine_tp=2, nvls=False)["total"] == 4.5 + h100.nccl
    assert plan.gpu_reserve_gib("a100-80gb", "vllm", nvls=True)["total"] == 2 * a100.cuda_context + a100.nccl
    assert plan.gpu_reserve_gib("h100-80gb", "jax", nvls=False)["total"] == h100.cuda_context + h100.nccl
    assert plan.gpu_reserve_gib("tpu-v5p", "jax") == {}
    # JAX's budget beside a 0.5 engine: half the GPU less the reserve; NVLS on takes 3 GiB more from it.
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    cli.nccl_defaults()  # the CLI's default: NVLS off
    assert memory_model.nvls_on() is False
    assert plan.budget_gib("h100-80gb", "vllm", 0.5) == pytest.approx(0.5 * 79.6 - 4.5)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert plan.budget_gib("h100-80gb", "vllm", 0.5) == pytest.approx(0.5 * 79.6 - 7.5)
    r = _analyse("arpo_qwen25_7b_reasoning", "--config.mesh.device=h100-80gb")
    # vLLM's in-place reload rebuilds one module at a time on the GPU: Qwen2.5-7B's largest, the bf16 embedding.
    reload = 152064 * 3584 * 2 / 2**30
    assert r["reserve_gib"]["engine_reload"] == round(reload, 3) == 1.015
    assert r["reserve_gib"]["total"] == 7.5 + 1.015 and r["budget_gib"] == round(0.5 * 79.6 - 8.515, 2)
    assert r["engine_fraction_max"] <= 1 - 8.515 / 79.6 - r["jax_fraction"] - memory_model.MARGIN + 1e-9
    assert "outside JAX's and vLLM's shares, per GPU: jax_cuda_context 0.75 GiB" in plan.format_plan(r)


@pytest.mark.parametrize("name", ["arpo_qwen3_14b_deepsearch", "aepo_qwen3_14b"])
def test_the_14b_configs_on_80gb_gpus_split_and_colocated(name):
    """Beside a co-located engine the 14B update (49 GiB per GPU over 8) does not fit an 80 GB GPU and no engine
    share fits it (0.25 would leave JAX room but cannot hold the 27.5 GiB of weights); the 8 x 80 GB variant splits
    the node: 5 GPUs for JAX with their whole memory less its CUDA context and NCCL buffers (hand-computed budget),
    3 for one engine each. Its JAX plan is the co-located one's state over 5 instead of 8."""
    for device in ("a100-80gb", "h100-80gb"):
        colocated = _analyse(name, f"--config.mesh.device={device}")
        assert not colocated["fits"] and not colocated["jax_fits"] and colocated["peak_gib"] == 49.19
        assert "rollout.vllm.gpu_memory_utilization" not in colocated["fitting_settings"]
        assert any("rollout.vllm.placement=split" in f for f in colocated["fixes"])
        split = _analyse(f"{name}_8x80gb", f"--config.mesh.device={device}")
        assert split["fits"] and split["jax_fits"] and split["headroom"] >= memory_model.HEADROOM
        assert split["mesh"] == [1, 5, 1] and split["host_devices"] == 5 and split["seq"] == 8192
        hbm, reserve = memory_model.device_hbm_gib(device), memory_model.GPU_RESERVES[device]
        assert split["budget_gib"] == round(hbm - reserve.cuda_context - reserve.nccl, 2)
        assert "vllm_engine_gpu0" not in split["items_gib"] and "engine_fraction_max" not in split
        state = colocated["programs_gib"]["update"]["optimizer_state"] * 8 / 5
        assert split["programs_gib"]["update"]["optimizer_state"] == pytest.approx(state, abs=0.01)
        # One engine per engine GPU: 0.9 of it, the bf16 weights of 14.77B params, the rest KV cache at 160 KiB a
        # token (40 layers x 8 KV heads x 128 x K and V x 2 bytes); 8192-token trajectories.
        e = split["engines"]
        weights = split["params"] * 2 / 2**30
        assert e["placement"] == "split" and e["weights_gib"] == round(weights, 2) == 27.51
        assert e["kv_tokens"] == int((0.9 * hbm - weights) * 2**30 // (2 * 40 * 8 * 128 * 2))
        assert e["trajectories"] == e["kv_tokens"] // 8192 >= 30 and e["fits"]
        reload = 151936 * 5120 * 2 / 2**30  # the bf16 embedding (LM head) vLLM rebuilds when it reloads: 1.45 GiB
        assert e["reserve_gib"] == {"engine_cuda_context": reserve.cuda_context, "engine_reload": round(reload, 3),
                                    "total": round(reserve.cuda_context + reload, 3)}
        assert e["fraction_max"] == math.floor((1 - e["reserve_gib"]["total"] / hbm - memory_model.MARGIN) * 100) / 100


def test_jax_pool_leaves_a_margin_beside_the_itemised_reserve():
    """Review 2026-11-28 finding 5: the 14B split on H100s at 9216 tokens gave JAX 0.95 of each GPU, with 3.75 GiB
    itemised outside it: 1.00 of the GPU, 0.23 GiB for all that the reserve does not itemise. JAX's pool now stops
    2% of the GPU short of its budget: 0.93, the largest program still inside it; the config runs 8192 tokens."""
    r = _analyse("arpo_qwen3_14b_deepsearch_8x80gb", "--config.mesh.device=h100-80gb",
                 "--config.actor.max_token_len_per_device=9216")
    hbm, reserve = r["hbm_gib"], r["reserve_gib"]["total"]
    assert r["fits"] and r["peak_gib"] / (1 - memory_model.HEADROOM) / hbm > 0.94  # the pool the peak asked for
    assert r["jax_fraction"] == 0.93 and r["jax_fraction"] + reserve / hbm <= 1 - memory_model.MARGIN
    assert r["peak_gib"] <= r["jax_fraction"] * hbm
    # A small budget (beside an engine taking 0.8 of the GPU): the margin leaves the pool short of a peak that the
    # headroom alone would take.
    budget = plan.budget_gib("h100-80gb", "vllm", 0.8)
    squeezed = plan.evaluate({"update": {"x": 0.89 * budget * 2**30}}, "h100-80gb", "vllm", 0.8)
    assert squeezed["headroom"] >= memory_model.HEADROOM and not squeezed["fits"]


def test_an_engine_share_that_cannot_hold_the_weights_does_not_fit():
    """The engines' share is checked too: on H200s at 0.15 (21 GiB) the 14B weights do not fit, though JAX would."""
    r = _analyse("arpo_qwen3_14b_deepsearch", "--config.rollout.vllm.gpu_memory_utilization=0.15")
    assert r["jax_fits"] and not r["fits"] and not r["engines"]["fits"] and r["engines"]["trajectories"] == 0
    assert r["engines"]["share_gib"] == round(0.15 * 140.4, 2) < r["engines"]["weights_gib"]
    assert any("hold less than the weights" in f for f in r["fixes"]) and "DO NOT FIT" in plan.format_plan(r)


def test_plan_refuses_the_8b_config_with_four_times_the_micro_batch():
    cmd = [sys.executable, "-m", "arpo_jax.cli", "plan", "--config=builtin:arpo_qwen3_8b_deepsearch",
           "--config.actor.max_token_len_per_device=49152", "--compile-layers=0"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 3, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert not r["fits"] and r["device"] == "a100-80gb" and r["peak_gib"] > r["budget_gib"]
    assert set(r) >= {"fits", "device", "budget_gib", "peak_gib", "headroom", "items_gib"}
    biggest = list(r["items_gib"])[:3]
    fixes = [line for line in p.stdout.splitlines() if line.strip().startswith("fix:")]
    assert all(any(b in f for f in fixes) for b in biggest), (biggest, fixes)
    assert any("actor.max_token_len_per_device=" in f for f in fixes)  # a setting that fits, found by the plan
    assert "does not fit" not in p.stderr and "more than 90%" in p.stderr


def test_shipped_config_passes_the_cli():
    p = subprocess.run([sys.executable, "-m", "arpo_jax.cli", "plan", "--config=builtin:arpo_qwen25_7b_reasoning",
                        "--compile-layers=0"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # A GPU config in bfloat16: cuDNN's flash attention (resolve_attention), given the [T, T] mask.
    assert r["fits"] and r["headroom"] >= 0.1 and r["attention_by_program"]["update"]["kernel"] == "cudnn"
    assert "attention: update=cudnn ([T, T] (TreeMask.dense) mask)" in p.stdout


@pytest.mark.slow
def test_itemised_state_is_what_xla_compiles():
    """The 7B config's update and log-prob forward compiled with 2 layers on 8 fake devices (T = 1024 for time):
    XLA's argument bytes equal the model's params + optimizer state + batch (up to the scalar counters)."""
    cfg = args.load_config(["--config=builtin:arpo_qwen25_7b_reasoning", "--config.data.max_prompt_length=256",
                              "--config.data.max_response_length=256"])
    c = plan.compile_check(cfg, devices=8, layers=2)
    assert c["update"]["xla_arguments_gib"] == pytest.approx(c["update"]["model_state_gib"], rel=1e-3)
    assert c["logprob_forward"]["xla_arguments_gib"] >= c["logprob_forward"]["model_params_gib"]
    # Its communication per step (both programs at 1 and 2 layers, scaled to 28): FSDP over 8 devices receives
    # 7/8 of the bf16 decoder layers per whole gather and sends as much per gradient reduce-scatter; the LM head's
    # float32 [V, D] gradient is reduce-scattered once per micro-batch (not once per 256-token chunk: 4 here).
    comm, n = c["comm_per_step_gib"], c["comm_per_step_gib"]["micro_batches"]["update"]
    vocab, width = 152064, 3584
    layers_gib = (7_615_616_512 - 2 * vocab * width) * 2 / 2**30 * 7 / 8
    head_gib = vocab * width * 4 / 2**30 * 7 / 8
    assert comm["exact"] and n == comm["micro_batches"]["forward"] > 1
    assert comm["reduce-scatter"] / n == pytest.approx(layers_gib + head_gib, rel=0.02)  # per update micro-batch
    assert 2 * layers_gib < comm["all-gather"] / n < 4 * layers_gib  # forward once, update ~2x (+ the head)
    assert comm["all-reduce"] / n < 0.01  # scalars only (loss sums, the gradient norm)


def test_default_attention_per_backend_and_the_blockwise_kernel_with_bounded_blocks():
    assert resolve_attention(None, "gpu", "bfloat16") == resolve_attention(None, "gpu", "float16") == "cudnn"
    assert resolve_attention(None, "gpu", "float32") == "blockwise"  # cuDNN's fused kernels take no float32
    assert resolve_attention(None, "tpu", "bfloat16") == resolve_attention(None, "cpu", "bfloat16") == "blockwise"
    assert resolve_attention("xla", "gpu", "bfloat16") == "xla" and resolve_attention("cudnn", "cpu") == "cudnn"
    assert blockwise_blocks(24000, "tpu") == {"block_size": 512, "skip_blocks": True}  # 512 x 512 whatever T
    # The accelerator blocks compute the same attention (3 x 3 blocks of 512 here) as the full-scores reference.
    b, t, n, k, h = 1, 1100, 4, 2, 16
    q, kk, v = (jax.random.normal(jax.random.key(i), (b, t, m, h)) for i, m in enumerate((n, k, k)))
    seg = (jnp.arange(t) >= 700).astype(jnp.int32)[None]  # two packed segments
    mask = (jnp.tril(jnp.ones((t, t), bool)) & (seg[:, :, None] == seg[:, None, :]))[:, None]
    out = blockwise_causal_attention(q, kk, v, mask, scale=h ** -0.5, **blockwise_blocks(t, "gpu"))
    ref = jax.nn.dot_product_attention(q, kk, v, mask=mask, scale=h ** -0.5, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5)


@pytest.mark.slow
def test_sampler_programs_compile_with_the_itemised_weights_and_cache():
    """The v5p config's sampler prefill and decode (2 layers, a chunk of B = 128 rows over 4 fake devices, S = 1024
    for time): the decode's XLA arguments are the itemised sampler weights (bfloat16) + KV cache; the prefill's lack
    only the unused unembedding (XLA prunes it from the program; the array still exists)."""
    cfg = args.load_config(["--config=builtin:arpo_qwen25_7b_tpu_v5p8", "--config.data.max_prompt_length=512",
                              "--config.data.max_response_length=512", "--config.actor.max_token_len_per_device=0",
                              "--config.rollout.jax.max_tokens_per_call=131072"])
    c = plan.compile_check(cfg, devices=4, layers=2)
    decode, prefill = c["sampler_decode"], c["sampler_prefill"]
    assert decode["xla_arguments_gib"] == pytest.approx(decode["model_state_gib"], rel=2e-3)
    unembed = 152064 * 3584 * 2 / 4 / memory_model.GB  # Qwen2.5-7B's lm_head, bfloat16, over 4 devices
    assert prefill["xla_arguments_gib"] == pytest.approx(prefill["model_state_gib"] - unembed, rel=2e-3)


def test_mesh_device_is_validated_with_its_allowed_values():
    cfg = args.load_config(["--config=builtin:toy_cpu", "--config.mesh.device=v100"])
    with pytest.raises(config.ConfigError, match=r"mesh\.device.*tpu-v5p"):
        config.validate(cfg, check_files=False)


def test_critic_config_plans_the_critic_update():
    r = _analyse("arpo_qwen25_7b_reasoning", "--config.algorithm.adv_estimator=gae")
    upd, critic = r["programs_gib"]["update"], r["programs_gib"]["critic_update"]
    assert upd["critic_params_and_optimizer"] == pytest.approx(3 * upd["params"], rel=1e-3)
    assert critic["grad_accumulator"] == upd["grad_accumulator"] and r["peak_gib"] > 32.23


def test_plan_names_the_attention_kernel_per_program_and_accounts_tree_packing():
    """Which kernel each program runs and whether it skips blocks; with tree training, the tree rule replaces the
    [T, T] mask and the micro-batches shrink by the saving the config guarantees (its prompt shared n ways)."""
    blockwise = "--config.model.attention_impl=blockwise"  # the GPU default is cuDNN (given a [T, T] mask)
    flat = _analyse("arpo_qwen3_8b_deepsearch", "--config.actor.tree_training=false", blockwise)
    tree = _analyse("arpo_qwen3_8b_deepsearch", blockwise)  # tree training is the default
    assert flat["attention_by_program"]["update"] == {"kernel": "blockwise", "skip_blocks": True, "block": 512,
                                                      "mask": "[T, T]"}
    assert tree["attention_by_program"]["logprob_forward"]["mask"] == "tree rule"
    saving = 16 * (2000 + 10000) / (2000 + 16 * 10000)  # n (P + R) flat tokens, at most P + n R as a tree
    assert plan.tree_saving(2000, 10000, 16) == pytest.approx(saving)
    assert tree["tree_training"] == {"on": True, "saving_at_least": round(saving, 3),
                                     "micro_batches": math.ceil(flat["tree_training"]["micro_batches"] / saving)}
    t = flat["seq"]  # the tree rule reads one int per key instead of the [T, T] bool mask
    drop = flat["programs_gib"]["update"]["attention_workspace"] - tree["programs_gib"]["update"]["attention_workspace"]
    assert drop == pytest.approx((t * t - 4 * t) / memory_model.GB, abs=2e-3)
    sampler = _analyse("arpo_qwen25_7b_tpu_v5p8")["attention_by_program"]
    assert sampler["sampler_decode"] == {"kernel": "cached_attention", "skip_blocks": False}
    assert sampler["update"]["skip_blocks"]


def test_plan_lists_every_program_the_run_compiles():
    """`programs`: the update side's (the batch shapes the run fixes, the reference's forward apart only where it is
    another program) and the JAX engine's, each with its peak."""
    from arpo_jax.assemble.components import pack_config
    from arpo_jax.experience import global_batch

    toy = _analyse("toy_cpu")  # JAX engine, tree training, 8 fake devices: 8 rows a micro-batch
    names = [p["name"] for p in toy["programs"]]
    assert names[:2] == ["policy_update", "logprob_forward"] and any(n.startswith("sampler_decode") for n in names)
    assert any(n.startswith("sampler_prefill_") for n in names) and "reference_logprobs" not in names
    m = global_batch.micro_batches(pack_config(args.load_config(["--config=builtin:toy_cpu"])), 1, 8, tree=True)
    assert toy["micro_batches"] == m and toy["programs"][0]["shapes"].startswith(f"[{m}, 8, {toy['seq']}] + heads")
    assert toy["programs"][0]["peak_gib"] == toy["program_peaks_gib"]["update"]
    kl = ("--config.actor.kl_coef=0.01", "--config.model.ref_on_host=false")
    gae = _analyse("arpo_qwen25_7b_reasoning", *kl, "--config.algorithm.adv_estimator=gae")
    names = [p["name"] for p in gae["programs"]]
    assert names == ["policy_update", "logprob_forward", "critic_values", "critic_update"]  # vLLM: no sampler's
    assert "(the reference's)" in gae["programs"][1]["runs"]  # the same program on the reference's params
    for other in ("--config.model.lora.rank=8", "--config.model.ref_on_host=true"):  # the base's; host params
        assert "reference_logprobs" in [p["name"] for p in _analyse("arpo_qwen25_7b_reasoning", *kl, other)["programs"]]
