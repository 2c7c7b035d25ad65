"""`arpo-jax data fetch / check / pack` for real: the CLI (a process, as a user runs it) with the real clients
(`requests`, `huggingface_hub`) against servers on loopback that serve the real files of ../shared/data over the
protocols those clients speak (tests/loopback_servers.py): every file lands as the reference's bytes; a connection
dropped mid-file is resumed; a corrupted byte is refused and named; a 404 names the file and its source; a full disk
gives one line and leaves nothing; a second run downloads nothing; `--from` a tarball `data pack` wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arpo_jax.data import manifest
from tests.loopback_servers import HubLoopback, Loopback

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/data")
pytestmark = pytest.mark.skipif(not (SHARED / "rl").is_dir(), reason=f"the reference data is not at {SHARED}")
SOURCES, ENTRIES = manifest.load()
HUB = SOURCES["arpo_sft_hub"]


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory) -> Path:
    """The hub's SFT file stands in as ShareGPT conversations built from real GSM8K rows (no copy of the 54K set is
    at hand; the manifest pins no checksum for it, so the hub's LFS sha256 is what is checked)."""
    rows = [json.loads(line) for line in (SHARED / "eval" / "gsm8k" / "test.jsonl").read_text().splitlines()[:50]]
    convs = [{"conversations": [{"from": "human", "value": r.get("question") or r.get("problem")},
                                {"from": "gpt", "value": str(r.get("answer"))}]} for r in rows]
    path = tmp_path_factory.mktemp("hub") / "final_sft_edition9.json"
    path.write_text(json.dumps(convs))
    return path


def _local(entry: manifest.Entry) -> Path:
    return SHARED / entry.path


@pytest.fixture
def servers(sft_file):
    raw = {e.remote: _local(e) for e in ENTRIES if e.source == "arpo_repo"}
    with Loopback(raw) as r, HubLoopback({f"{HUB['repo_id']}/{e.remote}": sft_file for e in ENTRIES
                                           if e.source == "arpo_sft_hub"}) as h:
        yield r, h


