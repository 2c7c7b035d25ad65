"""HF import/export: bit-identical round trips, transformers reload, sharded files, and clear errors on bad input."""

import json
import shutil
import struct
import time

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import arpo_jax
from arpo_jax import testing
from arpo_jax.weights import hf


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("variant", list(testing.TINY_VARIANTS))
def test_round_trip_is_bit_identical_and_transformers_agrees(tiny_hf_dir, tmp_path, variant):
    path, ref = tiny_hf_dir(variant)
    model = arpo_jax.from_pretrained(path)
    out = arpo_jax.save_pretrained(model, tmp_path / "export")
    original, exported = _tensors(path), _tensors(out)
    assert original.keys() == exported.keys()
    for k in original:
        assert original[k].dtype == exported[k].dtype and np.array_equal(original[k], exported[k]), k
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor(np.random.RandomState(0).randint(0, 512, (2, 11)))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, ref(ids).logits)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert reloaded.config.tie_word_embeddings == ref.config.tie_word_embeddings


def test_bfloat16_checkpoint_round_trip(tmp_path):
    src = tmp_path / "bf16"
    testing.make_tiny_hf_model(src, "qwen3", dtype="bfloat16")
    model = arpo_jax.from_pretrained(src, dtype="bfloat16")
    out = arpo_jax.save_pretrained(model, tmp_path / "out")
    a, b = _tensors(src), _tensors(out)
    assert all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_export_with_index_reloads(tiny_hf_dir, tmp_path):
    path, ref = tiny_hf_dir("llama31")
    model = arpo_jax.from_pretrained(path)
    out = arpo_jax.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=200_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in _tensors(out).values())
    again = arpo_jax.from_pretrained(out)  # our import reads the index too
    ids = np.random.RandomState(1).randint(0, 512, (1, 9))
    np.testing.assert_array_equal(np.asarray(again(ids)), np.asarray(model(ids)))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded(torch.tensor(ids)).logits, ref(torch.tensor(ids)).logits)


def test_both_config_spellings_load(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("llama31")
    legacy = tmp_path / "legacy"
    shutil.copytree(path, legacy)
    d = json.loads((legacy / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = rope
    d["torch_dtype"] = d.pop("dtype")
    (legacy / "config.json").write_text(json.dumps(d))
    assert hf.read_config(legacy)[0] == hf.read_config(path)[0]
    assert hf.read_config(legacy)[0].rope_scaling.factor == 8.0


def test_tokenizer_files_are_exported(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("qwen2")
    tok = testing.make_tiny_tokenizer(tmp_path / "tok")
    model = arpo_jax.from_pretrained(path)
    out = arpo_jax.save_pretrained(model, tmp_path / "with_tok", tokenizer=tok)
    again = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "<|im_start|>user\n<search> the year </search><|im_end|>"
    assert again.encode(text) == tok.encode(text)
    out2 = arpo_jax.save_pretrained(model, tmp_path / "with_tok_dir", tokenizer=tmp_path / "tok")
    assert (out2 / "tokenizer.json").is_file()


def test_failed_export_keeps_the_previous_folder(tiny_hf_dir, tmp_path, monkeypatch):
    path, _ = tiny_hf_dir("qwen2")
    model = arpo_jax.from_pretrained(path)
    dest = arpo_jax.save_pretrained(model, tmp_path / "sync")
    before = _tensors(dest)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "_save_tokenizer", boom)
    with pytest.raises(OSError, match="disk full"):
        arpo_jax.save_pretrained(model, dest, tokenizer="anything")
    after = _tensors(dest)
    assert before.keys() == after.keys() and (dest / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["sync"]  # no temporary folder left behind
    arpo_jax.save_pretrained(model, dest)  # a later export replaces it; the old copy is deleted in the background
    deadline = time.monotonic() + 30
    while [p.name for p in tmp_path.iterdir()] != ["sync"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.name for p in tmp_path.iterdir()] == ["sync"]


# ---------------------------------------------------------------------------------------------------------------
# Bad input: every error names what is wrong.


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_model_type(tiny_hf_dir, tmp_path):
    bad = _copy(tiny_hf_dir("qwen2")[0], tmp_path / "m")
    d = json.loads((bad / "config.json").read_text())
    d["model_type"] = "mistral"
    (bad / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"model_type='mistral'.*allowed: \['llama', 'qwen2', 'qwen3'\]"):
        arpo_jax.from_pretrained(bad)


def test_missing_tensor(tiny_hf_dir, tmp_path):
    bad = _copy(tiny_hf_dir("qwen2")[0], tmp_path / "m")
    t = load_file(str(bad / "model.safetensors"))
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        arpo_jax.from_pretrained(bad)


def test_wrong_shape(tiny_hf_dir, tmp_path):
    bad = _copy(tiny_hf_dir("qwen2")[0], tmp_path / "m")
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 128), np.float32)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(32, 128\), "
                                         r"expected \(64, 128\)"):
        arpo_jax.from_pretrained(bad)


def test_unexpected_tensor(tiny_hf_dir, tmp_path):
    bad = _copy(tiny_hf_dir("qwen2")[0], tmp_path / "m")
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.mlp.extra.weight"] = np.zeros((2,), np.float32)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        arpo_jax.from_pretrained(bad)


def test_duplicate_tensor_across_shards(tiny_hf_dir, tmp_path):
    src = tiny_hf_dir("qwen2")[0]
    bad = tmp_path / "m"
    bad.mkdir()
    shutil.copy(src / "config.json", bad)
    t = load_file(str(src / "model.safetensors"))
    save_file(t, str(bad / "model-00001-of-00002.safetensors"))
    save_file({"model.norm.weight": t["model.norm.weight"]}, str(bad / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' appears twice"):
        arpo_jax.from_pretrained(bad)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(tiny_hf_dir, tmp_path, damage):
    bad = _copy(tiny_hf_dir("qwen2")[0], tmp_path / "m")
    f = bad / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    else:
        f.write_bytes(struct.pack("<Q", 40) + b"{not json" + data[17:])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        arpo_jax.from_pretrained(bad)


def test_missing_config_field(tiny_hf_dir, tmp_path):
    bad = _copy(tiny_hf_dir("qwen3")[0], tmp_path / "m")
    d = json.loads((bad / "config.json").read_text())
    del d["intermediate_size"]
    (bad / "config.json").write_text(json.dumps(d))
    with pytest.raises(KeyError, match="intermediate_size"):
        arpo_jax.from_pretrained(bad)


def test_unsupported_rope_type(tiny_hf_dir, tmp_path):
    bad = _copy(tiny_hf_dir("llama31")[0], tmp_path / "m")
    d = json.loads((bad / "config.json").read_text())
    d["rope_parameters"]["rope_type"] = "yarn"
    (bad / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"rope type 'yarn' is not supported"):
        arpo_jax.from_pretrained(bad)


def test_not_a_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        arpo_jax.from_pretrained(tmp_path)
