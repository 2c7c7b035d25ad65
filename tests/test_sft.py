"""Cold-start SFT: conversation loading and loss masks (ChatML), the SFT step's maths and invariances, and the loop.

Masks are checked on text: with the fast tokenizer's offsets every token is a slice of the rendered chat, so the
trained slices must concatenate to exactly the assistant text (tool results removed) plus `<|im_end|>`.
"""

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from arpo_jax import models, sharding, testing
from arpo_jax.data import sft_data
from arpo_jax.train import sft as sft_lib
from arpo_jax.update import jit
from arpo_jax.update import train_step as ts
from arpo_jax.weights import hf

SYSTEM, QUESTION = "You solve problems.", "What is 2 + 3 times 7?"
PART1 = "<think> I will compute it. </think> <python> print(2 + 3 * 7) </python>"
PART2 = " <think> It printed 23. </think> <answer> \\boxed{23} </answer>"


@pytest.fixture(scope="module")
def tok():
    return testing.make_tiny_tokenizer()


def _pieces(tok, ids, mask, text):
    """(trained text, untrained text) of an encoded chat, from the tokens' character offsets."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == list(ids)
    spans = [text[s:e] for s, e in enc["offset_mapping"]]
    assert "".join(spans) == text  # the tokens tile the text, so the two strings below partition it
    return ("".join(p for p, m in zip(spans, mask) if m), "".join(p for p, m in zip(spans, mask) if not m))


def _encode(tok, record, fmt):
    msgs = sft_data.to_messages(sft_data.record_turns(record, fmt))
    ids, mask = sft_data.encode_messages(tok, msgs)
    return msgs, ids, mask, tok.apply_chat_template(msgs, tokenize=False)


SHAREGPT = {"system": SYSTEM, "conversations": [
    {"from": "human", "value": QUESTION}, {"from": "gpt", "value": PART1},
    {"from": "human", "value": "<result>\n23\n</result>"}, {"from": "gpt", "value": PART2}]}


def test_sharegpt_tool_turns_become_one_assistant_turn_with_exact_mask(tok):
    msgs, ids, mask, text = _encode(tok, SHAREGPT, "sharegpt")
    # The rollout's format: one assistant turn, the result spliced exactly as spec 3.3 appends it.
    spliced = PART1 + " <result>\n23\n</result>" + PART2
    assert msgs == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": spliced}]
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                    f"<|im_start|>assistant\n{spliced}<|im_end|>\n")
    trained, untrained = _pieces(tok, ids, mask, text)
    assert trained == PART1 + PART2 + "<|im_end|>"
    assert untrained == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                         "<|im_start|>assistant\n <result>\n23\n</result>\n")
    # The same conversation with the result inline (the reference's files) gives identical tokens and mask;
    # unmasked, the result is trained as LLaMA-Factory does.
    inline = {"system": SYSTEM, "conversations": [{"from": "human", "value": QUESTION},
                                                  {"from": "gpt", "value": spliced}]}
    _, ids2, mask2, _ = _encode(tok, inline, "sharegpt")
    np.testing.assert_array_equal(ids2, ids)
    np.testing.assert_array_equal(mask2, mask)
    ids3, mask3 = sft_data.encode_messages(tok, msgs, mask_tool_results=False)
    assert _pieces(tok, ids3, mask3, text)[0] == spliced + "<|im_end|>"


def test_openai_multi_turn_and_tool_role_masks(tok):
    record = {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": PART1},
        {"role": "tool", "content": "23"}, {"role": "assistant", "content": [{"type": "text", "text": PART2}]}]}
    msgs, ids, mask, text = _encode(tok, record, "openai")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    trained, _ = _pieces(tok, ids, mask, text)
    assert trained == "hello there<|im_end|>" + PART1 + PART2 + "<|im_end|>"
    assert msgs[3]["content"] == PART1 + " <result>\n23\n</result>" + PART2
    # alpaca rows: instruction + "\n" + input as the user turn (LLaMA-Factory).
    amsgs, aids, amask, atext = _encode(tok, {"instruction": "Solve.", "input": QUESTION, "output": "done"}, "alpaca")
    assert amsgs[0] == {"role": "user", "content": "Solve.\n" + QUESTION}
    assert _pieces(tok, aids, amask, atext)[0] == "done<|im_end|>"


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_formats_files_cutoff_and_malformed_rows(tok, tmp_path):
    good = [SHAREGPT, {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a b c"}]}]
    bad = ["{not json", {"conversations": []}, {"conversations": [{"from": "alien", "value": "x"}]},
           {"conversations": [{"from": "human", "value": "only a question"}]}, [1, 2],
           {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 5}]}]
    ds = sft_data.load_sft_examples([_write_jsonl(tmp_path / "a.jsonl", good + bad)], tok, cutoff_len=4096)
    assert len(ds) == 2 and len(ds.skipped) == len(bad) and ds.truncated == ds.dropped == 0
    assert sorted(row for _, row, _ in ds.skipped) == list(range(2, 2 + len(bad)))

    # JSON array and parquet give the same examples; the format is detected per file.
    (tmp_path / "b.json").write_text(json.dumps(good))
    import pyarrow as pa
    import pyarrow.parquet as pq
    openai_rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b c"}]}]
    pq.write_table(pa.Table.from_pylist(openai_rows), tmp_path / "c.parquet")
    both = sft_data.load_sft_examples([str(tmp_path / "b.json"), str(tmp_path / "c.parquet")], tok, cutoff_len=4096)
    for (i1, m1), (i2, m2) in zip(both.examples, ds.examples + ds.examples[1:]):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(m1, m2)

    # Cutoff: the long example keeps its start (loss only there); one whose answer starts after the cut is dropped.
    full_ids, full_mask = ds[0]
    first_loss = int(np.argmax(full_mask))
    cut = first_loss + 5
    rows = [SHAREGPT, {"conversations": [{"from": "human", "value": "word " * 400}, {"from": "gpt", "value": "x"}]}]
    short = sft_data.load_sft_examples([_write_jsonl(tmp_path / "d.jsonl", rows)], tok, cutoff_len=cut)
    assert len(short) == 1 and short.truncated == 2 and short.dropped == 1
    np.testing.assert_array_equal(short[0][0], full_ids[:cut])
    np.testing.assert_array_equal(short[0][1], full_mask[:cut])
    assert short.loss_tokens[0] == 5

    with pytest.raises(ValueError, match=r"sft.train_files.*\d malformed"):
        sft_data.load_sft_examples([_write_jsonl(tmp_path / "e.jsonl", bad)], tok, cutoff_len=4096)
    with pytest.raises(FileNotFoundError, match="sft.train_files"):
        sft_data.load_sft_examples([str(tmp_path / "missing.json")], tok, cutoff_len=4096)


def test_toy_conversations_are_solved_tool_trajectories(tok):
    rows = sft_data.toy_sft_conversations(6, seed=0)
    kinds = set()
    for row in rows:
        answer = row["messages"][2]["content"]
        assert answer.endswith("</answer>") and "\\boxed{" in answer and "</result>" in answer
        kinds.update(tag for tag in ("<python>", "<search>") if tag in answer)
    assert kinds == {"<python>", "<search>"}
    assert rows == sft_data.toy_sft_conversations(6, seed=0)


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------

MODEL_CFG = models.Config(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, sharding_rules="fsdp")


@pytest.fixture(scope="module")
def tiny():
    graphdef, params = jit.split_model(models.init_model(MODEL_CFG, seed=0))
    rng = np.random.RandomState(0)
    examples = []
    for _ in range(10):
        n = rng.randint(6, 30)
        mask = (np.arange(n) >= rng.randint(1, 5)).astype(np.int32)
        mask[rng.randint(0, n):][:3] = 0  # a tool-result gap
        examples.append((rng.randint(0, MODEL_CFG.vocab_size, n).astype(np.int32), mask))
    return graphdef, params, examples


def _batch(examples, rows, row_len=32):
    total = sum(int(m[1:].sum()) for _, m in examples)
    return sft_lib.pack_sft_batch(examples, row_len=row_len, rows=rows, total_loss_tokens=total)


def _run(tiny, batch, optimizer, mesh=None):
    graphdef, params, _ = tiny
    if mesh is None:
        state = jit.init_train_state(params, optimizer)
        step = sft_lib.jit_sft_step(graphdef, MODEL_CFG, optimizer)
    else:
        p_sh = jit.param_shardings(MODEL_CFG, mesh)
        shardings = jit.state_shardings(optimizer, p_sh, params, mesh)
        state = jit.init_train_state(jax.tree.map(jax.device_put, params, p_sh), optimizer, shardings)
        step = sft_lib.jit_sft_step(graphdef, MODEL_CFG, optimizer, mesh, shardings)
    new, metrics = step(state, batch)
    return new, {k: float(v) for k, v in metrics.items()}


def test_loss_is_token_mean_nll(tiny):
    graphdef, params, examples = tiny
    # One right-padded row per sequence: attention is causal, so padding after a sequence cannot change its logits.
    padded = np.zeros((len(examples), 32), np.int32)
    for i, (ids, _) in enumerate(examples):
        padded[i, :len(ids)] = ids
    all_logits = np.asarray(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, padded), np.float64)
    nll, count = 0.0, 0
    for (ids, mask), logits in zip(examples, all_logits):
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))  # [32, V]
        tok_logp = logp[np.arange(len(ids) - 1), ids[1:]]  # position j predicts token j + 1
        nll -= float((tok_logp * mask[1:]).sum())
        count += int(mask[1:].sum())
    _, metrics = _run(tiny, _batch(examples, rows=2), optax.sgd(0.0))
    np.testing.assert_allclose(metrics["loss"], nll / count, rtol=1e-5)
    assert metrics["skipped"] == 0 and metrics["grad_norm"] > 0


@pytest.mark.slow  # > 10 s (compile-bound)
def test_micro_batch_split_invariance(tiny):
    _, _, examples = tiny
    one, many = _batch(examples, rows=16), _batch(examples, rows=1)
    assert one["input_ids"].shape[0] == 1 and many["input_ids"].shape[0] > 2
    sgd = optax.sgd(1.0)  # new params = params - grads: compares gradients, which Adam's first step would hide
    new1, m1 = _run(tiny, one, sgd)
    new2, m2 = _run(tiny, many, sgd)
    for a, b in zip(jax.tree.leaves(new1.params), jax.tree.leaves(new2.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.slow  # > 10 s (compile-bound)
def test_sharded_step_equals_single_device(tiny, optimizer):
    """SGD(1) compares the gradients themselves; AdamW the sharded optimizer state. Adam's first step is about
    lr * g / |g| per element, which turns float-rounding noise on near-zero gradients into differences up to lr,
    hence its looser tolerance (measured: 1 of 8192 elements at 1.3e-5 with lr 1e-3)."""
    _, _, examples = tiny
    if optimizer == "sgd":
        opt, atol = optax.sgd(1.0), 1e-6
    else:
        opt = ts.make_optimizer(ts.UpdateConfig(lr=1e-3, schedule="cosine", warmup_steps=0, weight_decay=0.0), 10)
        atol = 5e-5
    batch = _batch(examples, rows=8)
    ref, ref_m = _run(tiny, batch, opt)
    mesh = sharding.make_mesh((1, 8, 1))
    batch_sh = jax.sharding.NamedSharding(mesh, sharding.batch_spec(mesh, MODEL_CFG.sharding_rules))
    new, m = _run(tiny, sft_lib.to_global(batch, batch_sh), opt, mesh)
    assert not new.params["lm_head"]["weight"].sharding.is_fully_replicated
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)
    for k in ref_m:
        np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-4, atol=1e-6, err_msg=k)


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def _toy_config(max_steps):
    from arpo_jax.config.schema import get_config

    c = get_config()
    c.model.path, c.model.dtype, c.model.remat = "builtin:tiny", "float32", "none"
    c.rollout.engine = "jax"
    c.sft.train_files, c.sft.cutoff_len, c.sft.batch_size = ("builtin:toy",), 512, 8
    c.sft.lr, c.sft.max_steps, c.sft.save_freq, c.sft.warmup_ratio = 3e-3, max_steps, 4, 0.1
    c.trainer.loggers, c.trainer.progress, c.trainer.keep_checkpoints = ("jsonl",), False, 2
    return c


@pytest.mark.slow  # whole SFT runs
def test_run_sft_on_toy_data_learns_checkpoints_exports_and_resumes(tmp_path):
    from arpo_jax.train import metrics
    from arpo_jax.weights import checkpoint, pretrained

    out = sft_lib.run_sft(_toy_config(8), tmp_path)
    assert out["steps"] == 8 and out["start_step"] == 0 and out["skipped"] == 0 and out["examples"] > 0
    log = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    losses = [r["sft/loss"] for r in log]
    assert [r["step"] for r in log] == list(range(1, 9))
    assert losses[-1] < 0.75 * losses[0], losses
    assert log[0]["sft/lr"] == 0.0 and max(r["sft/lr"] for r in log) == pytest.approx(3e-3)
    ckpt = checkpoint.Checkpointer(tmp_path / "checkpoints")
    assert ckpt.all_steps() == [4, 8] and ckpt.read_meta(8)["data_position"]["epoch"] == 0
    ckpt.close()
    exported = pretrained.from_pretrained(tmp_path / "hf")
    assert exported.config.vocab_size > 0 and (tmp_path / "hf" / "tokenizer.json").is_file()

    # The same config again (the demo's second algorithm): the finished run's summary, no model built.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sft_lib.policy_lib, "load_policy", lambda *a: pytest.fail("a finished SFT was rebuilt"))
        same = sft_lib.run_sft(_toy_config(8), tmp_path)
    assert same == out | {"start_step": 8, "wall_time_s": same["wall_time_s"]}
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 9))
    marker = tmp_path / "hf" / hf.EXPORT_MARKER
    marker.rename(tmp_path / "marker")  # an export that is not known complete: no shortcut
    assert sft_lib.finished_run(_toy_config(8), tmp_path) is None
    (tmp_path / "marker").rename(marker)
    assert sft_lib.finished_run(_toy_config(8), tmp_path) is not None
    assert sft_lib.finished_run(_toy_config(9), tmp_path) is None  # more steps asked for
    changed = _toy_config(8)
    changed.sft.lr = 1e-3
    assert sft_lib.finished_run(changed, tmp_path) is None  # another meaning (refused or allowed by open_workdir)

    # A restart picks up at the newest checkpoint (one more step, so the test stays short).
    again = sft_lib.run_sft(_toy_config(9), tmp_path)
    assert again["start_step"] == 8 and again["steps"] == 9
    log = metrics.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 10))


def test_template_that_rewrites_the_answer_is_bypassed_for_the_final_turn(tok):
    """Qwen3-like: the template keeps only the text after the last </think>; the rollout's raw text is trained."""
    import copy

    q3 = copy.deepcopy(tok)
    q3.chat_template = (
        "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and '</think>' in c %}"
        "{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    msgs = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": PART1 + PART2}]
    ids, mask = sft_data.encode_messages(q3, msgs)
    text = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n{PART1 + PART2}<|im_end|>\n"
    assert _pieces(q3, ids, mask, text)[0] == PART1 + PART2 + "<|im_end|>"