def run_cli(args, servers, tmp_path, *, prefix=()) -> subprocess.CompletedProcess:
    raw, hub = servers
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "ARPO_DATA_RAW_URL": raw.url,
           "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "ARPO_CACHE": str(tmp_path / "cache"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    for name in ("ARPO_DATA", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # conftest's offline defaults: hub client off
        env.pop(name, None)
    return subprocess.run([*prefix, sys.executable, "-m", "arpo_jax.cli", "data", *args, "--no-progress"]
                          if args[0] == "fetch" else [*prefix, sys.executable, "-m", "arpo_jax.cli", "data", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if p.is_file())


def test_fetch_gives_the_reference_files_then_a_second_run_downloads_nothing(servers, tmp_path, sft_file):
    out = tmp_path / "data"
    r = run_cli(["fetch", "--to", str(out)], servers, tmp_path)
    assert r.returncode == 0, r.stderr
    for e in ENTRIES:
        expected = manifest.sha256_of(sft_file if e.group == "sft" else _local(e))
        assert manifest.sha256_of(out / e.path) == expected, e.path
    assert (out / "eval/hle/test.jsonl").read_bytes() == (SHARED / "eval/hle/test.jsonl").read_bytes()  # renamed
    assert "all 20 file(s) present" in r.stdout
    assert _leftovers(out) == []
    check = run_cli(["check", str(out)], servers, tmp_path)
    assert check.returncode == 0 and check.stdout.count("  present  ") == len(ENTRIES), check.stdout
    for s in servers:
        s.requests.clear()
    again = run_cli(["fetch", "--to", str(out)], servers, tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["written"] == []
    assert servers[0].requests == [] and servers[1].requests == []  # checked, nothing downloaded


def test_a_dropped_connection_is_resumed_with_a_range_request(servers, tmp_path):
    raw, _ = servers
    entry = next(e for e in ENTRIES if e.name == "train_10k")
    raw.drop.add(entry.remote)
    out = tmp_path / "data"
    r = run_cli(["fetch", "--to", str(out), "--only", "train_10k"], servers, tmp_path)
    assert r.returncode == 0, r.stderr
    ranges = [rng for _, key, rng in raw.requests if key == entry.remote]
    resumed = int(ranges[1].removeprefix("bytes=").rstrip("-"))  # where the saved part ends (whole blocks)
    assert ranges[0] == "" and len(ranges) == 2 and 0 < resumed <= entry.bytes // 2, ranges
    assert manifest.sha256_of(out / entry.path) == entry.sha256


def test_a_corrupted_byte_is_refused_and_named(servers, tmp_path):
    raw, _ = servers
    entry = next(e for e in ENTRIES if e.name == "valid")
    raw.corrupt.add(entry.remote)
    out = tmp_path / "data"
    r = run_cli(["fetch", "--to", str(out), "--only", "rl"], servers, tmp_path)
    assert r.returncode == 1
    assert f"arpo-jax data fetch: {entry.path}: the download from {raw.url}/{entry.remote} has sha256" in r.stderr
    assert "refused" in r.stderr and not (out / entry.path).exists()
    assert (out / "rl/train_10k.parquet").is_file()  # the others are fetched anyway
    assert re.search(r"^rl/valid.parquet +missing", r.stdout, re.M) and "--only valid" in r.stdout
    assert _leftovers(out) == [] and not list((tmp_path / "cache" / "data").glob("*.part"))  # starts over next time


def test_a_404_names_the_file_and_its_source(servers, tmp_path):
    raw, hub = servers
    gsm8k = next(e for e in ENTRIES if e.name == "gsm8k")
    raw.missing.add(gsm8k.remote)
    hub.missing.add(f"{HUB['repo_id']}/final_sft_edition9.json")
    r = run_cli(["fetch", "--to", str(tmp_path / "data"), "--only", "gsm8k,sft"], servers, tmp_path)
    assert r.returncode == 1
    assert (f"eval/gsm8k/test.jsonl: HTTP 404 Not Found at {raw.url}/{gsm8k.remote} (source arpo_repo: "
            "RUC-NLPIR/ARPO") in r.stderr
    assert f"sft/arpo_sft.json: not found on the hub: {HUB['repo_id']} (dataset)" in r.stderr


def test_a_hub_file_that_does_not_match_its_etag_is_refused(servers, tmp_path):
    _, hub = servers
    hub.corrupt.add(f"{HUB['repo_id']}/final_sft_edition9.json")
    out = tmp_path / "data"
    r = run_cli(["fetch", "--to", str(out), "--only", "sft"], servers, tmp_path)
    assert r.returncode == 1 and "sft/arpo_sft.json: the hub's" in r.stderr and "refused" in r.stderr, r.stderr
    assert not (out / "sft/arpo_sft.json").exists()


def test_a_full_disk_gives_one_line_and_leaves_nothing(servers, tmp_path):
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no unprivileged mount namespace here (unshare -rm): cannot mount a small file system")
    out = tmp_path / "small"
    out.mkdir()
    # A 1 MiB tmpfs as the data folder, in a mount namespace of its own (the loopback servers stay reachable).
    mount = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs {out} && exec "$@"', "sh"]
    r = run_cli(["fetch", "--to", str(out), "--only", "rl"], servers, tmp_path, prefix=mount)
    assert r.returncode == 1
    assert f"rl/train_10k.parquet: no space left in {out}/rl" in r.stderr and "nothing was written" in r.stderr
    assert not list(out.rglob("*.tmp")) and not (out / "rl/train_10k.parquet").exists()


def test_pack_then_fetch_from_the_tarball(servers, tmp_path):
    tarball = tmp_path / "arpo_data.tar.gz"
    r = run_cli(["pack", str(SHARED), "--out", str(tarball), "--only", "rl,eval,search"], servers, tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "offline"
    r = run_cli(["fetch", "--to", str(out), "--from", str(tarball), "--only", "rl,eval,search"], servers, tmp_path)
    assert r.returncode == 0, r.stderr
    assert servers[0].requests == []  # nothing from the network
    for e in manifest.select(ENTRIES, ["rl,eval,search"]):
        assert manifest.sha256_of(out / e.path) == e.sha256
    r = run_cli(["fetch", "--to", str(tmp_path / "x"), "--from", str(tarball), "--only", "sft"], servers, tmp_path)
    assert r.returncode == 1 and f"sft/arpo_sft.json: not in the tarball {tarball}" in r.stderr
    r = run_cli(["pack", str(SHARED), "--out", str(tmp_path / "all.tar")], servers, tmp_path)  # no SFT file there
    assert r.returncode == 2 and "sft/arpo_sft.json missing" in r.stderr and not (tmp_path / "all.tar").exists()


def test_check_names_wrong_checksums_and_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(SHARED / "rl", tmp_path / "rl")
    (tmp_path / "rl" / "valid.parquet").chmod(0o644)
    with open(tmp_path / "rl" / "valid.parquet", "r+b") as f:  # a changed byte inside a data page
        f.seek(20000)
        byte = f.read(1)
        f.seek(20000)
        f.write(bytes([byte[0] ^ 1]))
    (tmp_path / "rl" / "gaia_test.parquet").chmod(0o644)
    pq.write_table(pa.table({"data_source": ["x"], "question": ["y"]}), tmp_path / "rl" / "gaia_test.parquet")
    by_path = {s.entry.path: s for s in manifest.check_dir(tmp_path, ["rl"])}
    assert by_path["rl/train_10k.parquet"].status == manifest.PRESENT
    assert by_path["rl/valid.parquet"].status == manifest.WRONG_CHECKSUM
    assert by_path["rl/gaia_test.parquet"].status == manifest.WRONG_COLUMNS
    assert "no column(s) ['prompt', 'ability'" in by_path["rl/gaia_test.parquet"].found
    text = manifest.format_status(list(by_path.values()), tmp_path)
    assert text.endswith(f"2 of 5 file(s) to fetch: arpo-jax data fetch --to {tmp_path} --only valid,gaia_test")


def test_the_manifest_matches_the_reference_files():
    """Every pinned file's sha256, size, rows and columns are those of ../shared/data's copy."""
    for e in ENTRIES:
        if e.sha256:
            status = manifest.check_file(e, _local(e))
            assert status.ok and _local(e).stat().st_size == e.bytes, (e.path, status)
