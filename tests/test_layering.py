"""The floors import one way (developers' guide: "nothing below training/ imports it"): every import in the
package, module-level or inside a function, is checked with ast, so a lazy import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import python_ast

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_spo"
LOWER_FLOORS = ("models", "data", "rollout", "rewards", "ops", "algorithms")
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
