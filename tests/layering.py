"""The import rule of docs/architecture.md, checked from source: layers, cycles, lazy imports.

    python tests/layering.py [ROOT]     # prints each violation, exits 1 when there is one

Reads every product file with `ast` (nothing is imported) and reports:
- an import of a project package that the importer's layer may not use (an upward import);
- a third-party module used outside the layers that may use it, or a private module of a
  pinned dependency (`monarch._...`) outside its compat module;
- an import cycle between project modules, counting imports made inside functions;
- a function-level import without a `# lazy: <reason>` comment on the line above its block;
- a project package imported by its bare folder name (`import envs`, `from mesh.api import Run`) anywhere in the
  product, `tests/` or `benchmarks/`: the one spelling is `composer_mesh.<package>`.
`TYPE_CHECKING` blocks are ignored: they never run.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

NAMESPACE = "composer_mesh"
# Lowest first; `configs.jobs` holds Monarch job files, so it sits with `mesh`.
LAYERS: dict[str, frozenset[str]] = {
    "configs": frozenset(),
    "losses": frozenset({"configs"}),
    "replay": frozenset({"configs"}),
    "envs": frozenset({"configs"}),
    "titan_ext": frozenset({"configs", "losses"}),
    "actors": frozenset({"configs", "losses", "replay", "envs", "titan_ext"}),
    "mesh": frozenset({"configs", "losses", "replay", "envs", "titan_ext", "actors", "mesh.jobs"}),
}
SUBLAYERS = {"configs.jobs": "mesh"}
# Third-party roots and the layers allowed to import them.
THIRD_PARTY = {
    "monarch": {"actors", "mesh"},
    "torchtitan": {"titan_ext", "actors", "mesh"},
    "torchft": {"titan_ext", "actors", "mesh"},
    "vllm": {"actors", "mesh"},
}
# Private modules of pinned dependencies: only their compat module may import them.
PRIVATE_ROOTS = {"monarch": "actors.monarch_compat", "torchtitan": "titan_ext.torchtitan_compat",
                 "torchft": "titan_ext.torchft_compat"}
LAZY_MARK = "# lazy:"


@dataclass
class Module:
    name: str  # dotted project name without the namespace, e.g. "actors.generator"
    path: Path
    layer: str
    imports: list[tuple[int, str, bool]] = field(default_factory=list)  # (line, module, in a function)


def layer_of(name: str) -> str:
    for prefix, layer in SUBLAYERS.items():
        if name == prefix or name.startswith(prefix + "."):
            return layer
    return name.split(".")[0]


def _strip_ns(name: str) -> str:
    return name[len(NAMESPACE) + 1:] if name.startswith(NAMESPACE + ".") else name


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_func: bool):
    """Yield (import node, in_func), skipping TYPE_CHECKING blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            yield from ((n, in_func) for s in child.orelse for n in [s] if isinstance(n, (ast.Import, ast.ImportFrom)))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_func
        else:
            nested = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _walk(child, nested)


def collect(root: Path) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for pkg in LAYERS:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            name = ".".join(parts)
            modules[name] = Module(name, path, layer_of(name))
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(), str(mod.path))
        is_pkg = mod.path.name == "__init__.py"
        for node, in_func in _walk(tree, False):
            if isinstance(node, ast.Import):
                targets = [_strip_ns(a.name) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = mod.name.split(".")
                    anchor = anchor if is_pkg else anchor[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                base = _strip_ns(base)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                mod.imports.append((node.lineno, t, in_func))
    return modules


def _resolve(target: str, modules: dict[str, Module]) -> str | None:
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules:
            return name
        parts.pop()
    return None


def check_layers(modules: dict[str, Module]) -> list[str]:
    out = []
    for mod in modules.values():
        for line, target, _ in mod.imports:
            root = target.split(".")[0]
            where = f"{mod.path}:{line}"
            if root in LAYERS:
                tlayer = layer_of(target)
                allowed = LAYERS[mod.layer] | {mod.layer}
                if tlayer not in allowed and not (tlayer == "mesh" and "mesh" in allowed):
                    out.append(f"{where}: layer '{mod.layer}' imports '{target}' (layer '{tlayer}'): "
                               f"may import only {sorted(LAYERS[mod.layer])}")
                continue
            if root in THIRD_PARTY and mod.layer not in THIRD_PARTY[root]:
                out.append(f"{where}: layer '{mod.layer}' imports '{target}' (allowed in {sorted(THIRD_PARTY[root])})")
            private = any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:])
            if root in PRIVATE_ROOTS and private and mod.name != PRIVATE_ROOTS[root]:
                out.append(f"{where}: private module '{target}' outside its compat module {PRIVATE_ROOTS[root]}")
    return out


def find_cycles(modules: dict[str, Module]) -> list[list[str]]:
    graph = {m: sorted({r for _, t, _ in mod.imports if (r := _resolve(t, modules)) and r != m})
             for m, mod in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan, iterative over an explicit work stack
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    sccs.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return sccs


def check_lazy(modules: dict[str, Module]) -> list[str]:
    out = []
    for mod in modules.values():
        lines = mod.path.read_text().splitlines()
        for line, target, in_func in mod.imports:
            if not in_func:
                continue
            i = line - 2  # the line above, 0-based
            while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
                i -= 1
            if i < 0 or not lines[i].strip().startswith(LAZY_MARK):
                out.append(f"{mod.path}:{line}: function-level import of '{target}' without a "
                           f"'{LAZY_MARK} <reason>' comment above its block")
    return out


def check_spelling(root: Path) -> list[str]:
    """Absolute imports of a project package by its folder name, in every product, test and benchmark file."""
    out = []
    for top in (*LAYERS, "tests", "benchmarks"):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
                out += [f"{path}:{node.lineno}: '{name}' imported by its folder name: spell it "
                        f"'{NAMESPACE}.{name}'" for name in names if name and name.split(".")[0] in LAYERS]
    return out


def check(root: Path) -> list[str]:
    modules = collect(root)
    problems = check_layers(modules) + check_lazy(modules) + check_spelling(root)
    problems += [f"import cycle: {' -> '.join(c)}" for c in find_cycles(modules)]
    return problems


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1]
    problems = check(root)
    for p in problems:
        print(p)
    print(f"[layering] {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
