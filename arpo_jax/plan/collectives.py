"""The communication of a compiled program: every collective XLA's SPMD partitioner put in it, how often it runs
and how many bytes each device moves for it.

Read from the HLO right after SPMD partitioning (`compile_partitioned`), which is the same on every backend; the
backends' later passes only fuse, combine and schedule these collectives (and a GPU/TPU turns an all-reduce whose
result each device slices into a reduce-scatter: counted here as that reduce-scatter). A collective inside a loop
counts once per iteration: the trip count of a `lax.scan` / `fori_loop` is read from its condition (`i < N`); a
loop whose bound is a runtime value counts once and makes the result a lower bound (`exact` False).

Bytes per device are those of the usual ring algorithms, with g devices in a group and a buffer of b bytes (the
gathered / reduced array): all-gather and reduce-scatter (g - 1) / g x b, all-reduce 2 (g - 1) / g x b, all-to-all
(g - 1) / g x b, collective-permute b. A group "crosses hosts" when its devices lie on more than one host
(`per_host` consecutive devices of the program's device order are one host, as `sharding.make_mesh` orders them).
These are the bytes the program asks for: XLA's later passes may combine collectives, overlap them with compute
or hoist a loop-invariant one out of its loop, which changes their time, not (except hoisting) their bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) .*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS (an all-reduce that each device slices is a reduce-scatter)
    buffer_bytes: int  # the gathered / reduced array (of one device's result for an all-gather)
    group: int  # devices per replica group
    crosses_hosts: bool
    runs: int  # executions per program run (the product of its enclosing loops' trip counts)
    op: str  # the jax op it comes from (HLO metadata), for reading

    @property
    def bytes_per_device(self) -> float:
        g = self.group
        if g <= 1:
            return 0.0
        share = (g - 1) / g
        factor = {"all-reduce": 2 * share, "collective-permute": 1.0}.get(self.kind, share)
        return factor * self.buffer_bytes * self.runs


def compile_partitioned(lowered) -> tuple[jax.stages.Compiled, str]:
    """`lowered.compile()`, and the program's HLO text right after SPMD partitioning ("" on one device: none).

    JAX's persistent compilation cache leaves the dump options out of its key: with the cache on (a run's, the
    tests', `JAX_COMPILATION_CACHE_DIR`), a program compiled before came back from it without a dump, and its
    collectives were silently missing. So this compile bypasses the cache (neither read nor written)."""
    with tempfile.TemporaryDirectory() as d, _without_persistent_cache():
        compiled = lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        files = sorted(Path(d).glob("*after_spmd-partitioning*.txt"))
        return compiled, files[-1].read_text() if files else ""


@contextlib.contextmanager
def _without_persistent_cache():
    """JAX's persistent compilation cache off inside, as configured before after. JAX decides once per process
    whether the cache is used (`reset_cache` makes it decide again, from `jax_enable_compilation_cache`)."""
    before = jax.config.jax_enable_compilation_cache
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def _array_bytes(shape: str) -> int:
    """Bytes of an HLO shape (summed over a tuple's arrays)."""
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _ARRAY.findall(shape))


def replica_groups(text: str) -> list[list[int]] | None:
    """The device groups of an HLO `replica_groups=` value: `{{0,1},{2,3}}`, `[2,4]<=[8]`, `[2,4]<=[4,2]T(1,0)`
    or Shardy's `mesh['axis_0'=2,'axis_1'=4] {'axis_0'}` (the program's devices in order, reshaped to the mesh;
    a group varies the axes in braces), optionally with `, device_ids=([4,2]T(1,0))` (the devices in that order:
    an iota of that shape, transposed, flattened). None when not understood."""
    text = text.strip()
    if m := re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", text):
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        varying = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
        ids = _iota(m.group(2) or ",".join(map(str, sizes)), m.group(3)).reshape(sizes)
        fixed = [i for i in range(len(sizes)) if i not in varying]
        return ids.transpose(fixed + varying).reshape(-1, math.prod(sizes[i] for i in varying)).tolist()
    if m := re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text):
        return _iota(m.group(2), m.group(3)).reshape(int(m.group(1).split(",")[0]), -1).tolist()
    if m := re.match(r"\{(\{[\d,{} ]*\})\}", text):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return None


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """HLO's iota device list `[dims]T(perm)`: 0..n-1 shaped `dims`, transposed by `perm` when given."""
    ids = np.arange(math.prod(int(x) for x in dims.split(","))).reshape([int(x) for x in dims.split(",")])
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    comps, entry, current = {}, "", None
    for line in hlo.splitlines():
        if (m := _COMPUTATION.match(line)) and not line.startswith(" "):
            current = m.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and line.startswith(" "):
            comps[current].append(line)
    return comps, entry


