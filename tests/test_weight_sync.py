"""The weight-sync export without an engine: its size per dtype, the room check and the default folder's choice.
(The engines' side: tests/test_vllm_sampler.py; the multi-host hand-off: tests/test_multihost.py.)"""

import logging
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from flax import nnx
from safetensors.numpy import load_file

import arpo_jax
from arpo_jax.rollout import export_folders, vllm_sampler
from arpo_jax.weights import hf


def test_export_nbytes_is_what_save_state_writes(tiny_hf_dir, tmp_path):
    path, torch_model = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    state = nnx.state(model, nnx.Param)
    n_params = sum(p.numel() for p in torch_model.parameters())
    assert hf.export_nbytes(state, "float32") == 4 * n_params
    assert hf.export_nbytes(state, "bfloat16") == 2 * n_params
    hf.save_state(state, model.config, tmp_path / "bf16", dtype="bfloat16")
    tensors = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert sum(t.nbytes for t in tensors.values()) == hf.export_nbytes(state, "bfloat16")


def test_export_room_error_names_the_sizes(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    export_folders.check_export_room(tmp_path / "not-yet", 1024, "bfloat16")  # fits; a missing folder is fine
    need = free + 3 * 1024**3
    with pytest.raises(OSError) as e:
        export_folders.check_export_room(tmp_path, need, "bfloat16")
    msg = str(e.value)
    assert f"{(need + export_folders.EXPORT_SLACK_BYTES) / 1024**3:.2f} GiB" in msg and "bfloat16" in msg
    found = float(re.search(r"which has ([0-9.]+) GiB free", msg).group(1))
    assert abs(found - free / 1024**3) < 1.0  # what was found (other jobs write to this disk meanwhile)
    assert str(tmp_path) in msg and "rollout.vllm.export_dir" in msg


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_default_export_dir_leaves_a_full_dev_shm(caplog):
    assert export_folders.default_export_dir(0).parent == Path("/dev/shm")
    too_big = shutil.disk_usage("/dev/shm").free + 1
    with caplog.at_level(logging.WARNING, logger=export_folders.__name__):
        folder = export_folders.default_export_dir(too_big)
    assert folder.parent == Path(tempfile.gettempdir())
    assert "/dev/shm has" in caplog.text and str(folder.parent) in caplog.text


def test_previous_syncs_removed_only_if_they_are_exports(tmp_path):
    for name in ("sync-1", "sync-7", "sync-x", "mine"):
        (tmp_path / name).mkdir()
    for name in ("sync-1", "sync-x"):
        (tmp_path / name / hf.EXPORT_MARKER).write_text("{}")
    removed = export_folders.remove_previous_syncs(tmp_path)
    assert [p.name for p in removed] == ["sync-1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "sync-7", "sync-x"]


def test_a_sync_without_room_stops_before_writing(tiny_hf_dir, tmp_path, monkeypatch):
    """update_weights(CausalLM) checks the room for one export (params x the engine's dtype) before writing any."""
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    sampler = vllm_sampler.VllmSampler.__new__(vllm_sampler.VllmSampler)  # no engine: it fails before reloading
    sampler.export_dir, sampler.export_dtype, sampler._own_export, sampler.node_local = tmp_path, None, None, True
    sampler._sync_version, sampler.info, sampler.last_sync = 0, {"dtype": "bfloat16"}, {}
    monkeypatch.setattr(export_folders, "EXPORT_SLACK_BYTES", shutil.disk_usage(tmp_path).free)  # room for no export
    with pytest.raises(OSError, match="in bfloat16|of bfloat16 weights") as e:
        sampler.update_weights(model)
    need = hf.export_nbytes(nnx.state(model, nnx.Param), "bfloat16")
    assert f"({need / 1024**3:.2f} GiB of bfloat16 weights)" in str(e.value)
    assert list(tmp_path.iterdir()) == []