@pytest.mark.slow  # whole SFT runs
def test_sigterm_stops_sft_at_a_step_with_a_checkpoint_and_the_resume_loses_nothing(tmp_path):
    """SIGTERM (sent to this process, as SLURM does) in the middle of SFT: the current step finishes and is saved
    although it is not a save_freq step, metrics are flushed, `Stopped` carries exit status 143; the resume
    continues from that step."""
    import os
    import signal
    import threading
    import time

    from arpo_jax.train import metrics, run_guard
    from arpo_jax.weights import checkpoint

    def signal_after_step_1():
        deadline = time.time() + 600
        while time.time() < deadline:
            path = tmp_path / "metrics.jsonl"
            if path.exists() and metrics.read_jsonl(path):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    threading.Thread(target=signal_after_step_1, daemon=True).start()
    with pytest.raises(run_guard.Stopped, match="stopped by SIGTERM: step [123] is saved in") as err:
        sft_lib.run_sft(_toy_config(4), tmp_path)
    assert err.value.exit_code == 143
    done = [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")]
    assert done == list(range(1, len(done) + 1)) and len(done) < 4
    with checkpoint.Checkpointer(tmp_path / "checkpoints", create=False) as ckpt:
        assert ckpt.all_steps() == [done[-1]]  # save_freq=4: saved only because of the signal
    again = sft_lib.run_sft(_toy_config(4), tmp_path)
    assert again["start_step"] == done[-1] and again["steps"] == 4
    assert [r["step"] for r in metrics.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
