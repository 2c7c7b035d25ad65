"""`arpo-jax`: demo, train, sft, plan, doctor, data, convert, export, quickstart, eval, compare, chat.

Experiment commands take an ml_collections config file and overrides, config_flags style:

  arpo-jax train --config=builtin:toy_cpu --config.trainer.max_steps=2 --workdir=runs/toy
  arpo-jax sft   --config=builtin:sft_qwen25_7b --workdir=runs/sft
  arpo-jax plan  --config=builtin:arpo_qwen25_7b_reasoning
  arpo-jax data fetch                                  (every data file into $ARPO_DATA; `data check` checks)
  arpo-jax doctor --config=builtin:arpo_qwen25_7b_reasoning --workdir=/shared/runs/7b   (on the node, first)
  arpo-jax eval  --model runs/toy/checkpoints --benchmarks gsm8k,hotpotqa --k 4 --workdir runs/eval_toy \
                 --config=builtin:toy_cpu          (eval and chat: the config is optional, default builtin:base)
  arpo-jax compare runs/toy runs/eval_toy --out runs/compare

The last line printed is a JSON summary (machine-readable); errors in the config or the inputs end the command
with exit status 2 and a message naming what to fix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys


def _experiment(args) -> tuple:
    from arpo_jax.config import args as args_lib

    cfg = args_lib.load_config(args.config_args)
    return cfg, args.workdir


def _train(args) -> dict:
    cfg, workdir = _experiment(args)
    from arpo_jax.train import trainer

    return trainer.train(cfg, workdir)


def _sft(args) -> dict:
    cfg, workdir = _experiment(args)
    from arpo_jax.train import sft

    return sft.run_sft(cfg, workdir)


def _plan(args) -> dict:
    from arpo_jax.assemble import placement
    from arpo_jax.assemble import validate as config_lib
    from arpo_jax.config import args as args_lib

    cfg = args_lib.load_config(args.config_args)
    shape = tuple(cfg.mesh.shape)
    # -1: one host of 8 GPUs, less the engines' own under rollout.vllm.placement=split
    devices = args.devices or (math.prod(shape) if -1 not in shape else placement.trainer_gpus(cfg, 8))
    if not args.native:
        # Fake CPU devices, one per mesh position: nothing is allocated, only compiled. Must precede JAX's start.
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
        import jax

        jax.config.update("jax_platforms", "cpu")
    from arpo_jax.plan import memory_model, plan

    command = args.mode or ("sft" if plan.is_sft(cfg) else "train")
    cfg = config_lib.validate(cfg, device_count=None if args.native else devices, check_files=False, command=command)
    result = plan.plan_config(cfg, devices=devices, compile_layers=args.compile_layers, command=command)
    print(plan.format_plan(result))
    if not result["fits"]:
        # The table above names the largest items and the settings that fit; the JSON line stays the last one.
        if not result.get("jax_fits", False):
            print(f"arpo-jax plan: {result['peak_program']} needs {result['peak_gib']} GiB per device, more than "
                  f"{1 - memory_model.HEADROOM:.0%} of the {result['budget_gib']} GiB {result['device']} gives JAX",
                  file=sys.stderr)
        if not result.get("engines", {}).get("fits", True):
            e = result["engines"]
            print(f"arpo-jax plan: the vLLM engines' {e['share_gib']} GiB a GPU hold less than the weights "
                  f"({e['weights_gib']} GiB) and one trajectory's KV cache", file=sys.stderr)
        print(json.dumps(result, default=str))
        raise SystemExit(3)
    return result


def _doctor(args) -> dict:
    env = dict(os.environ)  # as the run will see it; this process keeps JAX off the GPUs (the plan is arithmetic)
    os.environ["JAX_PLATFORMS"] = "cpu"
    from arpo_jax.config import args as args_lib
    from arpo_jax.plan import doctor, plan

    cfg = args_lib.load_config(args.config_args) if args.config_args else None  # none: the node itself
    command = args.mode or ("sft" if cfg is not None and plan.is_sft(cfg) else "train")
    rows = doctor.run(cfg, args.workdir or ".", command=command, shm_path=args.shm, env=env)
    print(doctor.format_table(rows))
    result = {"failed": [f"{r.check}: {r.found}" for r in rows if r.status == doctor.FAIL],
              "warnings": [f"{r.check}: {r.found}" for r in rows if r.status == doctor.WARN]}
    if result["failed"]:
        print(json.dumps(result))
        raise SystemExit(1)
    return result


def _add_doctor_parser(sub) -> None:
    dr = _add_experiment(sub, "doctor", "check this node for what would make a run fail later: without arguments "
                         "the node itself (GPUs and driver or the CPU, /dev/shm, package pins, vLLM, the current "
                         "folder's file system, $ARPO_DATA's files); with a config also its memory plan, work dir, "
                         "paths and data files; exit 1 on a problem", _doctor, workdir=False)
    dr.add_argument("--workdir", default=None, help="the run directory to check (default: the current folder)")
    dr.add_argument("--mode", choices=("train", "sft"), default="", help="which run (default: as plan)")
    dr.add_argument("--shm", default="/dev/shm", help="the shared-memory folder to check (default /dev/shm)")


def _data(args) -> dict:
    from arpo_jax.data import fetch, manifest

    if args.action == "pack":
        return fetch.pack(args.dir, args.out, args.only)
    if args.action == "fetch":
        result = fetch.fetch(args.to, args.only, origin=args.origin, progress=not args.no_progress)
        for line in result["failed"]:
            print(f"arpo-jax data fetch: {line}", file=sys.stderr)
        folder = args.to
    else:
        result, folder = {}, args.dir
    statuses = manifest.check_dir(folder, args.only)
    print(manifest.format_status(statuses, folder))
    result["problems"] = [f"{s.entry.path}: {s.status}" for s in statuses if not s.ok]
    if result["problems"] or result.get("failed"):
        print(json.dumps(result))
        raise SystemExit(1)
    return result


def _add_data_parser(sub) -> None:
    dp = sub.add_parser("data", help="the data files the shipped configs and eval read, in $ARPO_DATA: fetch them "
                        "from their public sources (or a copy), check them, pack a copy for an offline cluster")
    actions = dp.add_subparsers(dest="action", required=True)
    only = {"nargs": "*", "default": [], "metavar": "NAME", "help": "only these groups (rl, sft, eval, search) or "
            "files (train_10k, gsm8k, ...; arpo_jax/data/manifest.json names them)"}
    fe = actions.add_parser("fetch", help="download what is missing or wrong into the layout the configs read "
                            "(resumable; a file appears only whole and checked; a second run downloads nothing)")
    fe.add_argument("--to", default=None, help="the data folder (default $ARPO_DATA)")
    fe.add_argument("--only", **only)
    fe.add_argument("--from", dest="origin", default=None, metavar="DIR_OR_TARBALL",
                    help="fill it from a copy made elsewhere (a folder laid out alike, or `data pack`'s tarball)")
    fe.add_argument("--no-progress", action="store_true", help="no progress bars")
    ck = actions.add_parser("check", help="each file present / missing / wrong checksum / wrong columns, with the "
                            "command that fixes it; exit 1 on a problem")
    ck.add_argument("dir", nargs="?", default=None, help="the data folder (default $ARPO_DATA)")
    ck.add_argument("--only", **only)
    pk = actions.add_parser("pack", help="a tarball of the (checked) files, for `data fetch --from` elsewhere")
    pk.add_argument("dir", nargs="?", default=None, help="the data folder (default $ARPO_DATA)")
    pk.add_argument("--out", required=True, help="the tarball to write (.tar, or .tar.gz to compress)")
    pk.add_argument("--only", **only)
    dp.set_defaults(func=_data)


def _convert(args) -> dict:
    from arpo_jax.weights import convert

    if args.direction == "gguf-to-hf":
        return convert.gguf_to_hf(args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    if args.direction == "hf-to-orbax":
        return convert.hf_to_orbax(args.hf, args.out, dtype=args.dtype, step=args.step or 0)
    return convert.orbax_to_hf(args.ckpt, args.out, step=args.step, tokenizer=args.tokenizer, dtype=args.dtype,
                               overwrite=args.overwrite)


def _export(args) -> dict:
    from arpo_jax.weights import convert

    return convert.export_lora(args.out, fmt=args.format, ckpt=args.ckpt, step=args.step, adapter=args.adapter,
                               base=args.base, dtype=args.dtype, overwrite=args.overwrite)


def _demo(args) -> dict:
    from arpo_jax import demo

    return demo.run_demo(args.workdir, quick=args.quick, algo=args.algo, seed=args.seed, model=args.model,
                         engine=args.engine, vllm=False if args.no_vllm else None, lora=args.lora,
                         overrides=args.set)


def _quickstart(args) -> dict:
    from arpo_jax import quickstart

    return quickstart.run(args.workdir, seed=args.seed, fit_steps=args.fit_steps)


def _eval(args) -> dict:
    from arpo_jax import distributed
    from arpo_jax.eval import agent, runner

    distributed.enable_compilation_cache()  # a second evaluation loads the JAX engine's programs
    cfg = agent.load_eval_config(args.config_args, no_tools=args.no_tools, adapter=args.adapter)
    opts = runner.EvalOptions(
        model=args.model, benchmarks=args.benchmarks, workdir=args.workdir, k=args.k, limit=args.limit,
        offset=args.offset, adapter=args.adapter, few_shot=args.few_shot,
        engine=args.engine, tokenizer=args.tokenizer, base_url=args.base_url, served_model=args.served_model,
        api_key_env=args.api_key_env, judge_url=args.judge_url, judge_model=args.judge_model,
        judge_api_key_env=args.judge_api_key_env, data_dir=args.data_dir, batch_size=args.batch_size,
        concurrency=args.concurrency, sample_timeout=args.sample_timeout, seed=args.seed,
        temperature=args.temperature, progress=not args.no_progress)
    return runner.evaluate(cfg, opts)


def _compare(args) -> dict:
    from arpo_jax.eval import report

    return report.compare(args.runs, args.out)


def _chat(args) -> dict:
    from arpo_jax import distributed
    from arpo_jax.eval import agent, chat

    distributed.enable_compilation_cache()
    cfg = agent.load_eval_config(args.config_args, no_tools=args.no_tools)
    return chat.chat(cfg, args.model, workdir=args.workdir, engine=args.engine, tokenizer=args.tokenizer,
                     base_url=args.base_url, served_model=args.served_model, api_key_env=args.api_key_env,
                     temperature=args.temperature, seed=args.seed)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model / engine flags `eval` and `chat` share."""
    p.add_argument("--model", required=True, help="HF folder, orbax checkpoint directory (newest step), "
                   "builtin:tiny, or with --engine openai a label of the served model")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's; for a checkpoint "
                   "its tokenizer/ folder or its training run's model; required for --engine openai)")
    p.add_argument("--engine", choices=["jax", "vllm", "openai"], default=None,
                   help="sampler (default: the config's rollout.engine)")
    p.add_argument("--base-url", default=None, help="openai engine: the completions server, e.g. "
                   "http://127.0.0.1:8000/v1")
    p.add_argument("--served-model", default=None, help="openai engine: the served model name")
    p.add_argument("--api-key-env", default=None, help="openai engine: environment variable holding the API key")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    p.add_argument("--no-tools", action="store_true", help="a baseline without tools: a system prompt that does not "
                   "mention them (data.system_prompt=no_tools) and tools.call_limit=0")


