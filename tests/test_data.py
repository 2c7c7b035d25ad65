"""RL datasets (real reference parquet when available), deterministic batching, the toy task set, the tfds route."""

import logging
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from arpo_jax import testing
from arpo_jax.data import (
    DataPosition,
    batch_indices,
    encode_prompt,
    epoch_order,
    load_rl_dataset,
    prompts,
    shard,
    steps_per_epoch,
    tfds_builders,
    toy,
)

RL_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "rl")
if not os.path.isdir(RL_DIR):
    RL_DIR = "/work/shared/data/rl"
needs_data = pytest.mark.skipif(not os.path.isdir(RL_DIR), reason=f"reference data folder {RL_DIR} is absent")
REF_FILES = ("train_10k", "valid", "hard_search_1k", "gaia_test", "hle_test")


@pytest.fixture(scope="module")
def tok():
    return testing.make_tiny_tokenizer()


def _rl(name):
    return os.path.join(RL_DIR, f"{name}.parquet")


def _good_row(i=0, question="What is 2 + 2?"):
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": question}]
    return {"data_source": "unit", "prompt": prompt,
            "reward_model": {"ground_truth": "4", "style": "rule"}, "extra_info": {"index": i, "question": question}}


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


# ----------------------------------------------------------------------------------------------- loading


@needs_data
def test_real_prompt_ids_match_manual_chat_template(tok):
    ds = load_rl_dataset([_rl("valid"), _rl("gaia_test")], tok, max_prompt_length=100_000)
    rows = pq.read_table(_rl("valid")).to_pylist() + pq.read_table(_rl("gaia_test")).to_pylist()
    assert len(ds) == len(rows) == 283 and ds.skipped == [] and ds.filtered == []
    assert ds.data_sources == ("DR_grpo_mix", "DR_gaia")
    for i in (0, 57, 179, 180, 282):
        ex, row = ds[i], rows[i]
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        expected = tok(text, add_special_tokens=False)["input_ids"]
        assert ex.index == i and ex.prompt_ids.dtype == np.int32 and ex.prompt_ids.tolist() == expected
        assert text.endswith("<|im_start|>assistant\n") and tok.decode(ex.prompt_ids) == text
        assert ex.messages == row["prompt"] and ex.ground_truth == row["reward_model"]["ground_truth"]
        assert ex.question == row["extra_info"]["question"] and ex.extra_info == row["extra_info"]
    assert (ds[180].source_file, ds[180].row, ds[180].data_source) == (_rl("gaia_test"), 0, "DR_gaia")


@needs_data
@pytest.mark.parametrize("name", REF_FILES)
def test_backspace_artifact_kept(tok, name):
    ex = load_rl_dataset(_rl(name), tok, max_prompt_length=100_000, max_samples=2)[1]
    system = ex.messages[0]["content"]
    assert system.count("\x08oxed{") == 2 and "\\boxed" not in system  # spec 2.3: stored bytes, as they are
    assert "\x08oxed{" in tok.decode(ex.prompt_ids)
    assert system == prompts.SYSTEM_PROMPT.replace("\\boxed", "\x08oxed")  # toy prompt = reference minus the artifact


@needs_data
def test_train_10k_steps_per_epoch(tok):
    ds = load_rl_dataset(_rl("train_10k"), tok, max_prompt_length=100_000, max_samples=300)
    assert len(ds) == 300 and {e.extra_info["split"] for e in ds} == {"train"}
    assert steps_per_epoch(10_000, 128, True) == 78  # spec 11.3: 78 steps/epoch, 156 over 2 epochs


