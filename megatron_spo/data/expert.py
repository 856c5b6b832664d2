"""Expert solutions of the generated tasks: canonical, correct, in a style pi_0 never produces.

pi_0 is SFT'd on the task's grammar (toy_code.programs: flat scripts; toy_math.solution_texts: bare equations), so
text in another style has very low log-probs under it: the off-policy data the SPO paper says it can learn from.

    toy_code  'import sys\\n\\n\\ndef solve():\\n    n=int(input())\\n    ...\\n\\n\\nsolve()\\n'   (a function, indented)
    toy_math  'Step 1: 4 * 6 = 24.\\nStep 2: 24 - 5 = 19.\\nAnswer: \\\\boxed{19}\\n'

The program is the grammar's first program (toy_code.programs(...)[0]) wrapped in a function, so it passes the
problem's tests exactly when that program does; a math solution recomputes the chain from the problem's numbers.

    rows = expert_rows(task.train)        # [{problem_id, response, kind: human, model: expert-generator}]
    `megatron-spo offline import-expert --task toy_code --tokenizer REF --store STORE`   (imports, sandbox-scored:
    data/importers.expert_candidates)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

EXPERT_MODEL = "expert-generator"  # provenance model of these rows (kind "human": written, not sampled)
EXPERT_ORIGIN = "megatron_spo.data.expert"


def expert_code(problem: Any) -> str:
    """A toy_code problem's canonical program as a function called once (4-space indentation, import sys)."""
    from megatron_spo.data.toy_code import programs

    body = programs(problem.family, problem.ops)[0].rstrip("\n").split("\n")
    return "import sys\n\n\ndef solve():\n" + "".join(f"    {line}\n" for line in body) + "\n\nsolve()\n"


def expert_math(problem: Any) -> str:
    """A toy_math problem's chain written as numbered steps with spaced operators, the answer boxed."""
    from megatron_spo.data.toy_math import TEMPLATE_BY_NAME, chain

    ops = TEMPLATE_BY_NAME[problem.template].ops
    values = chain(problem.numbers, ops)
    if values is None or str(values[-1]) != str(problem.answer):
        raise ValueError(f"expert: toy_math problem {problem.id}: its numbers do not give its answer")
    lines, left = [], problem.numbers[0]
    for i, (op, n, v) in enumerate(zip(ops, problem.numbers[1:], values), 1):
        lines.append(f"Step {i}: {left} {op} {n} = {v}.")
        left = v
    return "\n".join(lines) + f"\nAnswer: \\boxed{{{values[-1]}}}\n"


def expert_solution(problem: Any) -> str:
    """The expert text of a generated problem (toy_code: has ``ops``; toy_math: has ``template``)."""
    if hasattr(problem, "template"):
        return expert_math(problem)
    if hasattr(problem, "ops"):
        return expert_code(problem)
    raise ValueError(f"expert: problem {getattr(problem, 'id', problem)!r} is not of a generated task "
                     "(toy_code / toy_math)")


def expert_rows(problems: Iterable[Any]) -> Iterator[dict]:
    """One import-text row per problem (data/importers.py text schema)."""
    for p in problems:
        yield {"problem_id": str(p.id), "response": expert_solution(p), "kind": "human", "model": EXPERT_MODEL}