def _add_eval_commands(sub) -> None:
    ev = _add_experiment(sub, "eval", "evaluate a model on the benchmarks with tools: pass@k, optional LLM judge, "
                         "reports; resumable", _eval, workdir=False)
    _add_model_args(ev)
    ev.add_argument("--workdir", required=True, help="output folder (samples.jsonl per benchmark, report.json/md/"
                    "png); an interrupted evaluation there is resumed")
    ev.add_argument("--benchmarks", required=True, help="comma-separated names (aime24,gsm8k,...), all, or paths of "
                    "JSON-lines files of math questions (question/problem, answer, id)")
    ev.add_argument("--k", type=int, default=1, help="samples per question (pass@k)")
    ev.add_argument("--limit", type=int, default=None, help="only N questions of each benchmark (from --offset on)")
    ev.add_argument("--offset", type=int, default=0, help="leave out the first N questions of each benchmark")
    ev.add_argument("--adapter", default=None, help="a PEFT LoRA adapter folder on --model (an HF folder or a named "
                    "model): JAX runs it as LoRA layers, vLLM serves the merged weights")
    ev.add_argument("--few-shot", default=None, help="JSON list of {question, response} examples shown before each "
                    "question as earlier chat turns")
    ev.add_argument("--data-dir", default=None, help="folder of <benchmark>/test.jsonl (default $ARPO_EVAL_DATA "
                    "or ../shared/data/eval)")
    ev.add_argument("--batch-size", type=int, default=8, help="questions per chunk (one rollout call; the unit of "
                    "resume)")
    ev.add_argument("--concurrency", type=int, default=None, help="requests in flight (openai engine, judge) / tool "
                    "workers (jax, vllm)")
    ev.add_argument("--sample-timeout", type=float, default=None, help="seconds: per request (openai) or per chunk "
                    "(jax, vllm: checked before each generation round)")
    ev.add_argument("--temperature", type=float, default=None, help="overrides rollout.temperature; 0 = greedy")
    ev.add_argument("--judge-url", default=None, help="LLM judge: chat-completions server, e.g. "
                    "http://127.0.0.1:8001/v1 (correct = its verdict)")
    ev.add_argument("--judge-model", default=None, help="LLM judge: served model name")
    ev.add_argument("--judge-api-key-env", default=None, help="LLM judge: environment variable holding the API key")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")

    cmp = sub.add_parser("compare", help="put training and/or evaluation runs side by side (compare.md, .png)")
    cmp.add_argument("runs", nargs="+", help="run folders: training workdirs (metrics.jsonl) and/or evaluation "
                     "workdirs (report.json)")
    cmp.add_argument("--out", required=True, help="folder for compare.md and compare.png")
    cmp.set_defaults(func=_compare)

    ch = _add_experiment(sub, "chat", "ask a model questions from stdin (one per line) and print transcripts of "
                         "its tool use", _chat, workdir=False)
    _add_model_args(ch)
    ch.add_argument("--workdir", default=None, help="where builtin:tiny is built (default: a temporary folder)")
    ch.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")


