"""runtime: the folder a run's policy starts from."""

from arpo_jax.assemble import policy as runtime
from arpo_jax.config.schema import get_config


def test_builtin_tiny_is_built_once_per_process_and_copied_into_each_run(tmp_path, monkeypatch):
    """Each work dir gets its own copy of builtin:tiny, the same files a build gives, but a process builds it once
    per seed (a BPE training and a model init)."""
    built, build = [], runtime.build_tiny_model
    monkeypatch.setattr(runtime, "build_tiny_model", lambda dest, seed: built.append(seed) or build(dest, seed=seed))
    monkeypatch.setattr(runtime, "_TINY_MODELS", {})
    cfg = get_config()
    cfg.model.path, cfg.seed = runtime.BUILTIN_TINY, 5
    first, second = runtime.model_dir(cfg, tmp_path / "a"), runtime.model_dir(cfg, tmp_path / "b")
    assert built == [5] and first == tmp_path / "a" / "builtin_tiny" and second.parent == tmp_path / "b"

    def files(folder):
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    assert files(first) == files(second) == files(build(tmp_path / "direct", seed=5))
    (second / "model.safetensors").write_bytes(b"")  # a run's copy is its own
    assert files(runtime.model_dir(cfg, tmp_path / "c")) == files(first) and built == [5]