def test_malformed_rows_skipped_and_counted(tok, tmp_path, caplog):
    bad = [
        dict(_good_row(), prompt=None),  # missing prompt
        dict(_good_row(), prompt=[]),  # empty prompt
        dict(_good_row(), prompt=[{"role": "user", "content": None}]),  # bad message structure
        dict(_good_row(), reward_model={"ground_truth": None, "style": "rule"}),  # missing ground truth
        dict(_good_row(), data_source=None),
    ]
    path = _write(tmp_path / "bad.parquet", [_good_row(0), *bad, _good_row(6, "Who?")])
    with caplog.at_level(logging.WARNING):
        ds = load_rl_dataset(path, tok, max_prompt_length=512)
    assert len(ds) == 2 and [e.row for e in ds] == [0, 6] and [e.index for e in ds] == [0, 1]
    assert [(f, r) for f, r, _ in ds.skipped] == [(path, r) for r in range(1, 6)]
    reasons = [reason for _, _, reason in ds.skipped]
    assert reasons[0] == reasons[1] == "missing or empty prompt" and "content" in reasons[2]
    assert "ground_truth" in reasons[3] and "data_source" in reasons[4]
    assert sum("skipping" in r.message for r in caplog.records) == 5
    assert ds[1].question == "Who?" and ds.take(np.array([1, 0]))[0] is ds[1]


def test_many_malformed_rows_log_a_few_lines_and_a_count(tok, tmp_path, caplog):
    """A missing column makes every row malformed: 5 rows are shown, then one count (was one warning per row)."""
    path = _write(tmp_path / "no_source.parquet", [_good_row(0)] + [dict(_good_row(i), data_source=None)
                                                                   for i in range(1, 41)])
    with caplog.at_level(logging.WARNING):
        ds = load_rl_dataset(path, tok, max_prompt_length=512)
    assert len(ds) == 1 and len(ds.skipped) == 40
    lines = [r.getMessage() for r in caplog.records]
    assert sum("skipping" in m for m in lines) == 5
    assert sum(m == "skipped 40 malformed row(s) in all (the first 5 are shown above)" for m in lines) == 1


def test_no_valid_rows_and_missing_file(tok, tmp_path):
    path = _write(tmp_path / "allbad.parquet", [dict(_good_row(), reward_model={"ground_truth": None})])
    with pytest.raises(ValueError, match="no valid examples.*allbad.parquet"):
        load_rl_dataset(path, tok, max_prompt_length=512)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_rl_dataset([path, str(tmp_path / "nope.parquet")], tok, max_prompt_length=512)
    with pytest.raises(ValueError, match="data.overlong_prompts"):
        load_rl_dataset(path, tok, max_prompt_length=512, overlong="truncate")


def test_question_falls_back_to_last_user_message_and_list_ground_truth(tok, tmp_path):
    row = dict(_good_row(), extra_info=None, reward_model={"ground_truth": ["4", "four"]})
    ex = load_rl_dataset(_write(tmp_path / "q.parquet", [row]), tok, max_prompt_length=512)[0]
    assert ex.question == "What is 2 + 2?" and ex.extra_info == {} and ex.ground_truth == ["4", "four"]


def test_overlong_error_names_fields_and_filter_counts(tok, tmp_path):
    rows = [_good_row(0), _good_row(1, "word " * 200), _good_row(2)]
    path = _write(tmp_path / "long.parquet", rows)
    n_long = len(encode_prompt(tok, rows[1]["prompt"]))
    limit = len(encode_prompt(tok, rows[0]["prompt"]))  # the short prompts fit exactly: > is over-long, = is not
    with pytest.raises(ValueError) as err:
        load_rl_dataset(path, tok, max_prompt_length=limit)
    msg = str(err.value)
    for part in (path, "row 1", str(n_long), str(limit), "data.max_prompt_length", "data.overlong_prompts", "filter"):
        assert part in msg
    ds = load_rl_dataset(path, tok, max_prompt_length=limit, overlong="filter")
    assert [e.row for e in ds] == [0, 2] and ds.filtered == [(path, 1, n_long)]


# ----------------------------------------------------------------------------------------------- batching


@pytest.mark.parametrize("n,bs,drop_last,expected", [(10_000, 128, True, 78), (10_000, 128, False, 79),
                                                      (1071, 128, True, 8), (1071, 64, True, 16), (100, 128, True, 0),
                                                      (100, 128, False, 1), (256, 128, True, 2)])