def _add_experiment(sub, name: str, help: str, func, *, workdir: bool = True) -> argparse.ArgumentParser:
    from arpo_jax.config.args import builtin_configs

    p = sub.add_parser(name, help=help, description=f"{help}. Config arguments: --config=FILE[:ARG] or "
                       "--config=builtin:NAME, and --config.section.field=VALUE overrides (ml_collections "
                       "config_flags).")
    # Shown by --help; the config arguments themselves are split off before argparse (config.split_config_args).
    p.add_argument("--config", metavar="FILE|builtin:NAME", help="experiment config: a .py file with get_config(), "
                   f"or one shipped with the package: {', '.join(builtin_configs())}"
                   + ("" if name in ("train", "sft", "plan") else " (optional: without it, the node's checks)"
                      if name == "doctor" else " (optional: default builtin:base)"))
    if workdir:
        p.add_argument("--workdir", required=True, help="run directory: checkpoints, metrics.jsonl, tensorboard/; "
                       "an existing one is resumed (trainer.resume)")
    p.set_defaults(func=func)
    return p


def _add_export_parser(sub) -> None:
    ex = sub.add_parser("export", help="a LoRA model (a LoRA run's checkpoint, or a PEFT adapter on its base) as a "
                        "merged HF folder or a PEFT adapter folder")
    ex.add_argument("--format", choices=["merged", "peft"], default="merged",
                    help="merged: W + scale * B A, a plain HF model folder; peft: adapter_config.json + "
                    "adapter_model.safetensors for peft.PeftModel.from_pretrained")
    ex.add_argument("--ckpt", default=None, help="a LoRA run's checkpoint directory, e.g. RUN/checkpoints")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest intact one)")
    ex.add_argument("--adapter", default=None, help="instead of --ckpt: a PEFT adapter folder (with --base)")
    ex.add_argument("--base", default=None, help="the base model's HF folder (needed with --adapter; written into "
                    "the PEFT folder's base_model_name_or_path)")
    ex.add_argument("--out", required=True, help="folder to write (the rules of convert orbax-to-hf --out)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                    help="merged: weight dtype (default: the model's); PEFT adapters are always float32")
    ex.add_argument("--overwrite", action="store_true", help="replace an existing folder that is not a previous "
                    "export (never a training run)")
    ex.set_defaults(func=_export)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arpo-jax", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_experiment(sub, "train", "ARPO / AEPO reinforcement learning with tools", _train)
    _add_experiment(sub, "sft", "cold-start supervised fine-tuning on multi-turn tool conversations", _sft)
    plan = _add_experiment(sub, "plan", "per-device memory of every program of a config's run against the device "
                           "it names (mesh.device); exit 3 when one does not fit with 10%% headroom", _plan,
                           workdir=False)
    plan.add_argument("--devices", type=int, default=0, help="fake devices when mesh.shape has a -1 (default 8)")
    plan.add_argument("--mode", choices=("train", "sft"), default="",
                      help="which run to plan (default: sft for a config with sft files and no RL data, else train)")
    plan.add_argument("--compile-layers", type=int, default=2,
                      help="compile the update and log-prob forward with this many layers as a check of the "
                      "itemised model (0: no compile)")
    plan.add_argument("--native", action="store_true", help="compile for this host's real devices instead")
    _add_doctor_parser(sub)

    conv = sub.add_parser("convert", help="convert between HuggingFace folders, orbax checkpoints and GGUF files")
    conv_sub = conv.add_subparsers(dest="direction", required=True)
    h2o = conv_sub.add_parser("hf-to-orbax", help="HF folder -> orbax checkpoint (step 0 unless --step)")
    h2o.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    h2o.add_argument("--out", required=True, help="checkpoint directory to create")
    o2h = conv_sub.add_parser("orbax-to-hf", help="orbax checkpoint -> HF folder (latest step unless --step)")
    o2h.add_argument("--ckpt", required=True, help="checkpoint directory (holds step folders), e.g. RUN/checkpoints")
    o2h.add_argument("--out", required=True, help="HF folder to write; a previous export there is replaced "
                     "atomically, anything else is refused unless --overwrite")
    o2h.add_argument("--overwrite", action="store_true", help="replace an existing folder that is not a previous "
                     "export (never a training run)")
    o2h.add_argument("--tokenizer", default=None, help="folder with tokenizer files to include")
    for p in (h2o, o2h):
        p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="weight dtype (default: the source's)")
        p.add_argument("--step", type=int, default=None)
    g2h = conv_sub.add_parser("gguf-to-hf", help="GGUF file (llama.cpp; llama / qwen2 / qwen3, any quantization the "
                              "gguf package dequantizes) -> HF folder with config.json and tokenizer")
    g2h.add_argument("--gguf", required=True, help="the .gguf file")
    g2h.add_argument("--out", required=True, help="HF folder to write (the rules of orbax-to-hf --out)")
    g2h.add_argument("--overwrite", action="store_true", help="replace an existing folder that is not a previous "
                     "export (never a training run)")
    g2h.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                     help="weight dtype of the safetensors (default float32: dequantized values are exact in it)")
    conv.set_defaults(func=_convert)

    _add_export_parser(sub)
    _add_data_parser(sub)

    dm = sub.add_parser("demo", help="teach a small pretrained model to use tools on this machine and show it "
                        "learning: SFT -> validation -> ARPO -> validation -> export -> transcript, plots")
    dm.add_argument("--workdir", default="runs/demo")
    dm.add_argument("--quick", action="store_true", help="a smoke run of every phase (minutes; no learning shown)")
    dm.add_argument("--algo", choices=["arpo", "aepo", "grpo"], default="arpo",
                    help="arpo (branching at tool calls), aepo (+ entropy-balanced loss), grpo (same budget n, no "
                    "branching)")
    dm.add_argument("--seed", type=int, default=0)
    dm.add_argument("--model", default="smollm2-135m-instruct",
                    help="a named model (default smollm2-135m-instruct), an HF folder or a .gguf file")
    dm.add_argument("--engine", choices=["jax", "vllm"], default=None,
                    help="rollout engine (default: vllm when installed, else jax)")
    dm.add_argument("--no-vllm", action="store_true", help="skip the vLLM transcript even when vllm is installed")
    dm.add_argument("--lora", action="store_true", help="RL with LoRA adapters (rank 16, all projections, lr 1e-4) "
                    "over the frozen SFT model; results in <workdir>/<algo>_lora")
    dm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config field after the demo's own settings, for SFT and RL (repeatable; typed and "
                    "checked like --config.KEY=VALUE), e.g. --set rollout.max_staleness=1; a run to compare with "
                    "another wants its own --workdir")
    dm.set_defaults(func=_demo)

    qs = sub.add_parser("quickstart", help="tiny model end to end: build, convert, check parity, sample",
                        description="Builds a tiny Qwen2-architecture model and a BPE tokenizer offline, exports it as "
                        "an HF folder, converts it to an orbax checkpoint and back (bit-identical), checks that "
                        "transformers computes the same logits, and samples through the KV cache. About a minute on "
                        "2 CPU cores; nothing is downloaded.")
    qs.add_argument("--workdir", default="runs/quickstart")
    qs.add_argument("--seed", type=int, default=0)
    qs.add_argument("--fit-steps", type=int, default=300, help="optimizer steps fitting the corpus (default 300)")
    qs.set_defaults(func=_quickstart)
    _add_eval_commands(sub)
    return parser


