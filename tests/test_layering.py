"""The floors import one way (developers' guide: "nothing below training/ imports it"): every import in the
package, module-level or inside a function, is checked with ast, so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import python_ast

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_spo"
LOWER_FLOORS = ("models", "data", "rollout", "rewards", "environments", "ops", "algorithms")
# What the bottom floors may import of the project at all: pure math and kernels know nothing of it.
BOTTOM = {"algorithms": {"megatron_spo.algorithms"}, "ops": {"megatron_spo.ops", "megatron_spo.extras"}}


def _project_imports(path: Path) -> list[tuple[int, str]]:
    tree = python_ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]  # "from megatron_spo import extras" names extras
            out += [(node.lineno, n) for n in names if n.startswith("megatron_spo")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("megatron_spo")]
    return out


def _violations(floor: str, allowed=None, forbidden: str | None = None) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / floor).rglob("*.py")):
        for line, name in _project_imports(path):
            if forbidden and (name == forbidden or name.startswith(forbidden + ".")):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
            if allowed is not None and not any(name == a or name.startswith(a + ".") for a in allowed):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


def test_no_lower_floor_imports_training():
    bad = [v for floor in LOWER_FLOORS for v in _violations(floor, forbidden="megatron_spo.training")]
    assert bad == []


def test_data_is_plain_data_and_the_engine_tools_stay_below_training():
    """data/ (problems, prompts, Q0 files, trajectories) knows no engine: it imports neither rollout/ nor
    engine_tools/; the engine-driving tools use data/, rollout/ and rewards/ but never training/."""
    bad = [v for forbidden in ("megatron_spo.rollout", "megatron_spo.engine_tools")
           for v in _violations("data", forbidden=forbidden)]
    bad += _violations("engine_tools", forbidden="megatron_spo.training")
    assert bad == []


def test_algorithms_and_ops_know_nothing_of_the_project():
    bad = [v for floor, allowed in BOTTOM.items() for v in _violations(floor, allowed=allowed)]
    assert bad == []


def test_the_check_itself_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from megatron_spo.training.trainer import Trainer\n")
    assert _project_imports(module) == [(2, "megatron_spo.training.trainer.Trainer")]


# ---------------------------------------------------------------------------------------------
# Floors and circles of the whole package
# ---------------------------------------------------------------------------------------------
# Each room (a folder of megatron_spo/, or a module at its top) stands on one floor; it may import rooms of its
# own floor or below, never above. The ground knows nothing of the rest: the config loader, small helpers,
# the pure math and kernels, and cli.py (it loads a subcommand's module by name only when it runs, so its
# argparse types and signal handlers may be used anywhere; `train --dry-run` is routed there to validate.py).
FLOORS = (
    {"config", "cli", "extras", "fsutil", "checkpoint_digest", "net", "memory", "collectives", "algorithms", "ops",
     "eval", "deferred_compile", "library_warnings",
     "__init__"},  # the package's __init__ installs deferred_compile's hook
    {"hooks", "run_layout", "rewards", "environments"},
    {"data", "models"},
    {"rollout"},
    {"engine_tools", "training"},
    {"experiments", "planning", "validate"},
    {"verify"},
)
FLOOR = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def _room(module: str) -> str:
    """megatron_spo.training.trainer -> training; megatron_spo.cli -> cli."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def _room_arrows() -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> where, for every import between two rooms (module-level and lazy)."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = _room(_module_of(path))
        for line, name in _project_imports(path):
            dst = _room(name)
            if dst != src and dst in FLOOR:
                arrows.setdefault((src, dst), []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return arrows


def test_every_room_has_a_floor():
    rooms = {_room(_module_of(p)) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert sorted(rooms - set(FLOOR)) == [], "add the new folder or module to FLOORS"


def test_no_import_runs_up_a_floor():
    bad = [f"{where} imports {dst} (floor {FLOOR[dst]}) from {src} (floor {FLOOR[src]})"
           for (src, dst), places in _room_arrows().items() if FLOOR[dst] > FLOOR[src] for where in places]
    assert bad == []


def _circles(arrows) -> list[list[str]]:
    """The strongly connected sets of two or more rooms (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for src, dst in arrows:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_across_folders():
    arrows = _room_arrows()
    found = [f"{' <-> '.join(c)}: " + "; ".join(f"{w} imports {d}" for (s, d), ws in sorted(arrows.items())
                                                 if s in c and d in c for w in ws[:2])
             for c in _circles(arrows)]
    assert found == []


def test_the_circle_check_sees_a_lazy_circle():
    arrows = {("data", "rollout"): ["data/x.py:3"], ("rollout", "data"): ["rollout/y.py:9"], ("models", "config"): []}
    assert _circles(arrows) == [["data", "rollout"]]


def test_each_config_stands_on_its_floor():
    """config.py (the loader) imports nothing of the project; each floor's config.py imports only its floor
    and below (models/config.py never training/, data/config.py never rollout/ ...)."""
    bad = [f"megatron_spo/config.py:{line} imports {name}"
           for line, name in _project_imports(PACKAGE / "config.py")]
    for path in sorted(PACKAGE.glob("*/config.py")):
        room = path.parent.name
        bad += [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
                for line, name in _project_imports(path)
                if FLOOR.get(_room(name), 0) > FLOOR[room]]
    assert bad == []