def test_steps_per_epoch(n, bs, drop_last, expected):
    assert steps_per_epoch(n, bs, drop_last) == expected


@pytest.mark.parametrize("drop_last", [True, False])
def test_batches_disjoint_deterministic_and_reshuffled(drop_last):
    n, bs = 1000, 128
    steps = steps_per_epoch(n, bs, drop_last)
    epoch0 = [batch_indices(n, bs, 0, s, seed=1, shuffle=True, drop_last=drop_last) for s in range(steps)]
    flat = np.concatenate(epoch0)
    assert len(flat) == len(set(flat.tolist())) == (896 if drop_last else 1000)
    assert [len(b) for b in epoch0][-1] == (128 if drop_last else 1000 - 7 * 128)
    again = batch_indices(n, bs, 0, 3, seed=1, shuffle=True, drop_last=drop_last)
    np.testing.assert_array_equal(again, epoch0[3])  # pure: recomputed on resume / on another host
    assert not np.array_equal(batch_indices(n, bs, 1, 0, seed=1, shuffle=True, drop_last=drop_last), epoch0[0])
    assert not np.array_equal(batch_indices(n, bs, 0, 0, seed=2, shuffle=True, drop_last=drop_last), epoch0[0])
    with pytest.raises(IndexError, match="data.train_batch_size"):
        batch_indices(n, bs, 0, steps, seed=1, shuffle=True, drop_last=drop_last)


def test_epoch_order():
    np.testing.assert_array_equal(epoch_order(5, 3, seed=1, shuffle=False), np.arange(5))
    order = epoch_order(50, 2, seed=1, shuffle=True)
    np.testing.assert_array_equal(np.sort(order), np.arange(50))
    np.testing.assert_array_equal(order, np.random.default_rng([1, 2]).permutation(50))


def test_shards_reassemble_the_batch():
    batch = batch_indices(10_000, 128, 4, 17, seed=1, shuffle=True, drop_last=True)
    for num_shards in (1, 2, 4, 8):
        parts = [shard(batch, i, num_shards) for i in range(num_shards)]
        assert {len(p) for p in parts} == {128 // num_shards}
        np.testing.assert_array_equal(np.concatenate(parts), batch)
    with pytest.raises(ValueError, match="data.train_batch_size"):
        shard(batch, 0, 3)


def test_data_position_roundtrip_and_advance():
    pos = DataPosition()
    seen = []
    for _ in range(7):
        seen.append((pos.epoch, pos.step_in_epoch))
        pos = pos.advance(3)
    assert seen == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)] and pos == DataPosition(2, 1)
    assert DataPosition.from_dict(pos.to_dict()) == pos and pos.to_dict() == {"epoch": 2, "step_in_epoch": 1}
    with pytest.raises(ValueError, match="drop_last"):
        pos.advance(0)


# ----------------------------------------------------------------------------------------------- toy tasks