def _trip_count(condition: list[str]) -> int | None:
    """N of a loop whose condition is `i < N` with N a constant of the condition computation."""
    constants = {m.group(1): int(m.group(2)) for line in condition
                 if (m := re.match(r"\s*%([\w.-]+) = s(?:32|64)\[\] constant\((-?\d+)\)", line))}
    for line in condition:
        if line.lstrip().startswith("ROOT") and "compare(" in line and "direction=LT" in line:
            args = re.search(r"compare\(%([\w.-]+), %([\w.-]+)\)", line)
            if args and args.group(2) in constants:
                return constants[args.group(2)]
    return None


def _runs(comps: dict[str, list[str]], entry: str) -> tuple[dict[str, int], set[str]]:
    """Executions of each computation per program run; and the computations inside a loop whose trip count is not
    a constant (counted as one iteration)."""
    calls: dict[str, list[tuple[str, int | None]]] = {name: [] for name in comps}
    for name, lines in comps.items():
        for line in lines:
            if " while(" in line:
                cond = re.search(r"condition=%([\w.-]+)", line).group(1)
                body = re.search(r"body=%([\w.-]+)", line).group(1)
                calls[name].append((body, _trip_count(comps.get(cond, []))))
                continue
            for callee in re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%([\w.-]+)", line):
                calls[name].append((callee, 1))
            if m := re.search(r"branch_computations=\{([^}]*)\}", line):
                calls[name] += [(c, 1) for c in re.findall(r"%([\w.-]+)", m.group(1))]
    runs: dict[str, int] = {}
    uncertain: set[str] = set()

    def visit(name: str, times: int, known: bool, depth: int = 0) -> None:
        runs[name] = runs.get(name, 0) + times
        if not known:
            uncertain.add(name)
        for callee, trips in calls.get(name, ()):
            if depth < 64:
                visit(callee, times * (trips or 1), known and trips is not None, depth + 1)

    visit(entry, 1, True)
    return runs, uncertain


def collectives(hlo: str, per_host: int = 0) -> tuple[list[Collective], bool]:
    """Every collective of a partitioned program (`compile_partitioned`) with its runs per program run; and whether
    every enclosing loop's trip count was known (else the runs are lower bounds)."""
    comps, entry = _computations(hlo)
    runs, uncertain = _runs(comps, entry)
    out, exact = [], True
    for name, lines in comps.items():
        if not runs.get(name):
            continue
        sliced = {m.group(1) for line in lines if (m := re.search(r" dynamic-slice\(%([\w.-]+),", line))}
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(3).removesuffix("-start") not in KINDS:
                continue
            kind = m.group(3).removesuffix("-start")
            groups_text = re.search(r"replica_groups=(mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\)\))?\s*\{[^}]*\}"
                                    r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?|\{(?:\{[\d,]*\},?)*\})", m.group(4))
            groups = replica_groups(groups_text.group(1)) if groups_text else None
            if kind == "collective-permute":
                groups = [[0, 1]]  # one send and one receive per device
            group = len(groups[0]) if groups else 1
            crosses = bool(per_host) and any(len({d // per_host for d in g}) > 1 for g in (groups or []))
            if kind == "all-reduce" and m.group(1) in sliced:
                kind = "reduce-scatter"  # what GPU/TPU compile it to (each device keeps its slice)
            op = re.search(r'op_name="([^"]*)"', m.group(4))
            exact &= name not in uncertain
            out.append(Collective(kind, _array_bytes(m.group(2)), group, crosses, runs[name],
                                  op.group(1) if op else ""))
    return out, exact


def summary(items: list[Collective]) -> dict[str, float]:
    """Bytes per device by kind, plus the total and the part over groups that cross hosts."""
    out = {k: 0.0 for k in KINDS}
    for c in items:
        out[c.kind] += c.bytes_per_device
    out = {k: v for k, v in out.items() if v}
    out["total"] = sum(out.values())
    out["across_hosts"] = sum(c.bytes_per_device for c in items if c.crosses_hosts)
    return out
