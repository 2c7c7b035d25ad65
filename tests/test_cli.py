"""The `arpo-jax` entry point and the conversion CLIs, run as a user runs them."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from arpo_jax import cli, testing

REPO = Path(__file__).resolve().parents[1]


def _run(*args):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_convert_round_trip_through_the_cli_scripts(tiny_hf_dir, tmp_path):
    path = tmp_path / "hf_in"
    shutil.copytree(tiny_hf_dir("qwen3")[0], path)
    testing.make_tiny_tokenizer(path)  # tokenizer files next to the weights are carried along
    code, out, err = _run("conversion/hf_to_orbax.py", "--hf", str(path), "--out", str(tmp_path / "ckpt"))
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["tokenizer_files"] >= 2
    code, out, err = _run("-m", "arpo_jax.cli", "convert", "orbax-to-hf", "--ckpt", str(tmp_path / "ckpt"),
                          "--out", str(tmp_path / "hf"))
    assert code == 0, err
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    # Converting into an existing step is refused with a message that says what to do.
    code, _, err = _run("conversion/hf_to_orbax.py", "--hf", str(path), "--out", str(tmp_path / "ckpt"))
    assert code == 2 and "already holds a checkpoint for step 0" in err


def test_convert_bfloat16_export(tiny_hf_dir, tmp_path, capsys):
    path, _ = tiny_hf_dir("llama32_tied")
    assert cli.main(["convert", "hf-to-orbax", "--hf", str(path), "--out", str(tmp_path / "c")]) == 0
    assert cli.main(["convert", "orbax-to-hf", "--ckpt", str(tmp_path / "c"), "--out", str(tmp_path / "h"),
                     "--dtype", "bfloat16"]) == 0
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert str(load_file(str(tmp_path / "h" / "model.safetensors"))["model.norm.weight"].dtype) == "bfloat16"


def test_missing_input_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["convert", "orbax-to-hf", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "no checkpoint found" in capsys.readouterr().err


@pytest.mark.slow  # a quickstart run (~35 s)
def test_quickstart_runs_end_to_end(tmp_path, capsys):
    # 60 steps, not the command's 300: the loss is already 0.85 of 5.72 (at 100: 0.72; the fit is most of the time)
    assert cli.main(["quickstart", "--workdir", str(tmp_path / "qs"), "--fit-steps=60"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["round_trip_bit_identical"] is True
    assert summary["transformers_max_abs_diff"] < 1e-4
    assert summary["loss_last"] < summary["loss_first"] / 3  # the tiny model did fit its corpus
    assert (tmp_path / "qs" / "export" / "tokenizer.json").is_file()


def test_convert_never_destroys_what_is_not_an_export(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    """`--out RUN` (a slip for RUN/hf) used to delete the whole run; `--out FILE`, `--out .` and unrelated folders
    were replaced or crashed. Now: refused with a message, the run untouched; only previous exports are replaced."""
    path, _ = tiny_hf_dir("llama31")
    run = tmp_path / "run"
    assert cli.main(["convert", "hf-to-orbax", "--hf", str(path), "--out", str(run / "checkpoints")]) == 0
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    convert = ["convert", "orbax-to-hf", "--ckpt", str(run / "checkpoints"), "--out"]
    capsys.readouterr()

    for out, extra in ((run, []), (run, ["--overwrite"]), (run / "checkpoints", ["--overwrite"])):
        assert cli.main([*convert, str(out), *extra]) == 2
        assert "holds a training run or checkpoint" in capsys.readouterr().err
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before

    # A folder holding a run deeper inside is not replaced either, even with --overwrite.
    (tmp_path / "runs").mkdir()
    shutil.copytree(run, tmp_path / "runs" / "r1")
    assert cli.main([*convert, str(tmp_path / "runs"), "--overwrite"]) == 2
    assert "holds a training run or checkpoint (r1/" in capsys.readouterr().err
    assert (tmp_path / "runs" / "r1" / "metrics.jsonl").is_file()

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert cli.main([*convert, str(notes), "--overwrite"]) == 2
    assert "is not a folder" in capsys.readouterr().err and notes.read_text() == "mine"

    monkeypatch.chdir(tmp_path / "runs")
    assert cli.main([*convert, "."]) == 2
    assert "current directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob(".*")) == []  # no .old-* / .tmp-* folder left behind

    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert cli.main([*convert, str(other)]) == 2
    assert "not an arpo-jax export" in capsys.readouterr().err and (other / "keep.txt").is_file()
    assert cli.main([*convert, str(other), "--overwrite"]) == 0  # asked for: replaced
    assert not (other / "keep.txt").exists() and (other / "model.safetensors").is_file()

    # A previous export is replaced without --overwrite; exports have normal permissions (not mkdtemp's 0700).
    old_umask = os.umask(0o022)
    try:
        assert cli.main([*convert, str(tmp_path / "hf")]) == 0
        assert cli.main([*convert, str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old_umask)
    assert (tmp_path / "hf" / ".arpo_jax_export").is_file()
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755


def test_convert_from_a_missing_checkpoint_creates_nothing(tmp_path, capsys):
    assert cli.main(["convert", "orbax-to-hf", "--ckpt", str(tmp_path / "nonexistent"), "--out",
                     str(tmp_path / "o")]) == 2
    assert "nonexistent" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_help_shows_the_config_argument_and_builtin_names():
    code, out, _ = _run("-m", "arpo_jax.cli", "train", "--help")
    assert code == 0 and "--config FILE|builtin:NAME" in out and "toy_cpu" in out and "arpo_qwen25_7b_reasoning" in out
    code, out, _ = _run("-m", "arpo_jax.cli", "quickstart", "--help")
    assert code == 0 and "nothing is downloaded" in out
    code, _, err = _run("-m", "arpo_jax.cli", "train", "--config=builtin:nope", "--workdir=/tmp/never")
    assert code == 2 and "no built-in config 'nope'; allowed: builtin:aepo_qwen25_7b" in err
    assert not Path("/tmp/never").exists()


@pytest.mark.slow  # a subprocess that plans a config (imports jax)
def test_a_source_copy_runs_without_any_install(tmp_path):
    """A cluster user's `PYTHONPATH=<checkout> python -m arpo_jax.cli ...` with no `pip install`: a copy of the
    tree, run by an interpreter that never processes site-packages' .pth files (-S: no editable install's finder,
    which is what maps configs/ to `arpo_jax.configs`), the dependencies on PYTHONPATH. A builtin config loads
    (`builtin:NAME` from the copy's own configs/, and its `from arpo_jax.config.schema import ...`) and is planned."""
    import site

    copy = tmp_path / "checkout"
    for part in ("arpo_jax", "configs"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy)
    prelude = ("import runpy, sys; import arpo_jax; from arpo_jax.config import experiments as c; "
               "assert arpo_jax.__file__.startswith(sys.argv[1]) and str(c.folder()).startswith(sys.argv[1]); "
               "assert not any('editable' in repr(f) for f in sys.meta_path), sys.meta_path; "
               "sys.argv = ['arpo-jax', *sys.argv[2:]]; runpy.run_module('arpo_jax.cli', run_name='__main__')")
    env = testing.subprocess_env(1, PYTHONPATH=os.pathsep.join([str(copy), *site.getsitepackages()]))
    proc = subprocess.run([sys.executable, "-S", "-c", prelude, str(copy), "plan", "--config=builtin:toy_cpu",
                           "--compile-layers=0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["fits"]


@pytest.mark.slow  # a pip install and a training run
def test_non_editable_install_trains_from_an_empty_directory(tmp_path):
    """`pip install .` (not editable) ships the configs: `arpo-jax train --config=builtin:toy_cpu` runs one step from
    an empty directory with nothing of the checkout in reach."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--target", str(site), str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (site / "arpo_jax" / "configs" / "toy_cpu.py").is_file()  # the top-level configs/, mapped
    assert not (site / "configs").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    env = testing.subprocess_env(1, PYTHONPATH=str(site))
    code = ("import sys, arpo_jax; from arpo_jax import cli; assert arpo_jax.__file__.startswith(sys.argv[1]), "
            "arpo_jax.__file__; sys.exit(cli.main(sys.argv[2:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(site), "train", "--config=builtin:toy_cpu",
                           "--workdir=run", "--config.trainer.max_steps=1", "--config.trainer.progress=false",
                           "--config.data.train_batch_size=2", "--config.rollout.n=2",
                           "--config.rollout.initial_rollouts=1", "--config.rollout.beam_size=1",
                           "--config.data.max_response_length=32", "--config.actor.ppo_mini_batch_size=2"],
                          cwd=empty, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1
    assert (empty / "run" / "metrics.jsonl").is_file()