def test_toy_rows_follow_the_reference_schema(tok, tmp_path):
    rows = toy.toy_rows("train", 30, seed=0)
    assert rows == toy.toy_rows("train", 30, seed=0) and rows != toy.toy_rows("val", 30, seed=0)
    assert {r["data_source"] for r in rows} == set(toy.DATA_SOURCES)
    for i, r in enumerate(rows):
        assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert [m["role"] for m in r["prompt"]] == ["system", "user"]
        assert r["prompt"][0]["content"] == prompts.SYSTEM_PROMPT
        gt = r["reward_model"]["ground_truth"]
        assert r["reward_model"]["style"] == "rule" and isinstance(gt, str) and gt
        assert gt.isdigit() or r["data_source"] == "toy_lookup"  # only a capital's name is not a number
        assert r["extra_info"] == {"index": i, "question": r["prompt"][1]["content"], "split": "train"}
    arith = [r for r in rows if r["data_source"] == "toy_arith"]
    a, b = map(int, re.findall(r"\d+", arith[0]["prompt"][1]["content"]))
    assert 100 <= a < 10_000 and 100 <= b < 10_000 and arith[0]["reward_model"]["ground_truth"] == str(a * b)
    assert prompts.SYSTEM_PROMPT.count("\\boxed{") == 2 and "\x08" not in prompts.SYSTEM_PROMPT

    train, val = toy.write_toy_parquet(str(tmp_path), n_train=12, n_val=6)
    mtime = os.path.getmtime(train)
    assert toy.write_toy_parquet(str(tmp_path), n_train=12, n_val=6) == (train, val)
    assert os.path.getmtime(train) == mtime  # idempotent: unchanged content is not rewritten
    ds = load_rl_dataset(train, tok, max_prompt_length=4096)
    assert len(ds) == 12 and ds.skipped == [] and set(ds.data_sources) == set(toy.DATA_SOURCES)
    assert pq.read_table(val).to_pylist() == toy.toy_rows("val", 6, seed=0)
    assert toy.resolve_files(["builtin:toy"], str(tmp_path), split="val") == [os.path.join(str(tmp_path),
                                                                                         "toy_val.parquet")]


def test_toy_lookup_questions_are_found_by_local_bm25():
    from arpo_jax.tools import LocalSearchTool

    docs = toy.corpus(0)
    assert len(docs) == len(set(docs)) == 3 * toy.NUM_COUNTRIES
    search = LocalSearchTool(documents=docs)
    tasks = [t for t in toy.toy_tasks("train", 150) if t.data_source != "toy_arith"]
    for t in tasks:
        for tool, query, result in t.steps:
            gold = docs.index(result.removeprefix("Page 1: ")) if tool == "search" else None
            if t.data_source == "toy_lookup":  # the question itself, as a query, finds its document first
                assert search.search(t.question, k=1)[0][0] == gold, t.question
            if tool == "search":  # the scripted query of every hop finds its document in the top 3
                assert gold in [i for i, _ in search.search(query, k=3)], query


def test_toy_solutions_and_tokenizer_corpus():
    task = toy.toy_tasks("train", 3)[2]
    text = toy.solution_text(task)
    assert text.count("<result>\n") == len(task.steps) == 3 and text.endswith(f"\\boxed{{{task.answer}}} </answer>")
    lines = toy.tokenizer_corpus()
    assert lines[0] == prompts.SYSTEM_PROMPT and set(toy.corpus()) <= set(lines)
    assert any("<python>" in x and "<answer>" in x for x in lines) and any("<search>" in x for x in lines)
    tok = testing.make_tiny_tokenizer(corpus=lines, vocab_size=1024)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2  # the BPE learned the format


# ----------------------------------------------------------------------------------------------- tfds route


@pytest.mark.skipif(not tfds_builders.available(), reason="tensorflow-datasets / array-record not installed")
def test_tfds_route_matches_parquet(tok, tmp_path):
    rows = [_good_row(0), dict(_good_row(1), prompt=None), _good_row(2, "\x08oxed{é}?"), *toy.toy_rows("val", 4)]
    path = _write(tmp_path / "mixed.parquet", rows)
    ref = load_rl_dataset(path, tok, max_prompt_length=4096)
    got = load_rl_dataset(path, tok, max_prompt_length=4096, source="tfds", tfds_data_dir=str(tmp_path / "tfds"))
    assert len(got) == len(ref) == 6 and got.skipped == ref.skipped and got.data_sources == ref.data_sources
    for a, b in zip(ref, got, strict=True):
        assert (a.row, a.source_file, a.messages, a.ground_truth, a.extra_info) == \
            (b.row, b.source_file, b.messages, b.ground_truth, b.extra_info)
        np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    again = load_rl_dataset(path, tok, max_prompt_length=4096, source="tfds", tfds_data_dir=str(tmp_path / "tfds"))
    assert len(again) == 6 and len(os.listdir(tmp_path / "tfds" / tfds_builders.DATASET_NAME)) == 1  # built once
