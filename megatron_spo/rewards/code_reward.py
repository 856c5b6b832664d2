"""Code-contest reward: extract the program from a completion, run it on the problem's tests in the
sandbox, reward 0 when every test passes and -1 otherwise (the SPO paper's convention)."""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
PYTHON_TAGS = {"", "python", "python3", "py", "py3"}


def extract_program(completion: str, *, continuation: bool = False) -> str | None:
    """The last ```python (or untagged) fenced block, an unclosed one at the end included (a truncated
    generation); the raw completion when it has no fence at all (``continuation``: its first line's indentation
    kept, a function body continuing a prompt); None when it only has blocks of other languages or nothing."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(completion)]
    if not blocks:
        if not completion.strip():
            return None
        return (completion.lstrip("\n") if continuation else completion.strip()).rstrip() + "\n"
    python = [body for tag, body in blocks if tag in PYTHON_TAGS]
    if not python or not python[-1].strip():
        return None
    return python[-1].rstrip() + "\n"


def reward_from_report(report) -> float:
    """0.0 when every test passed, else -1.0 (a TestReport with no tests never passes)."""
    return 0.0 if report.passed else -1.0


def code_reward(completion: str, tests: list[tuple[str, str]], *, time_limit_s: float = 2.0, memory_mb: int = 1024,
                pool=None, harness=None) -> tuple[float, dict]:
    """Blocking: extract the program, run it in the sandbox (``pool`` or the process-wide default pool) on the
    tests (``harness``: a sandbox.CallHarness, function-call tests), return (reward, info). A completion without
    a Python program scores -1 without running anything."""
    from megatron_spo.rewards.sandbox import run_tests

    program = extract_program(completion, continuation=bool(harness is not None and harness.prefix))
    if program is None:
        return -1.0, {"error": "no_program"}
    report = run_tests(program, tests, time_limit_s=time_limit_s, memory_mb=memory_mb, pool=pool, harness=harness)
    return reward_from_report(report), {"statuses": list(report.statuses), "wall_s": round(report.wall_s, 4)}
