"""The import contract: every module of ``ckptturbo/`` and ``integrations/`` imports only
modules of its own layer or of layers below it, and no import circle exists, counting
imports inside functions and under ``TYPE_CHECKING`` (an import that only type checkers
run still ties the two modules together for a reader). The layers are
docs/architecture.md's; a new module is placed in ``LAYERS`` below, or this test names it.
Adapters import only the core's surface for them (``ADAPTER_SURFACE``).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ckptturbo": ROOT / "ckptturbo", "ckptturbo.integrations": ROOT / "integrations"}
SKIPPED = ("ckptturbo.testing",)  # the tests' helpers: the library never imports them

# From the bottom. A module may import its own layer and those below; "pkg.*" places every
# module of a subpackage, its face (``__init__``) included.
LAYERS: list[tuple[str, list[str]]] = [
    ("foundations", ["errors", "retry", "urls", "chunks", "checkpoint_id", "tree", "failures",
                     "agreement", "results"]),
    ("storage", ["chunk_store", "store", "groups"]),
    ("format", ["paths", "manifest_records", "manifest_migration", "manifest_codec", "manifest",
                "delta_codec", "manifest_delta"]),
    ("run I/O", ["runs", "lease", "chunk_index", "integrity", "chunk_source"]),
    ("runtime", ["runtime", "shutdown"]),
    ("catalog", ["catalog"]),
    ("planning", ["plan", "plan.*", "save_plan", "save_groups", "replicas",
                  "broadcast_schedule"]),
    ("pipelines", ["staging", "prefetch", "broadcast", "assemble", "upload", "planner", "writer",
                   "async_save", "readonce", "chunk_cache", "reader", "stream", "stream.*",
                   "changes", "delta_save", "dcp_protocol"]),
    ("tiers", ["tiers", "peers", "persist", "eviction", "tiered_catalog", "recovery",
               "tiered_save"]),
    ("operations", ["operations"]),
    ("api", ["session", "api", "adapter_support"]),
    ("entry points", ["cli", "export", "integrations", "integrations.*"]),
]
# What an adapter may import of the core: the public names, the errors, the streamer and
# the one module written for them (docs/architecture.md), never a core module's insides.
ADAPTER_SURFACE = {"ckptturbo", "ckptturbo.errors", "ckptturbo.stream",
                   "ckptturbo.adapter_support"}
# Package faces re-export their members: importing one is importing its layer, and the
# root face (``import ckptturbo as ct``, ``__version__``) is for the entry points only.
ROOT_FACE = "ckptturbo"


def modules() -> dict[str, Path]:
    found = {}
    for package, directory in PACKAGES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            if not name.startswith(SKIPPED):
                found[name] = path
    return found


def layer_of(module: str) -> int:
    short = module.removeprefix("ckptturbo.")
    if module == ROOT_FACE:
        return len(LAYERS) - 1
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if short == member or (member.endswith(".*") and short.startswith(member[:-1])):
                return index
    raise LookupError(module)


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of the project, line) for every import statement in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from . import catalog` imports the module catalog; `from .x import y`, module x
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for target in set(targets):
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.append((target, node.lineno))
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def where(module: str, line: int) -> str:
    return f"{modules()[module].relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer():
    unplaced = []
    for module in modules():
        try:
            layer_of(module)
        except LookupError:
            unplaced.append(module)
    assert not unplaced, f"place these modules in a layer of LAYERS: {unplaced}"


def test_imports_point_down():
    upward = []
    for module, targets in graph().items():
        for target, line in targets:
            if target == ROOT_FACE and module.startswith(("ckptturbo.integrations",)):
                continue
            if target == ROOT_FACE and layer_of(module) < len(LAYERS) - 1:
                upward.append(f"{where(module, line)}: {module} imports the package face")
            elif layer_of(target) > layer_of(module):
                upward.append(f"{where(module, line)}: {module} ({LAYERS[layer_of(module)][0]})"
                              f" imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_adapters_use_the_adapter_surface_only():
    inside = [f"{where(module, line)}: {module} imports {target}"
              for module, targets in graph().items() if module.startswith("ckptturbo.integrations")
              for target, line in targets
              if not target.startswith("ckptturbo.integrations") and target not in ADAPTER_SURFACE]
    assert not inside, "adapters reaching into the core (use ckptturbo.adapter_support):\n" + \
        "\n".join(inside)


def test_no_import_circles():
    faces = {m for m, p in modules().items() if p.name == "__init__.py"}
    edges = {m: {t for t, _ in ts if t not in faces} for m, ts in graph().items() if m not in faces}
    circles = [c for c in _strongly_connected(edges) if len(c) > 1]
    lines = []
    for circle in circles:
        members = set(circle)
        inside = [where(m, line) + f": {m} imports {t}"
                  for m in sorted(circle) for t, line in graph()[m] if t in members]
        lines.append(f"circle of {len(circle)}: {sorted(circle)}\n  " + "\n  ".join(inside))
    assert not circles, "\n".join(lines)


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


def report() -> str:
    """The import graph in numbers: modules, modules per layer, upward imports, circles and
    their members, modules over 600 lines. ``python -m tests.test_architecture [ROOT]``
    prints it for this checkout or another one (an older commit's, to compare)."""
    graph_now = graph()
    faces = {m for m, p in modules().items() if p.name == "__init__.py"}
    placed: dict[str, int] = {}
    unplaced = []
    for module in graph_now:
        try:
            placed[module] = layer_of(module)
        except LookupError:
            unplaced.append(module)
    upward = sum(1 for m, ts in graph_now.items() for t, _ in ts
                 if m in placed and t in placed and placed[t] > placed[m])
    edges = {m: {t for t, _ in ts if t not in faces} for m, ts in graph_now.items()
             if m not in faces}
    circles = [sorted(c) for c in _strongly_connected(edges) if len(c) > 1]
    long = [f"{m} ({n} lines)" for m, p in modules().items()
            if (n := len(p.read_text().splitlines())) > 600]
    lines = [f"modules: {len(graph_now)}",
             *(f"  layer {name}: {sum(1 for v in placed.values() if v == i)}"
               for i, (name, _) in enumerate(LAYERS)),
             f"  in no layer: {len(unplaced)} {sorted(unplaced) if unplaced else ''}",
             f"upward imports (between placed modules): {upward}",
             f"circles: {len(circles)}",
             *(f"  circle of {len(c)}: {', '.join(m.removeprefix('ckptturbo.') for m in c)}"
               for c in circles),
             f"modules over 600 lines: {long or 0}"]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        ROOT = Path(sys.argv[1]).resolve()
        PACKAGES = {"ckptturbo": ROOT / "ckptturbo",
                    "ckptturbo.integrations": ROOT / "integrations"}
    print(report())
