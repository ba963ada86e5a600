"""The package layout: imports flow one way and no module imports itself back through others.

    disco_ray.graph  <-  planner, actors, workloads  <-  disco_ray.driver
                     <-  disco_ray.bench, disco_ray.models, disco_ray.frontend  <-  disco_ray.cli

Every import counts, those inside functions too (a lazy import is still a dependency). The
`disco_ray` package itself is a facade that may import anything, lazily.

Inside actors/, floors by concept (`ACTOR_FLOORS`): backends, tiers and transports are plugged
into the worker and know nothing of it (backends/ and tiers/ import only themselves,
transports/ only themselves and the backend contract), and the worker's and coordinator's
cores import no Ray: only the Ray shells (worker.py, coordinator.py) and the transports that
move bytes through Ray do.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("disco_ray", "planner", "actors", "workloads")
# layer of each package (a module may import its own layer's package and lower layers)
LAYERS = {
    "disco_ray.graph": 0,
    "planner": 1,
    "actors": 1,
    "workloads": 1,
    "disco_ray.driver": 2,
    "disco_ray.bench": 3,  # the bench runs Programs
    "disco_ray.models": 3,
    "disco_ray.frontend": 3,
    "disco_ray.cli": 4,
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def imports(mods: dict[str, Path], unresolved: list[str] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it imports (resolved to the longest known module name).

    A `from X import ...` of the project whose X is no module is appended to `unresolved`.
    """
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" for a in node.names]
                if prefix.split(".")[0] in PACKAGES and prefix not in mods and unresolved is not None:
                    unresolved.append(f"{name}: from {'.' * node.level}{node.module or ''} import ...")
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


# actors/ subpackage (or module) -> the actors modules it may import (prefixes)
ACTOR_FLOORS = {
    "actors.backends": ("actors.backends",),
    "actors.tiers": ("actors.tiers",),
    "actors.transports": ("actors.transports", "actors.backends.base"),
}
RAY_SHELLS = (
    "actors.worker",
    "actors.coordinator",
    "actors.transports.objectstore",
    "actors.transports.cuda",
)


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def external_imports(path: Path) -> set[str]:
    """The top-level names of every package a module imports (inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports of actors modules below the floor of the importer's concept (`ACTOR_FLOORS`)."""
    bad = []
    for m, deps in graph.items():
        for pkg, allowed in ACTOR_FLOORS.items():
            if not under(m, pkg):
                continue
            for d in deps:
                if under(d, "actors") and not any(under(d, a) for a in allowed):
                    bad.append(f"{m} ({pkg}) imports {d}")
    return sorted(bad)


def ray_in_core(mods: dict[str, Path], graph: dict[str, set[str]]) -> list[str]:
    """actors modules outside the Ray shells that import Ray, or import a Ray shell."""
    core = [m for m in mods if under(m, "actors") and not any(under(m, s) for s in RAY_SHELLS)]
    bad = [f"{m} imports ray" for m in core if "ray" in external_imports(mods[m])]
    bad += [f"{m} imports the Ray shell {d}" for m in core for d in graph[m] if d in RAY_SHELLS]
    return sorted(bad)


def layer_of(module: str) -> tuple[str, int] | None:
    for pkg, n in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == pkg or module.startswith(pkg + "."):
            return pkg, n
    return None  # the disco_ray facade (__init__, __main__)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a higher layer, or of another package of the same layer."""
    bad = []
    for m, deps in graph.items():
        mine = layer_of(m)
        if mine is None:
            continue
        for d in deps:
            theirs = layer_of(d)
            if theirs is None:
                bad.append(f"{m} imports the facade {d}")
            elif theirs[1] > mine[1] or (theirs[1] == mine[1] and theirs[0] != mine[0]):
                bad.append(f"{m} ({mine[0]}) imports {d} ({theirs[0]})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_imports_flow_one_way():
    bad = upward_imports(imports(modules()))
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    assert not cycles(imports(modules()))


def test_actors_floors_by_concept():
    mods = modules()
    assert {"actors.backends.base", "actors.transports.base", "actors.tiers.base"} <= set(mods)
    graph = imports(mods)
    bad = floor_violations(graph) + ray_in_core(mods, graph)
    assert not bad, "\n".join(bad)


def test_every_project_import_names_a_module_that_exists():
    unresolved: list[str] = []
    imports(modules(), unresolved)
    assert not unresolved, unresolved


def test_the_checks_catch_a_planted_cycle_and_an_upward_import(tmp_path):
    (tmp_path / "graph").mkdir()
    mods = {
        "disco_ray.graph": tmp_path / "graph" / "__init__.py",
        "disco_ray.graph.a": tmp_path / "a.py",
        "disco_ray.graph.b": tmp_path / "b.py",
        "disco_ray.driver.c": tmp_path / "c.py",
    }
    mods["disco_ray.graph"].write_text("")
    mods["disco_ray.graph.a"].write_text("def f():\n    from disco_ray.graph import b\n")  # lazy counts
    mods["disco_ray.graph.b"].write_text("from .a import f\nfrom disco_ray.driver.c import g\n")
    mods["disco_ray.driver.c"].write_text("g = 1\nfrom .gone import h\n")
    unresolved: list[str] = []
    graph = imports(mods, unresolved)
    assert unresolved == ["disco_ray.driver.c: from .gone import ..."]
    assert cycles(graph) == [["disco_ray.graph.a", "disco_ray.graph.b"]]
    assert upward_imports(graph) == [
        "disco_ray.graph.b (disco_ray.graph) imports disco_ray.driver.c (disco_ray.driver)"
    ]


def test_the_floor_checks_catch_a_backend_importing_the_executor_and_ray_in_the_core(tmp_path):
    mods = {
        "actors.backends.x": tmp_path / "x.py",
        "actors.transports.y": tmp_path / "y.py",
        "actors.executor": tmp_path / "executor.py",
        "actors.backends.base": tmp_path / "base.py",
        "actors.worker": tmp_path / "worker.py",
    }
    mods["actors.backends.x"].write_text(
        "from actors.backends import base\ndef f():\n    from actors import executor\n"
    )
    mods["actors.transports.y"].write_text("from ..backends.base import Mode\n")
    mods["actors.executor"].write_text("import ray.exceptions\nfrom . import worker\n")
    mods["actors.backends.base"].write_text("Mode = 0\n")
    mods["actors.worker"].write_text("import ray\n")
    graph = imports(mods)
    assert floor_violations(graph) == ["actors.backends.x (actors.backends) imports actors.executor"]
    assert ray_in_core(mods, graph) == [
        "actors.executor imports ray",
        "actors.executor imports the Ray shell actors.worker",
    ]


def test_public_api_from_the_top_package():
    import disco_ray

    for name in ("run", "compile", "run_memgraph", "Program", "TaskGraph", "MemGraph", "RunError"):
        assert getattr(disco_ray, name) is not None, name
    tg = disco_ray.TaskGraph(gpus=1)
    x = tg.input("x", (2, 2))
    tg.output(tg.add(x, x))
    assert disco_ray.run(tg, {"x": __import__("torch").ones(2, 2)}, engine="local")[tg.outputs[0]].sum() == 8
