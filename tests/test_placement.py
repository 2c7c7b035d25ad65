"""rollout.vllm.placement=split (assemble/placement.py): the engines' GPUs are hidden from JAX before its backend
starts, the engines are pinned to them, and the trainer's mesh spans the rest (8 fake CPU devices stand for a
host's 8 GPUs where nothing can be hidden)."""

import jax
import pytest

from arpo_jax import distributed
from arpo_jax.assemble import components, placement
from arpo_jax.config import args
from arpo_jax.rollout.vllm_sampler import engine_devices
from arpo_jax.train import trainer

GPUS = [f"GPU-{i}" for i in range(8)]  # a host's GPUs as the driver names them (UUIDs)


def _cfg(*overrides: str):
    return args.load_config(["--config=builtin:toy_cpu", "--config.rollout.engine=vllm",
                             "--config.rollout.vllm.placement=split", "--config.rollout.vllm.engine_gpus=3",
                             *overrides])


def test_the_engines_take_the_last_gpus_and_jax_is_left_the_rest():
    env = {"CUDA_VISIBLE_DEVICES": ",".join(GPUS)}
    set_ = placement.hide_engine_gpus(_cfg(), env, gpus=GPUS)
    assert set_ == {"CUDA_VISIBLE_DEVICES": "GPU-0,GPU-1,GPU-2,GPU-3,GPU-4", "ARPO_ENGINE_GPUS": "GPU-5,GPU-6,GPU-7"}
    assert env == set_
    # Once done (a re-exec of the same process, a launch script), the narrowed list is not split again.
    assert placement.hide_engine_gpus(_cfg(), env, gpus=GPUS[:5]) == {} and env == set_
    assert placement.engine_gpus(_cfg(), env) == ["GPU-5", "GPU-6", "GPU-7"]
    # One engine per tensor-parallel group of the engines' GPUs: 3 of TP 1, or with 4 GPUs 2 of TP 2.
    assert engine_devices(None, 1, placement.engine_gpus(_cfg(), env)) == [("GPU-5",), ("GPU-6",), ("GPU-7",)]
    tp2 = _cfg("--config.rollout.vllm.engine_gpus=4", "--config.rollout.vllm.tensor_parallel_size=2")
    env = {}
    placement.hide_engine_gpus(tp2, env, gpus=GPUS)
    assert engine_devices(None, 2, placement.engine_gpus(tp2, env)) == [("GPU-4", "GPU-5"), ("GPU-6", "GPU-7")]
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1,GPU-2,GPU-3"


def test_nothing_is_hidden_colocated_or_without_gpus():
    colocated = args.load_config(["--config=builtin:toy_cpu", "--config.rollout.engine=vllm"])
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert placement.hide_engine_gpus(colocated, env, gpus=["0", "1"]) == {} and env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert placement.hide_engine_gpus(_cfg(), env, gpus=[]) == {} and env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(ValueError, match=r"rollout.vllm.engine_gpus=3 .* host of 3 GPU.*allowed: 1 to 2"):
        placement.hide_engine_gpus(_cfg(), {}, gpus=GPUS[:3])


def test_the_mesh_spans_each_processs_first_devices_and_leaves_the_engines_share():
    devices = jax.devices()
    assert len(devices) == 8
    cfg = _cfg()
    ours = placement.trainer_devices(cfg, devices, 0, environ={})
    assert ours == devices[:5]
    mesh = components.make_mesh(cfg, ours)
    assert mesh.devices.shape == (1, 5, 1) and not set(mesh.devices.flat) & set(devices[5:])
    # Colocated: every device (None: the default mesh); hidden GPUs: JAX sees the trainer's alone.
    assert placement.trainer_devices(_cfg("--config.rollout.vllm.placement=colocated",
                                          "--config.rollout.vllm.engine_gpus=0"), devices, 0, environ={}) is None
    hidden = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "ARPO_ENGINE_GPUS": "8,9"}
    assert placement.trainer_devices(cfg, devices, 0, environ=hidden) is None
    with pytest.raises(ValueError, match="rollout.vllm.engine_gpus=8 .* allowed: 1 to 7"):
        placement.trainer_devices(_cfg("--config.rollout.vllm.engine_gpus=8"), devices, 0, environ={})


