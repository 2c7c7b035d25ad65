"""Bad inputs end in one short message naming what to fix, before any model is built (issue 22, item 6).

Every case runs through the real entry point (`cli.main`) or the validation it calls; none builds a model.
"""

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from arpo_jax import cli
from arpo_jax.assemble import validate as config
from arpo_jax.config import args
from arpo_jax.data import sft_data

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "configs" / "toy_cpu.py")


def _error(capsys, argv) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) <= 4, err
    return err


def test_config_file_with_a_syntax_error_or_a_raising_get_config(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n    pass\n")
    err = _error(capsys, ["train", f"--config={bad}", f"--workdir={tmp_path / 'w'}"])
    assert f"syntax error: {bad}:1" in err
    raising = tmp_path / "raising.py"
    raising.write_text("def get_config():\n    raise RuntimeError('no such preset')\n")
    err = _error(capsys, ["sft", f"--config={raising}", f"--workdir={tmp_path / 'w'}"])
    assert f"{raising} failed to load: RuntimeError: no such preset" in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("content, words", [
    (b"", "not a readable parquet file"),
    (b"this is not parquet at all" * 10, "not a readable parquet file"),
    ("truncated", "not a readable parquet file"),
    ("empty", "has no rows"),
    ("no_prompt", "has no column(s) ['prompt']"),
], ids=["empty-file", "garbage", "truncated", "no-rows", "missing-column"])
def test_bad_parquet_is_found_before_the_model(tmp_path, capsys, content, words):
    path = tmp_path / "train.parquet"
    rows = {"data_source": ["x"] * 3, "prompt": [[{"role": "user", "content": "q"}]] * 3,
            "reward_model": [{"ground_truth": "a"}] * 3}
    if content == "truncated":
        pq.write_table(pa.table(rows), path)
        path.write_bytes(path.read_bytes()[:-20])
    elif content == "empty":
        pq.write_table(pa.table(rows).slice(0, 0), path)
    elif content == "no_prompt":
        pq.write_table(pa.table({k: v for k, v in rows.items() if k != "prompt"}), path)
    else:
        path.write_bytes(content)
    err = _error(capsys, ["train", f"--config={TOY}", f"--workdir={tmp_path / 'w'}",
                          f"--config.data.train_files=('{path}',)"])
    assert "data.train_files:" in err and str(path) in err and words in err
    assert not (tmp_path / "w").exists()  # refused before the work directory (and any model) was made


def test_wandb_requested_but_not_installed(tmp_path, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    err = _error(capsys, ["train", f"--config={TOY}", f"--workdir={tmp_path / 'w'}",
                          "--config.trainer.loggers=('jsonl','wandb')"])
    assert "trainer.loggers: includes 'wandb' but wandb is not installed" in err


def test_an_api_key_put_in_api_key_env_is_not_echoed(tmp_path, capsys):
    secret = "sk-live-0123456789abcdef"
    err = _error(capsys, ["train", f"--config={TOY}", f"--workdir={tmp_path / 'w'}",
                          "--config.tools.search.backend=brightdata", f"--config.tools.search.api_key_env={secret}"])
    assert "tools.search.api_key_env:" in err and "never put the key" in err and secret not in err


def test_non_utf8_sft_file_is_named(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_bytes(json.dumps({"messages": [{"role": "user", "content": "é"}]}).encode("latin-1")
                     .replace(b"\\u00e9", "é".encode("latin-1")))
    with pytest.raises(ValueError, match=rf"{path} is not UTF-8 text"):
        list(sft_data.read_records(str(path)))


def test_eval_of_builtin_tiny_checks_its_positions_before_any_engine(tmp_path):
    """The default P + R (1536 + 4096) exceeds builtin:tiny's 2048 positions: said by validation, not by vLLM."""
    cfg = args.load_config(["--config=builtin:base", "--config.model.path=builtin:tiny"])
    with pytest.raises(config.ConfigError, match=r"data.max_response_length: P \+ R = 5632 exceeds the model's "
                                                 r"max_position_embeddings=2048"):
        config.validate(cfg, command="eval", check_files=True)
    config.validate(args.load_config([f"--config={TOY}"]), command="eval", check_files=True)  # 384 + 128 fits


WRITE_FAILS = """
import os, resource, signal, sys
from flax import nnx
import arpo_jax
from arpo_jax.weights import checkpoint, hf
model = arpo_jax.from_pretrained(sys.argv[1])
# Writes past 20 kB fail with EFBIG, as writes to a full disk fail with ENOSPC (same code path, no root needed).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
out = sys.argv[2]
try:
    with checkpoint.Checkpointer(out + "/c") as ckpt:
        ckpt.save(1, nnx.state(model, nnx.Param), config=model.config)
except OSError as e:
    print("SAVE:", e)
try:
    hf.save_pretrained(model, out + "/export")
except OSError as e:
    print("EXPORT:", e)
print("LEFT:", sorted(os.listdir(out)))
"""


def test_a_write_that_fails_while_saving_or_exporting_is_one_line(tiny_hf_dir, tmp_path):
    import subprocess
    import sys

    path, _ = tiny_hf_dir("llama31")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", WRITE_FAILS, str(path), str(out)], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO),
                                            "JAX_PLATFORMS": "cpu"})
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert lines["SAVE"].startswith(f"a checkpoint save in {out / 'c'} failed: ") and "File too large" in lines["SAVE"]
    assert lines["EXPORT"] == f"[Errno 27] File too large while writing the export {out / 'export'}"
    assert lines["LEFT"] == "['c']"  # no half-written export, no temporary folder
    assert "tensorstore_spec" not in proc.stderr  # orbax's own error logs are cut to one line each
