"""The second generated task: multi-step arithmetic word problems, scored by the math reward.

Each problem is a chain of two or three operations (+ - * /, exact division) on small numbers, told as a
one-line story; the answer is the chain's last value. A solution writes one step per equation and boxes the
result, the way the math reward (rewards/math_answer.py) reads it:

    prompt    'Eve has 4 boxes of 6 pens and gives away 5. How many pens are left?\\n'
    solution  '4*6=24\\n24-5=19\\n\\\\boxed{19}\\n'          (also '6*4=24, 24-5=19, \\\\boxed{19}\\n', ...)
    answer    '19'

Distinct correct solutions differ in the order of commutative operands and the separator between steps.
The sloppy teacher's slip (``with_slip``) drops the last step and boxes the value before it: the same
mistake whatever the problem, and wrong on every problem (a last step never leaves its value unchanged).
SFT on half slipped targets gives pi_0 a habit of stopping one step early that RL can remove, and its removal
shows on held-out problems (see reference_model.py). Unlike the code task's slip (reading the input wrongly,
at the start), this one is at the end of a response.

The split is fixed by the seed; SFT also sees ``sft_only`` problems (other numbers, so the model learns the
arithmetic), never a held-out problem's numbers. Everything is deterministic (``random.Random(seed)`` only).

    task = make_task()                 # 240 problems: 120 train, 120 held out; + 900 SFT-only problems
    p = task.train[0]; p.prompt, p.answer, p.solutions[0]
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from megatron_spo.data.problem import Problem as TaskProblem

GENERATOR_VERSION = 2  # bump when problems or solutions change (part of the reference-model cache key)

OPS: dict[str, Callable[[int, int], int]] = {"+": lambda a, b: a + b, "-": lambda a, b: a - b,
                                             "*": lambda a, b: a * b, "/": lambda a, b: a // b}
SEPARATORS = ("\n", ", ")
MAX_VALUE = 30  # every value of a chain is an integer in [1, MAX_VALUE]: few enough sums and products that
# the quickstart's 0.6M-parameter model learns them (with values up to 99 pi_0 solved 6% of held-out problems)


@dataclass(frozen=True)
class Template:
    """A story with slots {name}, {item} and {n0}..{nk}; ops[i] combines the running value with n{i+1}."""

    name: str
    text: str
    ops: tuple[str, ...]


TEMPLATES = (
    Template("give", "{name} has {n0} boxes of {n1} {item} and gives away {n2}. How many {item} are left?", ("*", "-")),
    Template("find", "{name} buys {n0} packs of {n1} {item} and finds {n2} more. How many {item} now?", ("*", "+")),
    Template("weigh", "{name} picks {n0} {item} on Monday and {n1} on Tuesday. Each costs {n2} cents. How many "
                      "cents in all?", ("+", "*")),
    Template("share", "{name} has {n0} {item}, loses {n1} and shares the rest among {n2} friends. How many each?",
             ("-", "/")),
    Template("eat", "{name} has {n0} bags of {n1} {item}, buys {n2} more and eats {n3}. How many {item} are left?",
             ("*", "+", "-")),
    Template("mix", "A box holds {n0} red and {n1} blue {item}. {name} has {n2} boxes and gives {n3} away. How many "
                    "{item} are left?", ("+", "*", "-")),
    Template("pack", "{name} makes {n0} trays of {n1} {item}, drops {n2} and packs the rest in bags of {n3}. How "
                     "many bags?", ("*", "-", "/")),
    Template("shelf", "A shelf holds {n0} {item} and {n1} are taken. {name} fills {n2} shelves and adds {n3}. How "
                      "many {item} in all?", ("-", "*", "+")),
)
TEMPLATE_BY_NAME = {t.name: t for t in TEMPLATES}
NAMES = ("Ann", "Ben", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lou")
ITEMS = ("apples", "pens", "cards", "eggs", "shells", "stamps", "beads", "cups")


@dataclass(frozen=True, kw_only=True)
class Problem(TaskProblem):
    """One generated word problem: a data/tasks.py Problem of kind math (scored by ``answer``; no tests to
    run) with how it was generated.

    prompt: the model's input text (one line ending in a newline). numbers: n0..nk of the template.
    values: the chain's running values after each step (values[-1] == int(answer)).
    solutions: distinct correct solution texts (each ends in a newline).
    """

    template: str
    numbers: tuple[int, ...]
    values: tuple[int, ...]
    solutions: tuple[str, ...]
    kind: str = "math"


@dataclass(frozen=True)
class ToyMathTask:
    """All problems, the fixed split, and SFT-only problems (drawn on first use)."""

    problems: tuple[Problem, ...]
    train: tuple[Problem, ...]
    heldout: tuple[Problem, ...]
    # (seed, num_sft_problems, max_solutions): how to draw sft_only
    sft_settings: tuple[int, int, int] = field(default=(0, 0, 16), repr=False)

    @functools.cached_property
    def sft_only(self) -> tuple[Problem, ...]:
        """Problems seen only in SFT: numbers (per template) distinct from every task problem's."""
        seed, count, max_solutions = self.sft_settings
        seen = {(p.template, p.numbers): None for p in self.problems}
        return tuple(_draw(count, "sft-", random.Random(seed + 2), seen, max_solutions))

    @property
    def sft_problems(self) -> tuple[Problem, ...]:
        """What SFT may see: the train split and the SFT-only problems (never a held-out one)."""
        return self.train + self.sft_only

    @property
    def neighbour(self) -> dict[str, str]:
        """No neighbour swaps on this task (the slip is its only noise): an empty map."""
        return {}

    @functools.cached_property
    def _index(self) -> dict[str, Problem]:
        return {p.id: p for p in self.problems + self.sft_only}

    def by_id(self, problem_id: str) -> Problem:
        if problem_id not in self._index:
            raise KeyError(f"toy_math: no problem with id '{problem_id}'")
        return self._index[problem_id]