def test_the_trainer_hides_the_engines_gpus_before_jax_starts(monkeypatch, tmp_path):
    """What the trainer's process would hand to JAX: at `initialize_distributed` (the first thing that may start
    JAX's backend) CUDA_VISIBLE_DEVICES already lists the trainer's GPUs alone."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(GPUS))
    monkeypatch.setenv(placement.ENGINE_GPUS_ENV, "")  # unset, restored afterwards

    class Started(Exception):
        pass

    def initialize():
        import os

        raise Started(os.environ["CUDA_VISIBLE_DEVICES"], os.environ[placement.ENGINE_GPUS_ENV])

    monkeypatch.setattr(distributed, "initialize_distributed", initialize)
    with pytest.raises(Started) as seen:
        trainer.Trainer(_cfg(), tmp_path / "run")
    assert seen.value.args == ("GPU-0,GPU-1,GPU-2,GPU-3,GPU-4", "GPU-5,GPU-6,GPU-7")


def test_the_split_engines_are_started_on_their_gpus(monkeypatch, tmp_path):
    """components.make_sampler gives VllmSampler the engines' share of the host's GPUs (the trainer's process no
    longer sees them in CUDA_VISIBLE_DEVICES) and refuses more engines than it holds, naming the fields."""
    from arpo_jax.rollout import vllm_sampler

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0,GPU-1,GPU-2,GPU-3,GPU-4")
    monkeypatch.setenv(placement.ENGINE_GPUS_ENV, "GPU-5,GPU-6,GPU-7")
    got = {}
    monkeypatch.setattr(vllm_sampler, "VllmSampler", lambda folder, **kw: got.update(kw))
    components.make_sampler(_cfg(), None, engine="vllm", folder=tmp_path)
    assert got["gpus"] == ["GPU-5", "GPU-6", "GPU-7"] and got["engines"] is None
    with pytest.raises(ValueError, match=r"rollout.vllm.engines=2, rollout.vllm.tensor_parallel_size=2: .*"
                                         r"allowed: engines x tensor_parallel_size <= 3"):
        components.make_sampler(_cfg("--config.rollout.vllm.engines=2", "--config.rollout.vllm.tensor_parallel_size=2"),
                                None, engine="vllm", folder=tmp_path)


@pytest.mark.slow  # one training step (compiles the update on a 5-device mesh)
def test_a_split_run_trains_on_the_devices_the_engines_left(monkeypatch, tmp_path):
    """One step of the toy run with split placement on 8 fake devices standing for a host's GPUs: the mesh spans the
    first 5 (an odd count, as the 14B variant's), the params and optimizer state live there alone before and after
    the update, and the engine (a scripted one in place of vLLM) gets the updated weights."""
    from arpo_jax.rollout.fake_sampler import ScriptedSampler, Segment

    engines = []

    def engine(cfg, tokenizer, *args, **kwargs):
        engines.append(ScriptedSampler(tokenizer, lambda call: Segment("<answer> 4 </answer>", eos=True)))
        return engines[-1]

    monkeypatch.setattr(trainer, "make_rollout_sampler", engine)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU to hide: the fake devices stand for them
    cfg = _cfg("--config.trainer.max_steps=1", "--config.trainer.save_freq=0", "--config.trainer.progress=false",
               "--config.data.max_response_length=64", "--config.trainer.loggers=('jsonl',)")
    run = trainer.Trainer(cfg, tmp_path / "run")
    try:
        ours = set(jax.devices()[:5])
        assert run.mesh.devices.shape == (1, 5, 1) and set(run.mesh.devices.flat) == ours
        on_ours = lambda tree: all(x.sharding.device_set <= ours for x in jax.tree.leaves(tree))
        assert on_ours(run.state.params) and on_ours(run.state.opt_state)
        summary = run.run()
        assert summary["steps"] == 1 and on_ours(run.state.params) and on_ours(run.state.opt_state)
        assert engines[0].weights_version == 1 and len(engines[0].calls) >= 1
    finally:
        run.close()