_CONFIG_OPTIONAL = ("eval", "chat")  # take --config arguments; without them builtin:base's values


def parse_args(argv: list[str]) -> argparse.Namespace:
    """argparse for the command's own flags; the --config arguments are kept apart for ml_collections."""
    from arpo_jax.config.args import split_config_args

    try:
        config_args, rest = split_config_args(argv)
    except ValueError as e:  # e.g. --config=builtin:<unknown name>
        build_parser().error(str(e))
    args = build_parser().parse_args(rest)
    if config_args and args.command not in ("train", "sft", "plan", "doctor", *_CONFIG_OPTIONAL):
        build_parser().error(f"{args.command} takes no --config arguments")
    if args.command in ("train", "sft", "plan") and not config_args:
        build_parser().error(f"{args.command} needs --config=builtin:NAME or --config=FILE (see --help)")
    args.config_args = config_args
    return args


# Commands that run models: their processes start over with large allocations on huge pages (`hugepages`).
_MODEL_COMMANDS = ("demo", "train", "sft", "eval", "chat", "quickstart")


def nccl_defaults() -> None:
    """NCCL's NVLink SHARP (NVLS) off unless NCCL_NVLS_ENABLE is set: on Hopper NVSwitch nodes it binds large
    multicast buffers per communicator (`memory_model.GpuReserve.nvls`), allocated at the first collective, after a
    co-located vLLM took its share: an out-of-memory inside NCCL's set-up at the first step. JAX-Toolbox, NeMo's
    launcher and SGLang turn it off for the same reason; the plan counts it when it is on."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def main(argv: list[str] | None = None) -> int:
    nccl_defaults()  # before JAX (or a vLLM engine, which inherits the environment) creates a communicator
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if argv is None and args.command in _MODEL_COMMANDS:  # the process's own command line, not a caller's list
        from arpo_jax import hugepages

        hugepages.reexec_with_hugepages()
    from arpo_jax.train.run_guard import Stopped

    try:
        result = args.func(args)
    except Stopped as e:  # SIGTERM / SIGINT: the run saved and stopped cleanly
        print(e, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (e.g. while starting up): nothing to save
        print(f"arpo-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"arpo-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a full disk while saving or exporting: one line, not a traceback
        print(f"arpo-jax {args.command}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, default=str))  # the final line is machine-readable
    return 0


if __name__ == "__main__":
    sys.exit(main())
