"""Every experiment file loads and validates; bad configs fail with every problem named; redaction; tokenizer check."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ml_collections import ConfigDict

from arpo_jax import testing
from arpo_jax.assemble import validate as config
from arpo_jax.config import args, redaction
from arpo_jax.plan import plan

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.py") if p.name not in ("__init__.py", "base.py"))
TOY = str(REPO / "configs" / "toy_cpu.py")


def _devices(cfg) -> int | None:
    """The device count a fixed mesh asks for; None when -1 lets it fit anything."""
    shape = tuple(cfg.mesh.shape)
    return None if -1 in shape else math.prod(shape)


def _command(path: Path) -> str:
    return "sft" if path.name.startswith("sft_") else "train"


def _toy(**overrides) -> ConfigDict:
    """The toy config as a plain ConfigDict with `section.field=value` overrides (no type safety: any value)."""
    tree = args.load_config([f"--config={TOY}"]).to_dict()
    for path, value in overrides.items():
        *parents, leaf = path.split("__")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    return ConfigDict(tree, type_safe=False)


def _problems(cfg, **kw) -> list[str]:
    with pytest.raises(config.ConfigError) as err:
        config.validate(cfg, check_files=kw.pop("check_files", False), **kw)
    return err.value.problems


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_loads_and_validates(path):
    cfg = args.load_config([f"--config={path}"])
    out = config.validate(cfg, check_files=False, device_count=_devices(cfg), command=_command(path))
    assert out.is_locked and out.rollout.n >= out.rollout.initial_rollouts


def test_base_loads_but_needs_a_model_and_data():
    cfg = args.load_config(["--config=builtin:base"])
    fields = {p.split(":")[0] for p in _problems(cfg)}
    assert fields == {"model.path", "model.tokenizer", "data.train_files", "data.val_files"}


def test_reference_values_of_the_scripts():
    """Spec 11.3: batch, mini, P, R, n, m, epochs, gpu_mem, call_limit and the AEPO switches."""
    # gpu_mem is not the scripts' (0.7 for 7B, 0.6 for 8B / 14B): vLLM gets what JAX's planned peak leaves
    # (`arpo-jax plan`, tests/test_plan.py).
    expect = {  # batch mini P R n m epochs gpu_mem call_limit
        "arpo_qwen25_7b_reasoning": (128, 16, 1536, 4096, 16, 8, 2, 0.5, 3),
        "arpo_qwen3_8b_deepsearch": (128, 16, 2000, 10000, 16, 8, 5, 0.45, 6),
        "arpo_qwen3_14b_deepsearch": (64, 8, 2000, 6192, 12, 6, 5, 0.45, 6),
        "aepo_qwen25_7b": (128, 16, 1536, 4096, 16, 8, 2, 0.5, 6),
        "aepo_qwen3_14b": (64, 8, 2000, 6192, 12, 6, 5, 0.45, 6),
        # 8 x 80 GB: the same runs, the engines on 3 GPUs of their own (0.9 of each: rollout.vllm.placement=split)
        "arpo_qwen3_14b_deepsearch_8x80gb": (64, 8, 2000, 6192, 12, 6, 5, 0.9, 6),
        "aepo_qwen3_14b_8x80gb": (64, 8, 2000, 6192, 12, 6, 5, 0.9, 6),
    }
    for name, values in expect.items():
        c = args.load_config([f"--config={REPO / 'configs' / name}.py"])
        got = (c.data.train_batch_size, c.actor.ppo_mini_batch_size, c.data.max_prompt_length,
               c.data.max_response_length, c.rollout.n, c.rollout.initial_rollouts, c.trainer.total_epochs,
               c.rollout.vllm.gpu_memory_utilization, c.tools.call_limit)
        assert got == values, name
        assert (c.rollout.beam_size, c.rollout.branch_probability, c.rollout.entropy_weight) == (2, 0.5, 0.2)
        aepo = name.startswith("aepo")
        assert (c.actor.loss == "aepo", c.actor.entropy_adv, c.rollout.rule == "aepo") == (aepo,) * 3
        assert c.rollout.enable_dynamic_rollouts is False


def test_overrides_and_extra_arguments():
    cfg = args.load_config([f"--config={TOY}", "--config.rollout.n=16", "--config.trainer.max_steps", "2",
                              "--config.data.train_files=a.parquet", "--config.actor.lr=1"])
    assert (cfg.rollout.n, cfg.trainer.max_steps, cfg.data.train_files) == (16, 2, ("a.parquet",))
    assert isinstance(cfg.actor.lr, float)
    cfg, rest = args.parse_config_args(["--config", TOY, "--workdir=runs/x", "--config.rollout.n=8", "pos"])
    assert cfg.rollout.n == 8 and rest == ["--workdir=runs/x", "pos"]
    with pytest.raises(ValueError, match="unrecognised arguments.*--workdir"):
        args.load_config([f"--config={TOY}", "--workdir=x"])


@pytest.mark.parametrize("argv, match", [
    (["--config.rollout.nn=3"], r"rollout\.nn: unknown config field 'nn' \(allowed: .*initial_rollouts"),
    (["--config.rolout.n=3"], r"rolout\.n: unknown config field"),
    (["--config.rollout.n=abc"], r"config\.rollout\.n=abc.*invalid literal for int"),
], ids=["unknown-field", "unknown-section", "wrong-type"])
def test_bad_overrides_are_readable(argv, match):
    with pytest.raises(ValueError, match=match):
        args.load_config([f"--config={TOY}", *argv])


def test_missing_config_file():
    with pytest.raises(ValueError, match="cannot load the config file.*nope.py.*No such file"):
        args.load_config(["--config=configs/nope.py"])
    with pytest.raises(ValueError, match="no config file"):
        args.load_config(["--config.rollout.n=3"])


BAD = [  # (overrides, problem's field, words the message must contain, validate kwargs)
    (dict(rollout__n=2, rollout__initial_rollouts=4), "rollout.n", ">= initial_rollouts", {}),
    (dict(rollout__beam_size=0), "rollout.beam_size", ">= 1", {}),
    (dict(rollout__engine="foo"), "rollout.engine", "jax | vllm", {}),
    (dict(mesh__shape=(1, 4, 1)), "mesh.shape", "product of 8", {"device_count": 8}),
    (dict(mesh__shape=(-1, -1, 1)), "mesh.shape", "at most one -1", {}),
    (dict(actor__lr=-1e-6), "actor.lr", "> 0", {}),
    (dict(rollout__n="16"), "rollout.n", "expected int", {}),
    (dict(data__train_files=("/nonexistent/train.parquet",)), "data.train_files", "does not exist",
     {"check_files": True}),
    (dict(data__train_batch_size=5), "data.train_batch_size", "multiple of 2", {}),
    (dict(tools__search__backend="bing"), "tools.search.backend", "brightdata | cache | local", {}),
    (dict(actor__clip_low=1.5), "actor.clip_low", "0 <= clip < 1", {}),
    (dict(rollout__branch_probability=2.0), "rollout.branch_probability", "0 <= x <= 1", {}),
    (dict(tools__call_limit=-1), "tools.call_limit", ">= 0", {}),
    (dict(tools__python__ready_sandboxes=-1), "tools.python.ready_sandboxes", "an int >= 0", {}),
    (dict(actor__kl_kind="k9"), "actor.kl_kind", "low_var_kl", {}),
    (dict(model__remat="some"), "model.remat", "dots_no_batch", {}),
    (dict(mesh__rules="tp"), "mesh.rules", "fsdp | fsdp_tp", {}),
    (dict(trainer__loggers=("console", "mlflow")), "trainer.loggers", "wandb", {}),
    (dict(data__train_batch_size=6, actor__ppo_mini_batch_size=3), "data.train_batch_size", "multiple of 4",
     {"process_count": 4}),
    (dict(rollout__workers=4), "actor.ppo_mini_batch_size", "multiple of 4", {}),
    (dict(actor__ppo_mini_batch_size=1, data__train_batch_size=2), "actor.ppo_mini_batch_size", "multiple of 2",
     {"process_count": 2}),
    (dict(tools__search__backend="cache", tools__search__cache_file=""), "tools.search.cache_file", "reference JSON",
     {}),
    (dict(model__path="/nonexistent/model"), "model.path", "no config.json", {"check_files": True}),
    (dict(model__path="${ARPO_TEST_SURELY_UNSET}/m"), "model.path", "ARPO_TEST_SURELY_UNSET", {"check_files": True}),
    (dict(rollout__temperature=0.0), "rollout.temperature", "> 0", {}),
    (dict(mesh__shape=(1, 2, 2)), "mesh.rules", "fsdp_tp", {}),
    (dict(tools__timeout_s=5.0), "tools.timeout_s", ">= 10.0", {}),
    (dict(actor__max_token_len_per_device=100), "actor.max_token_len_per_device", "cannot hold one full", {}),
    (dict(rollout__nonsense=1), "rollout.nonsense", "unknown field", {}),
    (dict(trainer__test_freq=5, data__val_files=()), "data.val_files", "test_freq=0", {}),
    (dict(rollout__val_kwargs__n=4), "rollout.val_kwargs.n", "do_sample=True", {}),
    (dict(rollout__val_kwargs__do_sample=True, rollout__val_kwargs__temperature=0.0), "rollout.val_kwargs.temperature",
     "> 0", {}),
    (dict(actor__rollout_correction__mode="tis"), "actor.rollout_correction.mode", "auto | off | truncate | mask", {}),
    (dict(actor__rollout_correction__level="seq"), "actor.rollout_correction.level", "token | sequence", {}),
    (dict(actor__rollout_correction__threshold=1.0), "actor.rollout_correction.threshold", "> 1", {}),
    (dict(actor__rollout_correction__mode="mask", rollout__engine="vllm", rollout__temperature=0.7),
     "actor.rollout_correction.mode", "needs rollout.temperature=1", {}),
    (dict(rollout__vllm__engines=-1), "rollout.vllm.engines", "0 (one per tensor-parallel group", {}),
    (dict(rollout__vllm__tensor_parallel_size=0), "rollout.vllm.tensor_parallel_size", ">= 1", {}),
    (dict(rollout__vllm__placement="apart"), "rollout.vllm.placement", "colocated | split", {}),
    (dict(rollout__vllm__engine_gpus=2), "rollout.vllm.engine_gpus", "0, or rollout.vllm.placement=split", {}),
    (dict(rollout__engine="jax", rollout__vllm__placement="split", rollout__vllm__engine_gpus=2),
     "rollout.vllm.placement", "colocated, or rollout.engine=vllm", {}),
    (dict(rollout__engine="vllm", rollout__vllm__placement="split"), "rollout.vllm.engine_gpus", ">= 1", {}),
    (dict(rollout__engine="vllm", rollout__vllm__placement="split", rollout__vllm__engine_gpus=8,
          mesh__device="h100-80gb"), "rollout.vllm.engine_gpus", "1 to 7 of a h100-80gb host's 8 GPUs", {}),
    (dict(rollout__engine="vllm", rollout__vllm__placement="split", rollout__vllm__engine_gpus=3,
          rollout__vllm__tensor_parallel_size=2), "rollout.vllm.engine_gpus",
     "a multiple of rollout.vllm.tensor_parallel_size=2", {}),
    (dict(rollout__engine="vllm", rollout__vllm__placement="split", rollout__vllm__engine_gpus=2,
          rollout__vllm__engines=3), "rollout.vllm.engines", "0 (one per 1 of them) or at most 2", {}),
    (dict(rollout__jax__max_tokens_per_call=100), "rollout.jax.max_tokens_per_call", "0 (no limit) or >= ", {}),
    (dict(rollout__max_staleness=-1), "rollout.max_staleness", "0 (synchronous) | 1 (one step off-policy)", {}),
    (dict(rollout__max_staleness=1, algorithm__dynamic_sampling=True), "rollout.max_staleness",
     "algorithm.dynamic_sampling=false", {"process_count": 2}),
    (dict(actor__adam_beta2=1.0), "actor.adam_beta2", "0 <= beta2 < 1", {}),  # a knob's rule (train_step)
    (dict(actor__recompute_old_logprob=False), "actor.recompute_old_logprob", "one optimizer step a training step",
     {}),  # the toy config's 2 mini-batches of 2 prompts a step
    (dict(actor__recompute_old_logprob=False, actor__ppo_mini_batch_size=4), "actor.recompute_old_logprob",
     "here 1, 4 of 4, auto", {}),
]


@pytest.mark.parametrize("overrides, field, words, kw", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_invalid_configs_name_the_field_and_the_allowed_values(overrides, field, words, kw):
    problems = _problems(_toy(**overrides), **kw)
    assert any(p.startswith(field + ":") and words in p for p in problems), problems


def test_on_policy_runs_may_reuse_the_updates_logprobs():
    config.validate(_toy(actor__recompute_old_logprob=False, actor__ppo_mini_batch_size=4,
                         actor__rollout_correction__mode="off"), check_files=False)


def test_every_problem_is_reported_at_once():
    cfg = _toy(rollout__engine="foo", actor__lr=0.0, rollout__beam_size=0, mesh__shape=(-1, -1, 1),
               rollout__n="x", tools__search__backend="nope")
    fields = [p.split(":")[0] for p in _problems(cfg)]
    assert {"rollout.engine", "actor.lr", "rollout.beam_size", "mesh.shape", "rollout.n",
            "tools.search.backend"} <= set(fields)
    assert all("(allowed:" in p for p in _problems(cfg))


def test_validate_normalises_and_expands(monkeypatch, tmp_path):
    monkeypatch.setenv("ARPO_DATA", str(tmp_path))
    import pyarrow as pa
    import pyarrow.parquet as pq

    # A readable file with the columns a row needs (validation reads the footer: an empty file is refused).
    pq.write_table(pa.table({"data_source": ["x"], "prompt": [[{"role": "user", "content": "q"}]]}),
                   tmp_path / "train.parquet")
    cfg = _toy(data__train_files=["${ARPO_DATA}/train.parquet"], actor__lr=1, data__val_files="builtin:toy")
    out = config.validate(cfg, check_files=True)
    assert out.data.train_files == (f"{tmp_path}/train.parquet",) and out.data.val_files == ("builtin:toy",)
    assert out.actor.lr == 1.0 and isinstance(out.actor.lr, float)
    # Without file checks an unset variable is left alone (configs validate on a machine without the data).
    monkeypatch.delenv("ARPO_DATA")
    assert config.validate(cfg, check_files=False).data.train_files == ("${ARPO_DATA}/train.parquet",)


def test_toy_config_validates_with_files_and_devices():
    cfg = args.load_config([f"--config={TOY}"])
    for command in ("train", "sft"):
        config.validate(cfg, check_files=True, device_count=8, process_count=2, command=command)
    assert plan.jax_mem_fraction(cfg) == 0.9  # the JAX engine
    vllm = args.load_config([f"--config={TOY}", "--config.rollout.engine=vllm",
                               "--config.rollout.vllm.gpu_memory_utilization=0.6"])
    assert plan.jax_mem_fraction(vllm) == 0.35


def test_brightdata_key_must_be_in_the_environment(monkeypatch):
    cfg = _toy(tools__search__backend="brightdata", tools__search__cache_file="")
    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    assert any("BRIGHTDATA_API_KEY is not set" in p for p in _problems(cfg, check_files=True))
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "k")
    config.validate(cfg, check_files=True)
    # The key itself pasted into the config is refused (and would be redacted from logs).
    assert any("never put the key" in p for p in _problems(_toy(tools__search__backend="brightdata",
                                                                tools__search__api_key_env="abc-123-secret")))


def test_redact_hides_keys_but_keeps_env_var_names():
    tree = args.load_config([f"--config={TOY}"]).to_dict()
    tree["tools"]["search"]["api_key"] = "0123456789abcdef"
    tree["extra"] = {"nested": {"hf_token": "hf_abcdefghijklmnopqrstuvwxyz", "db_password": "hunter2"},
                     "note": "sk-abcdefghijklmnopqrstuvwxyz012345"}
    out = redaction.redact(ConfigDict(tree, type_safe=False))
    assert out["tools"]["search"]["api_key"] == redaction.REDACTED
    assert out["extra"]["nested"] == {"hf_token": redaction.REDACTED, "db_password": redaction.REDACTED}
    assert out["extra"]["note"] == redaction.REDACTED  # looks like a key whatever its field is called
    assert out["tools"]["search"]["api_key_env"] == "BRIGHTDATA_API_KEY"
    assert out["model"]["tokenizer"] == "" and out["actor"]["max_token_len_per_device"] == 0
    assert out["model"]["path"] == "builtin:tiny" and isinstance(out["data"]["train_files"], tuple)
    tree["tools"]["search"]["api_key_env"] = "bd-0123456789abcdef0123"  # a key value in the name field
    assert redaction.redact(tree)["tools"]["search"]["api_key_env"] == redaction.REDACTED


def test_check_tokenizer():
    config.check_tokenizer(testing.make_tiny_tokenizer(), args.load_config([f"--config={TOY}"]))
    from tokenizers import Tokenizer, models, pre_tokenizers

    word_level = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(config.ConfigError) as err:
        config.check_tokenizer(word_level)
    assert all(p.startswith("model.tokenizer:") for p in err.value.problems)
    assert any("'<python>'" in p for p in err.value.problems)


def test_enum_values_come_from_the_code():
    """The allowed values are the consumers' own tables, so a new loss or preset is accepted without edits here."""
    from arpo_jax import sharding
    from arpo_jax.update import algos

    allowed = config._allowed()
    assert allowed["actor.loss"] == tuple(algos.POLICY_LOSSES) and allowed["mesh.rules"] == tuple(sharding.RULES)


