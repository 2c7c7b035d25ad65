"""benchmarks/ as a newcomer reads it (issue 71): RESULTS.md's headline table has short cells and every row links to
a heading of RESULTS.md (where the latest measurement of its figure is), every local link of RESULTS.md and of
benchmarks/history/ resolves, and benchmarks/README.md names every script under benchmarks/. Each check is a
function of the text, run on the real files and on a planted violation."""

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MAX_CELL = 200


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (word characters, '-' and ' ' kept), spaces to
    '-'; a repeated heading gets -1, -2, ... (see anchors)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings (outside code fences)."""
    out, seen, fence = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.+)", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def headline_rows(text: str) -> list[str]:
    """The rows of the table under "## Headline numbers" (header and separator row left out)."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            inside = line.strip() == "## Headline numbers"
        elif inside and line.startswith("|"):
            rows.append(line)
    return rows[2:]


def link_targets(text: str, row: str) -> list[str]:
    """A row's link targets: inline `[x](target)` and reference `[x][ref]` (with `[ref]: target` in text)."""
    refs = dict(re.findall(r"^\[([^\]]+)\]: *(\S+)", text, re.M))
    return re.findall(r"\]\(([^)\s]+)\)", row) + [refs.get(r, "") for r in re.findall(r"\]\[([^\]]+)\]", row)]


def headline_problems(text: str) -> list[str]:
    out, heads = [], anchors(text)
    rows = headline_rows(text)
    if not rows:
        return ["no headline table"]
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        out += [f"cell of {len(c)} characters: {c[:60]}..." for c in cells if len(c) > MAX_CELL]
        targets = link_targets(text, row)
        if not any(t.startswith("#") and t[1:] in heads for t in targets):
            out.append(f"no link to a heading of RESULTS.md: {row[:80]}...")
        out += [f"dangling link {t}: {row[:60]}..." for t in targets if t.startswith("#") and t[1:] not in heads]
    return out


def local_link_problems(path: Path, text: str) -> list[str]:
    """Links of a markdown file to another local file (with or without #anchor) or to its own headings."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]: *(\S+)", text, re.M):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, frag = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{path.name}: {target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text()):
            out.append(f"{path.name}: {target} (no such heading)")
    return out


def scripts(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in (".py", ".sh"))


def unnamed_scripts(names: list[str], index: str) -> list[str]:
    """Scripts the index does not name as `group/name.py` (in backticks)."""
    return [n for n in names if f"`{n}`" not in index]


def test_the_headline_table_has_short_cells_each_row_linked_to_a_heading():
    assert headline_problems((BENCH / "RESULTS.md").read_text()) == []


def test_results_and_history_links_resolve():
    files = [BENCH / "RESULTS.md", *sorted((BENCH / "history").glob("*.md"))]
    assert len(files) > 1
    assert [p for f in files for p in local_link_problems(f, f.read_text())] == []


def test_every_script_is_named_in_the_index():
    names = scripts(BENCH)
    assert "device/gpu_scale.py" in names and "trace_summary.py" in names
    assert unnamed_scripts(names, (BENCH / "README.md").read_text()) == []


def test_the_checks_find_planted_violations(tmp_path):
    text = (BENCH / "RESULTS.md").read_text()
    rows = headline_rows(text)
    row = next(r for r in rows if "][" in r)  # a row with a reference link, `[Topic][ref]`
    link = re.search(r"\[[^\]]+\]\[[^\]]+\]", row).group(0)
    planted = [row.replace(" | ", " | " + "x" * MAX_CELL + " ", 1),  # a cell past 200 characters
               row.replace(link, "Demo"),  # no link
               row.replace(link, "[Demo][no-such-ref]"),  # a reference nobody defines
               row.replace(link, "[Demo](#no-such-heading)")]  # a link to no heading
    for bad in planted:
        assert headline_problems(text.replace(row, bad, 1)), bad
    assert headline_problems("# t\n\n## Headline numbers\n\nno table\n") == ["no headline table"]
    (tmp_path / "a.md").write_text("# A\n\n[b](b.md#nowhere) [c](c.md) [self](#a)\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert local_link_problems(tmp_path / "a.md", (tmp_path / "a.md").read_text()) == [
        "a.md: b.md#nowhere (no such heading)", "a.md: c.md (no such file)"]
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "new_bench.py").write_text("")
    assert unnamed_scripts(scripts(tmp_path), "- `engine/other.py`: ...") == ["engine/new_bench.py"]
    assert anchors("# Demo — `a.py`\n```\n# not a heading\n```\n## Demo — `a.py`\n") == {"demo--apy", "demo--apy-1"}
