"""Code size budget and import cycles of the package (ast only: nothing is imported or run).

The budget (docs/STYLE: modules <= 600 lines (model files under arpo_jax/models/ <= 1200), classes <= 300,
functions <= 80; the commented config literals,
`get_config` of the schema and of configs/, aside) and the cycles of the import graph between arpo_jax modules, counting
function-local imports too (a cycle hidden in a function is still a cycle in the design).

  python tests/code_size.py                 # a table of what exceeds, the cycles, a final JSON line
  python tests/code_size.py --all           # also the size distribution of every function

tests/test_code_size.py runs the same checks as a ratchet: nothing new may exceed the budget, and no cycle.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "arpo_jax"
BUDGET = {"module": 600, "class": 300, "function": 80}
MODEL_MODULE_BUDGET = 1200  # STYLE.md: "a model file up to about 1200" (arpo_jax/models/)


def _lines(node: ast.AST) -> int:
    """Lines of a def or class, its decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_config_literal(path: Path, name: str) -> bool:
    """`get_config()` of the schema (config/schema.py) or of an experiment file (configs/): one commented ConfigDict
    literal, long by design."""
    return name == "get_config" and ("configs" in path.parts or path.parts[-2:] == ("config", "schema.py"))


def sizes(package: Path = PACKAGE) -> list[dict]:
    """Every module, class and function (methods and nested functions included) with its line count."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(package.parent))
        tree = ast.parse(path.read_text(), filename=rel)
        out.append({"kind": "module", "name": rel, "lines": len(path.read_text().splitlines())})
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    qual = f"{prefix}{child.name}"
                    if not (kind == "function" and is_config_literal(path, child.name)):
                        out.append({"kind": kind, "name": f"{rel}:{child.lineno} {qual}", "lines": _lines(child)})
                    stack.append((child, qual + "."))
                else:
                    stack.append((child, prefix))
    return out


def budget(item: dict) -> int:
    if item["kind"] == "module" and item["name"].startswith("arpo_jax/models/"):
        return MODEL_MODULE_BUDGET
    return BUDGET[item["kind"]]


def over_budget(items: list[dict]) -> list[dict]:
    return sorted((i for i in items if i["lines"] > budget(i)), key=lambda i: (i["kind"], -i["lines"]))


def imported_modules(tree: ast.AST, mod: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules among `modules` that the code of `mod` imports, anywhere in its body (in functions too), as
    Python resolves them: `import a.b.c` -> a.b.c; `from a.b import c` -> a.b.c when c is a submodule, otherwise
    a.b itself (its `__init__` defines or re-exports c); a relative import counts its dots from `mod`'s package
    (a package's `__init__` is its own package)."""
    package = mod.split(".") if is_package else mod.split(".")[:-1]
    deps = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + (node.module.split(".") if node.module else []))
            deps |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names}
    return {d for d in deps if d in modules and d != mod}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (imported_modules). A package's `__init__` is a module of
    its own (`arpo_jax.tools`): what it imports, and what imports a name from it, are edges like any other."""
    files = {module_name(p, package.parent): p for p in package.rglob("*.py")}
    packages = {module_name(p, package.parent) for p in package.rglob("__init__.py")}
    return {mod: imported_modules(ast.parse(path.read_text()), mod, mod in packages, set(files))
            for mod, path in files.items()}


# The pipeline's layering (README "Layout"): the stages in the order they run, from the ground; a stage imports only
# the stages of the groups before its own (a group's stages stand side by side and import none of each other).
STAGE_ORDER = (
    ("config",),  # the ground floor: the schema, the command line, the experiment files' folder
    ("data", "models", "tools", "rewards"),  # the inputs: prompts, the model (its adapters too), the tools, rewards
    ("weights",),  # the model's weights in and out: checkpoints, HF folders, PEFT adapter files
    ("rollout",),  # the engines and the tool loop
    ("experience",),  # rollout -> training batch: rewards shaped, advantages, packing (and its loss weights)
    ("update",),  # the policy update
    ("assemble",),  # config -> parts: validation against every stage's settings, the settings, engines, tools
    ("train",),  # the runs
    ("plan", "eval"),  # the commands above a run
)
_RANK = {name: i for i, group in enumerate(STAGE_ORDER) for name in group}
# stage -> the folders it must not import: its own group's other stages and every later group's.
FORBIDDEN = {name: {other for other, j in _RANK.items() if j >= i and other != name} for name, i in _RANK.items()}
# Only the commands and the run drivers validate a whole config.
VALIDATE_IMPORTERS = {"arpo_jax.cli", "arpo_jax.demo", "arpo_jax.train", "arpo_jax.eval", "arpo_jax.plan"}
# The modules allowed at the top of the package: entry points, fixtures and leaves every stage may use. A new one
# needs an entry here (and a reason it belongs to no stage).
TOP_LEVEL = {"arpo_jax", "arpo_jax.cli", "arpo_jax.demo", "arpo_jax.quickstart", "arpo_jax.testing",
             "arpo_jax.compile_log", "arpo_jax.distributed", "arpo_jax.hugepages", "arpo_jax.json_http",
             "arpo_jax.knobs", "arpo_jax.paths", "arpo_jax.sharding", "arpo_jax.device_memory"}


def stage(module: str) -> str:
    """The folder of `arpo_jax.<folder>` (its `__init__`) and of `arpo_jax.<folder>.<module>`; a top-level module
    is named by itself, which is no stage's name (TOP_LEVEL)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks FORBIDDEN or VALIDATE_IMPORTERS, as "importer -> imported"."""
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if stage(dep) in FORBIDDEN.get(stage(mod), ()):
                out.append(f"{mod} -> {dep}")
            elif dep == "arpo_jax.assemble.validate" and not any(
                    mod == v or mod.startswith(v + ".") for v in VALIDATE_IMPORTERS):
                out.append(f"{mod} -> {dep}")
    return out


def top_level_modules(package: Path = PACKAGE) -> set[str]:
    return {module_name(p) for p in package.glob("*.py")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also print the function size distribution")
    args = parser.parse_args()
    items = sizes()
    over = over_budget(items)
    print(f"{'kind':9} {'lines':>6} {'budget':>6}  name")
    for i in over:
        print(f"{i['kind']:9} {i['lines']:6d} {budget(i):6d}  {i['name']}")
    found = cycles(import_graph())
    print(f"\nlayering violations: {layering_violations(import_graph())}")
    print(f"\nimport cycles: {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
    funcs = sorted(i["lines"] for i in items if i["kind"] == "function")
    dist = {"functions": len(funcs), "median": statistics.median(funcs),
            "p90": funcs[int(0.9 * (len(funcs) - 1))], "max": funcs[-1]}
    if args.all:
        print("\nfunction sizes:", dist)
    print(json.dumps({"over_budget": {k: sum(i["kind"] == k for i in over) for k in BUDGET},
                      "cycles": len(found), "modules": sum(i["kind"] == "module" for i in items),
                      "lines": sum(i["lines"] for i in items if i["kind"] == "module"), **dist}))


if __name__ == "__main__":
    main()