@pytest.mark.slow  # > 10 s (compile-bound)
def test_configs_load_from_another_directory(tmp_path):
    """config_flags imports a file by path: `from arpo_jax.config.schema import ...` must work wherever the run starts,
    and `builtin:NAME` names the shipped file from any directory."""
    code = ("import sys; from arpo_jax.config import args; "
            "c = args.load_config(sys.argv[1:]); print(c.rollout.n, c.data.train_batch_size)")
    env = {**os.environ, "PYTHONPATH": ""}
    shipped = str(REPO / "configs" / "aepo_qwen3_14b.py")
    for spec, expect in ((shipped, "12 64"), ("builtin:toy_cpu", "16 4"), ("builtin:aepo_qwen3_14b", "12 64")):
        argv = [f"--config={spec}"] + (["--config.rollout.n=16"] if "toy_cpu" in spec else [])
        proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split("\n")[-2] == expect
    # A relative path from the repository's parent folder too.
    proc = subprocess.run([sys.executable, "-c", code, f"--config={REPO.name}/configs/toy_cpu.py"],
                          cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split("\n")[-2] == "4 4", proc.stderr


def test_the_experiment_files_are_the_checkouts_configs_folder_and_the_schema_is_in_the_package():
    """builtin:NAME reads configs/ at the top of this checkout (one copy; a wheel installs it as arpo_jax.configs),
    and the schema the files build on is arpo_jax/config/schema.py: no import hook, nothing in sys.modules."""
    import arpo_jax
    from arpo_jax.config import experiments, schema

    if not Path(arpo_jax.__file__).is_relative_to(REPO):
        pytest.skip("arpo_jax is not imported from this checkout")
    assert experiments.folder() == REPO / "configs"
    assert args.config_file("builtin:toy_cpu") == str(REPO / "configs" / "toy_cpu.py")
    assert Path(schema.__file__) == REPO / "arpo_jax" / "config" / "schema.py"
    assert not (REPO / "configs" / "base.py").exists() and not (REPO / "arpo_jax" / "configs").exists()
    assert "arpo_jax.configs" not in sys.modules
    assert experiments.experiment("aepo_qwen3_14b").get_config().trainer.experiment


def test_pyproject_lists_every_package_folder():
    """The package list is explicit (a mapped folder is outside packages.find): a new arpo_jax/ folder must be on it,
    or a wheel would leave it out."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "arpo_jax").rglob("__init__.py")}
    assert set(project["packages"]) == folders | {"arpo_jax.configs"}
    assert project["package-dir"] == {"arpo_jax.configs": "configs"}


@pytest.mark.parametrize("name, devices, processes", [
    ("arpo_qwen3_14b_tpu_v4_32", 16, 4),  # v4-32: 16 chips on 4 hosts
    ("arpo_qwen25_7b_tpu_v5p8", 4, 1),  # v5p-8: 4 chips, one host
    ("arpo_qwen25_7b_reasoning", 8, 1),
    ("arpo_qwen3_14b_deepsearch_8x80gb", 5, 1),  # 8 GPUs, 3 of them the vLLM engines' (split placement)
    ("aepo_qwen3_14b_8x80gb", 10, 2),  # two such nodes, --config.mesh.shape=(2,5,1)
])
def test_hardware_configs_fit_their_slices(name, devices, processes):
    shape = [f"--config.mesh.shape=({processes},5,1)"] if name.endswith("8x80gb") else []
    cfg = args.load_config([f"--config={REPO / 'configs' / name}.py", *shape])
    config.validate(cfg, check_files=False, device_count=devices, process_count=processes)
    assert cfg.rollout.engine == ("jax" if "tpu" in name else "vllm")


def test_launch_scripts_parse_and_size_jax_memory():
    for script in ("local.sh", "tpu_pod.sh", "slurm_gpu.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=True)
    run = [sys.executable, str(REPO / "launch" / "mem_fraction.py"), "--workdir=x"]
    vllm = subprocess.run([*run, "--config=builtin:arpo_qwen3_8b_deepsearch"], capture_output=True,
                          text=True, check=True)
    jax_engine = subprocess.run([*run, f"--config={TOY}"], capture_output=True, text=True, check=True)
    # Beside vLLM, JAX's planned peak (30.2 GiB per A100-80GB, `arpo-jax plan`) / 0.9, rounded up: with the engine's
    # 0.45 that leaves 0.13 for the CUDA contexts.
    assert (vllm.stdout.split()[-1], jax_engine.stdout.split()[-1]) == ("0.42", "0.9")
