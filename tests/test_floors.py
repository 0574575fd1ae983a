"""The house drawn from the code's imports: every import runs down or along a floor, never up; no circle, of
modules or of folders (a folder, or a module at the package root, imports another only if that one does not import
it back, directly or through others); nothing below the commands imports bench/. FLOORS is the one definition of
the floors (docs/ARCHITECTURE.md draws it).

Imports are read from the source with ast (also those inside functions), so the test needs nothing installed.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = "streamfusion_diffusers"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Lowest floor first. A module belongs to the floor of its longest listed prefix (dotted, whole components).
FLOORS: dict[str, tuple[str, ...]] = {
    "core": ("streamfusion_diffusers.core",),  # the layout
    "kernels, backends": ("streamfusion_diffusers.kernels", "streamfusion_diffusers.backends"),
    "context": ("streamfusion_diffusers.context",),  # the layout bound to a job: a transport and the kernels' state
    "attention": ("streamfusion_diffusers.attention",),
    "choice": ("streamfusion_diffusers.choice", "streamfusion_diffusers.models.configs"),
    "api": ("streamfusion_diffusers",),  # the package root: the public API, wired from the floors below
    "integrations": ("streamfusion_diffusers.diffusers", "streamfusion_diffusers.xdit",
                     "streamfusion_diffusers.models"),
    "parallelize": ("streamfusion_diffusers.diffusers.parallel_pipeline",),  # puts diffusers/'s parts together
    "runtime": ("streamfusion_diffusers.runtime",),
    "commands": ("streamfusion_diffusers.__main__", "streamfusion_diffusers.commands", "streamfusion_diffusers.cli",
                 "streamfusion_diffusers.xdit.__main__", "streamfusion_diffusers.bench", "streamfusion_diffusers.serve"),
}
BENCH = "streamfusion_diffusers.bench"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules this one imports (a name imported from a package counts as its submodule when
    there is one, else as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names}
    return {m for m in found if m in known and m != name}


def floor_of(name: str) -> int:
    best = max(((len(prefix), level) for level, prefixes in enumerate(FLOORS.values()) for prefix in prefixes
                if name == prefix or name.startswith(prefix + ".")), default=None)
    assert best is not None, f"{name} is on no floor: add it to FLOORS"
    return best[1]


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def folder_of(name: str) -> str:
    """A module's folder under the package (a module at the package root is its own; the root itself, "api"; a
    module FLOORS files below its folder's floor, its own too: models.configs, the model registry, is read by
    floors its folder imports)."""
    parts = name.split(".")
    folder = f"{PACKAGE}.{parts[1]}" if len(parts) > 1 else PACKAGE
    if name != folder and any(name in prefixes for prefixes in FLOORS.values()) and floor_of(name) < floor_of(folder):
        return name.removeprefix(PACKAGE + ".")
    return parts[1] if len(parts) > 1 else "api"


def folder_arrows() -> dict[tuple[str, str], list[str]]:
    """(folder, folder it imports) -> the imports behind that arrow."""
    arrows: dict[tuple[str, str], list[str]] = defaultdict(list)
    for m, targets in sorted(graph().items()):
        for t in sorted(targets):
            if folder_of(m) != folder_of(t):
                arrows[folder_of(m), folder_of(t)].append(f"{m} -> {t}")
    return arrows


def back_arrows(arrows: dict[tuple[str, str], list[str]]) -> list[str]:
    """Each arrow whose target reaches its source again (a folder circle), with its imports counted."""
    reach: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows:
        reach[a].add(b)
    changed = True
    while changed:  # the transitive closure: a few dozen folders
        changed = False
        for a in list(reach):
            more = set().union(*(reach[b] for b in reach[a])) - reach[a]
            if more:
                reach[a] |= more
                changed = True
    return [f"{a} -> {b}: {len(found)} import(s): {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}"
            for (a, b), found in sorted(arrows.items()) if a in reach[b]]


def test_every_import_runs_down_or_along_a_floor():
    names = list(FLOORS)
    upward = [f"{m} ({names[floor_of(m)]}) imports {t} ({names[floor_of(t)]})"
              for m, targets in sorted(graph().items()) for t in sorted(targets) if floor_of(t) > floor_of(m)]
    assert not upward, "imports that run back up a floor:\n" + "\n".join(upward)


def test_no_module_below_the_commands_imports_bench():
    commands = list(FLOORS).index("commands")
    found = [f"{m} imports {t}" for m, targets in sorted(graph().items()) for t in sorted(targets)
             if (t == BENCH or t.startswith(BENCH + ".")) and floor_of(m) < commands]
    assert not found, "\n".join(found)


def test_no_import_circle():
    edges, state, circles = graph(), {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_folder_import_circle():
    """Within a floor too, folders import one way: kernels and backends never each other; the commands below
    bench/, the dispatcher (cli.py) above both."""
    arrows = folder_arrows()
    assert len(arrows) > 20  # the arrows really counted
    back = back_arrows(arrows)
    assert not back, "folders that import each other (directly or through others):\n" + "\n".join(back)


def test_a_back_arrow_is_caught():
    """The check itself: one arrow added against an existing one is reported, with its import."""
    arrows = folder_arrows()
    assert not back_arrows(arrows)
    arrows["core", "context"] = ["streamfusion_diffusers.core.mesh -> streamfusion_diffusers.context"]
    found = back_arrows(arrows)
    assert any(line.startswith("core -> context: 1 import(s)") for line in found), found
