"""The quickstart's toy code-generation task: small templated Python problems, many correct programs each.

Three families, each a short pipeline of named operations written in a terse prompt:

    # num: mul 3, add 2, abs          n -> abs(n*3+2)            stdin "4"         -> "14"
    # str: rev, upper, head 3         s -> s[::-1].upper()[:3]   stdin "hello"     -> "OLL"
    # list: dbl, even, sum            a -> sum of the evens of 2a  stdin "1 2 3 4" -> "20"

A program reads stdin and prints to stdout. Every problem carries reward tests (used by RL) and separate
hidden tests (used only for evaluation), plus up to ``max_solutions`` distinct reference programs drawn
from a small grammar (stepwise or nested, variable names, equivalent idioms), so a soft policy has
diversity to keep. Expected outputs are computed by Python functions of the operations, independently of
the program text, so the reference programs are checked against them rather than defining them.

The split is fixed by the seed: held-out prompts are never seen in SFT or RL. SFT also sees ``sft_only``
pipelines (distinct functions from every task problem): with only the train prompts a 0.6M-parameter
model memorises prompt -> program and solves ~2% of held-out prompts; with the extra pipelines it learns
the prompt language and solves ~30-40% of them when it reads the input right (pass@1 at T=0.4).
``with_input_slip`` gives the quickstart's reference a generic habit to lose (see reference_model.py).
Everything is deterministic (``random.Random(seed)`` only; no set iteration or ``hash()`` of strings).

    task = make_task()                 # 240 problems: 120 train, 120 held out; + 900 SFT-only pipelines
    p = task.train[0]; p.prompt        # '# num: ...\\n'  (the model's input text; BOS comes from the tokenizer)
    p.solutions[0]                     # 'n=int(input())\\nprint(...)\\n'
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from megatron_spo.data.problem import Problem as TaskProblem

GENERATOR_VERSION = 2  # bump when problems, tests or solutions change (part of the reference-model cache key)

FAMILIES = ("num", "str", "list")


@dataclass(frozen=True, kw_only=True)
class Problem(TaskProblem):
    """One generated programming problem: a data/tasks.py Problem (kind code) with how it was generated.

    prompt: the model's input text (a one-line comment ending in a newline).
    tests / hidden_tests: (stdin, expected stdout) pairs; stdout is exactly what ``print`` writes.
    family / ops: the pipeline it was drawn from. solutions: distinct correct programs (each ends in a newline).
    """

    family: str
    ops: tuple[str, ...]
    solutions: tuple[str, ...]


@dataclass(frozen=True)
class ToyCodeTask:
    """All problems, the fixed split, and SFT-only pipelines. ``neighbour[id]``: a similar SFT problem (noise).

    ``sft_only`` and ``neighbour`` are drawn on first use (about a second for 900 pipelines), so code that
    needs only the problems does not pay for them.
    """

    problems: tuple[Problem, ...]
    train: tuple[Problem, ...]
    heldout: tuple[Problem, ...]
    # (seed, num_sft_problems, num_tests, num_hidden_tests, max_solutions): how to draw sft_only
    sft_settings: tuple[int, int, int, int, int] = field(default=(0, 0, 5, 5, 16), repr=False)

    @functools.cached_property
    def sft_only(self) -> tuple[Problem, ...]:
        """Pipelines seen only in SFT, each a function distinct from every task problem."""
        seed, count, num_tests, num_hidden_tests, max_solutions = self.sft_settings
        seen = {_signature(p.family, p.ops): None for p in self.problems}
        return tuple(_draw(count, "sft-", random.Random(seed + 2), seen, num_tests, num_hidden_tests, max_solutions))

    @property
    def sft_problems(self) -> tuple[Problem, ...]:
        """What SFT may see: the train split and the SFT-only pipelines (never a held-out one)."""
        return self.train + self.sft_only

    @functools.cached_property
    def neighbour(self) -> dict[str, str]:
        """For each SFT problem, a similar other SFT problem (its programs are the swapped SFT targets)."""
        return _neighbours(self.sft_problems)

    @functools.cached_property
    def _index(self) -> dict[str, Problem]:
        return {p.id: p for p in self.problems}

    def by_id(self, problem_id: str) -> Problem:
        if problem_id in self._index:
            return self._index[problem_id]
        if problem_id.startswith("sft-"):
            for p in self.sft_only:
                if p.id == problem_id:
                    return p
        raise KeyError(f"toy_code: no problem with id '{problem_id}'")


# ---------------------------------------------------------------------------------------------
# Expressions with Python precedence, so nested programs carry only the parentheses they need
# ---------------------------------------------------------------------------------------------
# Binding strength of an expression's top operator: + - (1), * // % (2), unary - (3), ** (4), atom (5).
ADD, MUL, NEG, POW, ATOM = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class Expr:
    text: str
    prec: int
    is_name: bool = False  # a bare variable: safe to repeat (x*x); int(input()) is not


def _at_least(e: Expr, prec: int) -> str:
    return e.text if e.prec >= prec else f"({e.text})"


def _name(v: str) -> Expr:
    return Expr(v, ATOM, is_name=True)


# ---------------------------------------------------------------------------------------------
# Operations. Each: prompt word(s), a Python function (the truth), and the ways to write it.
# An op's ``exprs(e)`` gives equivalent expressions of e; ``stmts(v)`` gives equivalent statements
# updating variable v in place (stepwise programs).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    word: str
    fn: Callable
    exprs: Callable[[Expr], list[Expr]]
    stmts: Callable[[str], list[str]]


def _assign(v: str, op: Op) -> list[str]:
    return [f"{v}={e.text}" for e in op.exprs(_name(v))]


def _num_ops(k: int) -> dict[str, Op]:
    ops: dict[str, Op] = {}

    def add(name: str, fn: Callable, exprs: Callable[[Expr], list[Expr]], aug: str | None = None) -> None:
        def stmts(v: str, _name_: str = name) -> list[str]:
            out = _assign(v, ops[_name_])
            if aug is not None:
                out.append(f"{v}{aug}")
            return out

        ops[name] = Op(name, fn, exprs, stmts)

    add(f"add {k}", lambda n: n + k, lambda e: [Expr(f"{_at_least(e, ADD)}+{k}", ADD),
                                                Expr(f"{k}+{_at_least(e, MUL)}", ADD)], f"+={k}")
    add(f"sub {k}", lambda n: n - k, lambda e: [Expr(f"{_at_least(e, ADD)}-{k}", ADD)], f"-={k}")
    add(f"mul {k}", lambda n: n * k, lambda e: [Expr(f"{_at_least(e, MUL)}*{k}", MUL),
                                                Expr(f"{k}*{_at_least(e, NEG)}", MUL)], f"*={k}")
    add(f"div {k}", lambda n: n // k, lambda e: [Expr(f"{_at_least(e, MUL)}//{k}", MUL)], f"//={k}")
    add(f"mod {k}", lambda n: n % k, lambda e: [Expr(f"{_at_least(e, MUL)}%{k}", MUL)], f"%={k}")
    return ops


def _sq_exprs(e: Expr) -> list[Expr]:
    out = [Expr(f"{_at_least(e, ATOM)}**2", POW)]
    if e.is_name:
        out.append(Expr(f"{e.text}*{e.text}", MUL))
    return out


NUM_MODIFIERS = {
    "abs": Op("abs", abs, lambda e: [Expr(f"abs({e.text})", ATOM)], lambda v: [f"{v}=abs({v})"]),
    "neg": Op("neg", lambda n: -n, lambda e: [Expr(f"-{_at_least(e, NEG)}", NEG)], lambda v: [f"{v}=-{v}"]),
    "sq": Op("sq", lambda n: n * n, _sq_exprs, lambda v: [f"{v}={e.text}" for e in _sq_exprs(_name(v))]),
}


def _str_ops() -> dict[str, Op]:
    def op(word: str, fn: Callable, *templates: str) -> Op:
        # '{e}' is the operand; templates that repeat it ('{e}+{e}') need a bare name
        def exprs(e: Expr) -> list[Expr]:
            out = []
            for t in templates:
                if t.count("{e}") > 1 and not e.is_name:
                    continue
                prec = ADD if "+" in t.replace("{e}", "") else (MUL if "*" in t else ATOM)
                # an operand that leads the template binds to a postfix or operator; inside a call it is free
                operand = _at_least(e, ATOM) if t.startswith("{e}") else e.text
                out.append(Expr(t.format(e=operand), prec))
            return out

        return Op(word, fn, exprs, lambda v: _assign(v, ops_[word]))

    ops_: dict[str, Op] = {}
    for o in [
        op("upper", str.upper, "{e}.upper()"),
        op("rev", lambda s: s[::-1], "{e}[::-1]", "''.join(reversed({e}))"),
        op("sort", lambda s: "".join(sorted(s)), "''.join(sorted({e}))"),
        op("dup", lambda s: s * 2, "{e}*2", "{e}+{e}"),
        op("cap", str.capitalize, "{e}.capitalize()"),
    ]:
        ops_[o.word] = o
    for k in (1, 2, 3):
        for o in [
            op(f"head {k}", lambda s, k=k: s[:k], f"{{e}}[:{k}]"),
            op(f"tail {k}", lambda s, k=k: s[-k:], f"{{e}}[-{k}:]"),
            op(f"drop {k}", lambda s, k=k: s[k:], f"{{e}}[{k}:]"),
        ]:
            ops_[o.word] = o
    for a, b in (("a", "o"), ("e", "x"), ("o", "0"), ("i", "1")):
        o = op(f"swap {a} {b}", lambda s, a=a, b=b: s.replace(a, b), f"{{e}}.replace('{a}','{b}')")
        ops_[o.word] = o
    return ops_


STR_OPS = _str_ops()
STR_TERMINALS = {  # an optional last op that turns the string into a number
    "len": Op("len", len, lambda e: [Expr(f"len({e.text})", ATOM)], lambda v: [f"{v}=len({v})"]),
    **{
        f"count {c}": Op(f"count {c}", lambda s, c=c: s.count(c), lambda e, c=c: [Expr(f"{_at_least(e, ATOM)}.count('{c}')", ATOM)],
                         lambda v, c=c: [f"{v}={v}.count('{c}')"])
        for c in ("a", "e", "o")
    },
}

# List ops: (word, truth on a list, statement templates on list variable {a} with loop variable {x}).
LIST_MAPS = {
    "dbl": (lambda a: [x * 2 for x in a], ["{a}=[{x}*2 for {x} in {a}]", "{a}=[2*{x} for {x} in {a}]"]),
    "inc": (lambda a: [x + 1 for x in a], ["{a}=[{x}+1 for {x} in {a}]"]),
    "dec": (lambda a: [x - 1 for x in a], ["{a}=[{x}-1 for {x} in {a}]"]),
    "half": (lambda a: [x // 2 for x in a], ["{a}=[{x}//2 for {x} in {a}]"]),
    "sq": (lambda a: [x * x for x in a], ["{a}=[{x}*{x} for {x} in {a}]", "{a}=[{x}**2 for {x} in {a}]"]),
    "neg": (lambda a: [-x for x in a], ["{a}=[-{x} for {x} in {a}]"]),
    "abs": (lambda a: [abs(x) for x in a], ["{a}=[abs({x}) for {x} in {a}]", "{a}=list(map(abs,{a}))"]),
}
LIST_FILTERS = {
    "even": (lambda a: [x for x in a if x % 2 == 0], ["{a}=[{x} for {x} in {a} if {x}%2==0]"]),
    "odd": (lambda a: [x for x in a if x % 2 == 1], ["{a}=[{x} for {x} in {a} if {x}%2==1]",
                                                     "{a}=[{x} for {x} in {a} if {x}%2]"]),
    "pos": (lambda a: [x for x in a if x > 0], ["{a}=[{x} for {x} in {a} if {x}>0]"]),
}
LIST_ORDERS = {
    "sort": (sorted, ["{a}.sort()", "{a}=sorted({a})"]),
    "rsort": (lambda a: sorted(a, reverse=True), ["{a}.sort(reverse=True)", "{a}=sorted({a},reverse=True)",
                                                 "{a}=sorted({a})[::-1]"]),
    "rev": (lambda a: a[::-1], ["{a}.reverse()", "{a}={a}[::-1]"]),
}
LIST_TERMINALS = {  # (truth, print statements); None = print the list space-separated
    "sum": (sum, ["print(sum({a}))"]),
    "max": (max, ["print(max({a}))"]),
    "min": (min, ["print(min({a}))"]),
    "len": (len, ["print(len({a}))"]),
    "first": (lambda a: a[0], ["print({a}[0])"]),
    "last": (lambda a: a[-1], ["print({a}[-1])"]),
}
LIST_PRINT = ["print(*{a})", "print(' '.join(map(str,{a})))"]
LIST_READ = ["{a}=list(map(int,input().split()))", "{a}=[int({x}) for {x} in input().split()]"]


def _list_step(word: str) -> tuple[Callable, list[str]]:
    for table in (LIST_MAPS, LIST_FILTERS, LIST_ORDERS):
        if word in table:
            return table[word]
    raise KeyError(word)


# ---------------------------------------------------------------------------------------------
# Programs: every way the small grammar writes a pipeline
# ---------------------------------------------------------------------------------------------
def _num_op(word: str) -> Op:
    if word in NUM_MODIFIERS:
        return NUM_MODIFIERS[word]
    name, k = word.split()
    return _num_ops(int(k))[word]


def _nested(start: Expr, ops: list[Op]) -> Iterator[Expr]:
    """All nested expressions applying ops in order to start."""
    if not ops:
        yield start
        return
    for e in ops[0].exprs(start):
        yield from _nested(e, ops[1:])


def _stepwise(v: str, ops: list[Op]) -> Iterator[list[str]]:
    for combo in itertools.product(*[op.stmts(v) for op in ops]):
        yield list(combo)


def _scalar_programs(ops: list[Op], read: str, names: tuple[str, ...]) -> Iterator[str]:
    """Programs for a value read by ``read`` (e.g. 'int(input())') transformed by ops, then printed."""
    yield from (f"print({e.text})\n" for e in _nested(Expr(read, ATOM), ops))
    for v in names:
        for e in _nested(_name(v), ops):
            yield f"{v}={read}\nprint({e.text})\n"
        for body in _stepwise(v, ops):
            yield "\n".join([f"{v}={read}", *body, f"print({v})"]) + "\n"
        # half and half: the first op as a statement, the rest nested in the print
        if len(ops) > 1:
            for first in ops[0].stmts(v):
                for e in _nested(_name(v), ops[1:]):
                    yield f"{v}={read}\n{first}\nprint({e.text})\n"


def _list_programs(words: tuple[str, ...]) -> Iterator[str]:
    steps = [w for w in words if w not in LIST_TERMINALS]
    terminal = words[-1] if words[-1] in LIST_TERMINALS else None
    outs = LIST_TERMINALS[terminal][1] if terminal else LIST_PRINT
    for a, x in (("a", "x"), ("a", "v"), ("l", "x"), ("nums", "n")):
        for read in LIST_READ:
            for body in itertools.product(*[_list_step(w)[1] for w in steps]):
                for out in outs:
                    lines = [read, *body, out]
                    yield "\n".join(line.format(a=a, x=x) for line in lines) + "\n"


def programs(family: str, ops: tuple[str, ...]) -> list[str]:
    """Every distinct program the grammar writes for a pipeline, in a fixed order."""
    if family == "num":
        gen = _scalar_programs([_num_op(w) for w in ops], "int(input())", ("n", "x", "a"))
    elif family == "str":
        gen = _scalar_programs([{**STR_OPS, **STR_TERMINALS}[w] for w in ops], "input()", ("s", "t", "w"))
    elif family == "list":
        gen = _list_programs(ops)
    else:
        raise ValueError(f"toy_code: unknown family '{family}' (expected one of {FAMILIES})")
    return list(dict.fromkeys(gen))


def truth(family: str, ops: tuple[str, ...]) -> Callable[[str], str]:
    """stdin -> expected stdout, computed from the operations (not from any program text)."""

    def run(stdin: str) -> str:
        if family == "num":
            value: object = int(stdin)
            for w in ops:
                value = _num_op(w).fn(value)
        elif family == "str":
            value = stdin.rstrip("\n")
            for w in ops:
                value = {**STR_OPS, **STR_TERMINALS}[w].fn(value)
        else:
            value = [int(t) for t in stdin.split()]
            for w in ops:
                value = LIST_TERMINALS[w][0](value) if w in LIST_TERMINALS else _list_step(w)[0](value)
            if isinstance(value, list):
                return " ".join(map(str, value)) + "\n"
        return f"{value}\n"

    return run


# ---------------------------------------------------------------------------------------------
# Sampling pipelines and tests
# ---------------------------------------------------------------------------------------------
def _sample_ops(family: str, rng: random.Random) -> tuple[str, ...]:
    if family == "num":
        kinds = ["add", "sub", "mul", "div", "mod"]
        n_arith = rng.choice([1, 2, 2, 3])
        words = [f"{rng.choice(kinds)} {rng.randint(2, 9)}" for _ in range(n_arith)]
        if rng.random() < 0.6:
            words.insert(rng.randint(0, len(words)), rng.choice(list(NUM_MODIFIERS)))
        return tuple(words)
    if family == "str":
        words = rng.sample(list(STR_OPS), rng.choice([1, 2, 2, 3]))
        if rng.random() < 0.25:
            words.append(rng.choice(list(STR_TERMINALS)))
        return tuple(words)
    steps = rng.sample(list(LIST_MAPS) + list(LIST_FILTERS) + list(LIST_ORDERS), rng.choice([1, 2, 2, 3]))
    if rng.random() < 0.6:
        steps.append(rng.choice(list(LIST_TERMINALS)))
    return tuple(steps)


def _prompt(family: str, ops: tuple[str, ...]) -> str:
    return f"# {family}: {', '.join(ops)}\n"


_WORDS = ("apple", "banana", "cherry", "melon", "orange", "potato", "tomato", "violet", "window", "zebra",
          "kiwi", "lemon", "radio", "piano", "video", "eagle", "tiger", "ocean", "indigo", "coffee")


def _sample_input(family: str, rng: random.Random) -> str:
    if family == "num":
        return f"{rng.randint(-40, 60)}\n"
    if family == "str":
        if rng.random() < 0.5:
            return rng.choice(_WORDS) + "\n"
        return "".join(rng.choice("abcdeilmnorstuxyz") for _ in range(rng.randint(4, 9))) + "\n"
    values = [rng.randint(-9, 20) for _ in range(rng.randint(4, 8))]
    values += [rng.choice([2, 4, 6, 8]), rng.choice([1, 3, 5, 7])]  # every filter keeps something
    rng.shuffle(values)
    return " ".join(map(str, values)) + "\n"


def _make_tests(family: str, ops: tuple[str, ...], count: int, rng: random.Random) -> list[tuple[str, str]] | None:
    """count tests with distinct inputs and at least two distinct outputs; None when the pipeline is degenerate."""
    expected = truth(family, ops)
    tests: dict[str, str] = {}
    for _ in range(count * 20):
        stdin = _sample_input(family, rng)
        if stdin in tests:
            continue
        try:
            out = expected(stdin)
        except (IndexError, ValueError, ZeroDivisionError):
            continue
        if out.strip() == "" or len(out) > 60:
            continue
        tests[stdin] = out
        if len(tests) == count:
            break
    if len(tests) < count or len(set(tests.values())) < 2:
        return None
    return list(tests.items())


def _every_op_matters(family: str, ops: tuple[str, ...], tests: list[tuple[str, str]]) -> bool:
    """Dropping any one op changes some expected output (so no op can be ignored and still pass)."""
    for i in range(len(ops)):
        shorter = truth(family, ops[:i] + ops[i + 1 :])
        if all(_safe(shorter, stdin) == out for stdin, out in tests):
            return False
    return True


def _safe(fn: Callable[[str], str], stdin: str) -> str:
    try:
        return fn(stdin)
    except (IndexError, ValueError, ZeroDivisionError):
        return "<error>"


def make_task(
    seed: int = 0,
    num_problems: int = 240,
    heldout_fraction: float = 0.5,
    num_tests: int = 5,
    num_hidden_tests: int = 5,
    max_solutions: int = 16,
    num_sft_problems: int = 900,
) -> ToyCodeTask:
    """The toy task: ``num_problems`` problems cycling through the families, split train / held out,
    plus ``num_sft_problems`` further pipelines seen only in SFT (distinct from all of them), so the
    reference model learns the prompt language rather than memorising the train prompts.
    """
    if num_problems < 2 * len(FAMILIES):
        raise ValueError(f"toy_code: num_problems must be >= {2 * len(FAMILIES)}, got {num_problems}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"toy_code: heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if num_sft_problems < 0:
        raise ValueError(f"toy_code: num_sft_problems must be >= 0, got {num_sft_problems}")
    seen: dict[tuple[str, ...], None] = {}  # signatures drawn so far: every problem is a distinct function
    problems = _draw(num_problems, "", random.Random(seed), seen, num_tests, num_hidden_tests, max_solutions)
    order = list(range(len(problems)))
    random.Random(seed + 1).shuffle(order)
    n_heldout = max(len(FAMILIES), round(heldout_fraction * len(problems)))
    heldout = tuple(problems[i] for i in sorted(order[:n_heldout]))
    train = tuple(problems[i] for i in sorted(order[n_heldout:]))
    sft_settings = (seed, num_sft_problems, num_tests, num_hidden_tests, max_solutions)
    return ToyCodeTask(tuple(problems), train, heldout, sft_settings)


def _draw(
    count: int,
    id_prefix: str,
    rng: random.Random,
    seen: dict[tuple[str, ...], None],
    num_tests: int,
    num_hidden_tests: int,
    max_solutions: int,
) -> list[Problem]:
    """count new problems (cycling through the families) whose functions differ from all in ``seen``."""
    problems: list[Problem] = []
    counts = dict.fromkeys(FAMILIES, 0)
    attempts = 0
    while len(problems) < count:
        attempts += 1
        if attempts > count * 200:
            raise ValueError(f"toy_code: could not draw {count} distinct {id_prefix or 'task '}problems")
        family = FAMILIES[len(problems) % len(FAMILIES)]
        ops = _sample_ops(family, rng)
        tests = _make_tests(family, ops, num_tests + num_hidden_tests, rng)
        if tests is None or not _every_op_matters(family, ops, tests[:num_tests]):
            continue
        # a pipeline equal on probe inputs to an earlier one (e.g. 'sort, rev' vs 'rsort') adds nothing
        signature = _signature(family, ops)
        if signature in seen:
            continue
        seen[signature] = None
        all_programs = programs(family, ops)
        counts[family] += 1
        problems.append(
            Problem(
                id=f"{id_prefix}{family}-{counts[family]:03d}",
                family=family,
                ops=ops,
                prompt=_prompt(family, ops),
                tests=tuple(tests[:num_tests]),
                hidden_tests=tuple(tests[num_tests:]),
                solutions=tuple(rng.sample(all_programs, min(max_solutions, len(all_programs)))),
            )
        )
    return problems


def _signature(family: str, ops: tuple[str, ...]) -> tuple[str, ...]:
    """Outputs on fixed probe inputs: equal signatures mean (almost surely) the same function."""
    rng = random.Random(12345)
    expected = truth(family, ops)
    outs = [family]
    for _ in range(12):
        try:
            outs.append(expected(_sample_input(family, rng)))
        except (IndexError, ValueError, ZeroDivisionError):
            outs.append("<error>")
    return tuple(outs)


def _neighbours(pool: tuple[Problem, ...]) -> dict[str, str]:
    """For each problem, the most similar other one of the pool (same family first, most shared ops)."""
    by_op: dict[tuple[str, str], list[Problem]] = {}
    for q in pool:
        for w in q.ops:
            by_op.setdefault((q.family, w), []).append(q)
    out = {}
    for p in pool:
        candidates = [q for w in p.ops for q in by_op[(p.family, w)]] or list(pool)
        best, best_score = None, -math.inf
        for q in candidates:
            if q.id == p.id:
                continue
            kinds = [v.split()[0] for v in q.ops]
            shared = len([w for w in p.ops if w in q.ops])
            same_kind = len([w for w in p.ops if w.split()[0] in kinds])
            score = 100 * (q.family == p.family) + shared + 0.5 * same_kind - 0.1 * abs(len(p.ops) - len(q.ops))
            if score > best_score:
                best, best_score = q, score
        if best is not None:  # a one-problem pool has no neighbour
            out[p.id] = best.id
    return out


def all_text(task: ToyCodeTask) -> Iterator[str]:
    """Every prompt, program and test string of the task (what the tokenizer must cover)."""
    for p in task.problems + task.sft_only:
        yield p.prompt
        yield from p.solutions
        for stdin, stdout in p.tests + p.hidden_tests:
            yield stdin
            yield stdout


# The sloppy teacher's input slip, one per family: the same mistake whatever the problem asks.
_SLIPS = {
    "num": [(re.compile(r"int\(input\(\)\)"), "input()")],  # never converts the number
    "str": [(re.compile(r"input\(\)"), "input().split()")],  # a list of words, not the string
    "list": [(re.compile(r"list\(map\(int,input\(\)\.split\(\)\)\)"), "input().split()"),  # strings, not ints
             (re.compile(r"\[int\((\w+)\) for"), r"[\1 for")],
}


def with_input_slip(family: str, program: str) -> str:
    """The program with its family's input-parsing slip (a generic bug, independent of the operations).

    SFT on some slipped targets gives pi_0 a habit that fails on every problem, seen or not: the kind of
    systematic error RL should remove and whose removal must show on held-out problems.
    """
    out = program
    for pattern, replacement in _SLIPS[family]:
        out = pattern.sub(replacement, out)
    if out == program:
        raise ValueError(f"toy_code: no input to slip in this {family} program: {program!r}")
    return out