def chain(numbers: tuple[int, ...], ops: tuple[str, ...]) -> tuple[int, ...] | None:
    """The running values of n0 op0 n1 op1 n2 ...; None when a value leaves [1, MAX_VALUE], a division is not
    exact, or a step leaves its value unchanged (then dropping it would not be a mistake)."""
    value, values = numbers[0], []
    for op, n in zip(ops, numbers[1:]):
        if op == "/" and value % n:
            return None
        new = OPS[op](value, n)
        if not 1 <= new <= MAX_VALUE or new == value:
            return None
        values.append(new)
        value = new
    return tuple(values)


def _step_texts(numbers: tuple[int, ...], ops: tuple[str, ...], values: tuple[int, ...]) -> list[list[str]]:
    """For each step, its equivalent equations ('42-4=38'; 'a*b' and 'b*a' for + and *)."""
    out, left = [], numbers[0]
    for op, n, v in zip(ops, numbers[1:], values):
        forms = [f"{left}{op}{n}={v}"]
        if op in "+*":
            forms.append(f"{n}{op}{left}={v}")
        out.append(forms)
        left = v
    return out


def solution_texts(numbers: tuple[int, ...], ops: tuple[str, ...], values: tuple[int, ...]) -> list[str]:
    """Every distinct correct solution, in a fixed order: steps joined by one separator, then the boxed answer."""
    texts: list[str] = []

    def walk(prefix: list[str], rest: list[list[str]]) -> Iterator[list[str]]:
        if not rest:
            yield prefix
            return
        for form in rest[0]:
            yield from walk(prefix + [form], rest[1:])

    for sep in SEPARATORS:
        for steps in walk([], _step_texts(numbers, ops, values)):
            texts.append(sep.join(steps) + sep + f"\\boxed{{{values[-1]}}}\n")
    return list(dict.fromkeys(texts))


def _numbers(ops: tuple[str, ...], rng: random.Random) -> tuple[int, ...]:
    """n0..nk drawn for a chain: factors and divisors 2-9, addends 1-9, a first value 2-20 before + or -."""
    first = rng.randint(2, 9) if ops[0] in "*/" else rng.randint(2, 20)
    return (first, *[rng.randint(2, 9) if op in "*/" else rng.randint(1, 9) for op in ops])


def _draw(count: int, id_prefix: str, rng: random.Random, seen: dict, max_solutions: int) -> list[Problem]:
    problems: list[Problem] = []
    counts = {t.name: 0 for t in TEMPLATES}
    attempts = 0
    while len(problems) < count:
        attempts += 1
        if attempts > count * 500:
            raise ValueError(f"toy_math: could not draw {count} distinct {id_prefix or 'task '}problems")
        template = TEMPLATES[len(problems) % len(TEMPLATES)]
        numbers = _numbers(template.ops, rng)
        values = chain(numbers, template.ops)
        if values is None or (template.name, numbers) in seen:
            continue
        seen[(template.name, numbers)] = None
        slots = {f"n{i}": n for i, n in enumerate(numbers)}
        prompt = template.text.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), **slots) + "\n"
        texts = solution_texts(numbers, template.ops, values)
        counts[template.name] += 1
        problems.append(Problem(
            id=f"{id_prefix}{template.name}-{counts[template.name]:03d}", template=template.name, numbers=numbers,
            prompt=prompt, answer=str(values[-1]), values=values,
            solutions=tuple(rng.sample(texts, min(max_solutions, len(texts)))),
        ))
    return problems


def make_task(seed: int = 0, num_problems: int = 240, heldout_fraction: float = 0.5, max_solutions: int = 16,
              num_sft_problems: int = 900) -> ToyMathTask:
    """The task: ``num_problems`` problems (templates in turn), a seeded split, and SFT-only problems."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"toy_math: heldout_fraction must be in (0, 1), got {heldout_fraction}")
    rng = random.Random(seed)
    problems = _draw(num_problems, "", rng, {}, max_solutions)
    order = list(range(len(problems)))
    random.Random(seed + 1).shuffle(order)
    n_held = max(1, round(len(problems) * heldout_fraction))
    held = set(order[:n_held])
    return ToyMathTask(
        problems=tuple(problems),
        train=tuple(p for i, p in enumerate(problems) if i not in held),
        heldout=tuple(p for i, p in enumerate(problems) if i in held),
        sft_settings=(seed, num_sft_problems, max_solutions),
    )


_BOXED_TAIL = re.compile(r"\\boxed\{(\d+)\}\n$")


def with_slip(problem: Problem, solution: str) -> str:
    """The solution with the sloppy teacher's slip: its last step dropped and the value before it boxed.

    The same mistake whatever the problem, and wrong on every problem (``chain`` refuses a last step that
    keeps its value)."""
    tail = _BOXED_TAIL.search(solution)
    sep = next((s for s in SEPARATORS if tail and solution[: tail.start()].endswith(s)), None)
    if sep is None:
        raise ValueError(f"toy_math: not a solution of problem {problem.id}: {solution!r}")
    steps = solution[: tail.start() - len(sep)].split(sep)
    if len(steps) < 2:
        raise ValueError(f"toy_math: problem {problem.id}'s solution has one step: nothing to drop")
    kept = steps[:-1]
    return sep.join(kept) + sep + f"\\boxed{{{kept[-1].rsplit('=', 1)[1]}}}\n"


def all_text(task: ToyMathTask) -> Iterator[str]:
    """Every prompt, solution and answer of the task (what the tokenizer must cover)."""
    for p in task.problems + task.sft_only:
        yield p.prompt
        yield p.answer
        yield from p.solutions
