"""MATH answers: the last \\boxed{} of a text, normalisation, and sympy equivalence under a timeout.

    last_boxed("so \\boxed{\\frac{1}{2}}.")         # '\\frac{1}{2}'
    answers_match("0.5", "\\frac12")                # True (sympy)
    math_reward("... \\boxed{2}", "2")              # 0.0  (-1.0 when wrong or missing)

Model output is untrusted: sympy's parser evaluates Python, so an expression reaches it only after a
character/identifier whitelist, and always in a separate worker process with an address-space limit that is
killed when it passes the timeout (9^{9^{9^9}} would otherwise run for ever).
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from decimal import Decimal

_BOX_COMMANDS = ("\\boxed", "\\fbox")
STARTUP_TIMEOUT_S = 120.0  # spawning the judge worker and importing sympy (not counted in timeout_s)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces kept) or \\boxed x; None when absent or unclosed."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text[i : i + 1] == " ":  # '\boxed 5'
        return text[i + 1 :].split("$")[0].strip() or None
    while text[i : i + 1].isspace():
        i += 1
    if text[i : i + 1] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def _braced(s: str, i: int) -> tuple[str, int] | None:
    """The {group} (or single character) starting at s[i]: (content, index after it)."""
    if i >= len(s):
        return None
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    return None


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}; \\sqrt3 -> \\sqrt{3}."""
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num = _braced(s, i + 5)
            den = _braced(s, num[1]) if num else None
            if num and den:
                out.append(f"\\frac{{{num[0]}}}{{{den[0]}}}")
                i = den[1]
                continue
        out.append(s[i])
        i += 1
    return "".join(out)


def normalize(answer: str) -> str:
    """Hendrycks-style canonical string: no spaces, units, \\left/\\right, dollars, degree marks."""
    s = answer.strip().replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\^\s*\{\\circ\}|\^\\circ", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<=[\d}])\s*\\(text|mbox|mathrm)\{\s*[a-zA-Z ]*\}$", "", s)  # trailing units: '5\text{ cm}'
    s = re.sub(r"\\(text|mbox|mathrm)\{([^{}]*)\}", r"\2", s)
    s = s.replace("\\,", "").replace("\\;", "").replace("\\ ", "").replace(" ", "")
    s = s.rstrip(".")
    if re.fullmatch(r"[a-zA-Z]\w?=.+", s):  # 'x=5' -> '5'
        s = s.split("=", 1)[1]
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)  # '.5' -> '0.5'
    s = _fix_fracs(s)
    if re.fullmatch(r"-?\d+/\d+", s):
        num, den = s.split("/")
        s = f"\\frac{{{num}}}{{{den}}}"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # '1,000' -> '1000'
        s = s.replace(",", "")
    return s


# ---------------------------------------------------------------------------------------------
# LaTeX -> sympy text, and the guarded sympy comparison
# ---------------------------------------------------------------------------------------------
_FUNCTIONS = {"sqrt", "pi", "oo", "sin", "cos", "tan", "log", "ln", "exp", "I"}
_SAFE = re.compile(r"[0-9A-Za-z+\-*/^().,\s]*")


def to_sympy_text(latex: str) -> str | None:
    """A whitelisted sympy expression string, or None when the answer is not plain algebra."""
    s = normalize(latex)
    for old, new in (("\\cdot", "*"), ("\\times", "*"), ("\\pi", " pi "), ("\\infty", " oo "), ("\\ln", " log"),
                     ("\\log", " log"), ("\\sin", " sin"), ("\\cos", " cos"), ("\\tan", " tan"), ("\\exp", " exp")):
        s = s.replace(old, new)
    while True:  # innermost-first rewriting of \frac and \sqrt
        m = re.search(r"\\(frac|sqrt)", s)
        if not m:
            break
        i = m.end()
        if m.group(1) == "sqrt":
            root = None
            if s[i : i + 1] == "[":
                close = s.find("]", i)
                if close < 0:
                    return None
                root, i = s[i + 1 : close], close + 1
            arg = _braced(s, i)
            if arg is None:
                return None
            rep = f"(({arg[0]})**(1/({root})))" if root else f"sqrt({arg[0]})"
            s = s[: m.start()] + rep + s[arg[1] :]
        else:
            num = _braced(s, i)
            den = _braced(s, num[1]) if num else None
            if den is None:
                return None
            s = s[: m.start()] + f"(({num[0]})/({den[0]}))" + s[den[1] :]
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if "\\" in s or not _SAFE.fullmatch(s) or "__" in s or re.search(r"\.\s*[A-Za-z_]", s):
        return None
    for name in re.findall(r"[A-Za-z_]\w*", s):
        if name not in _FUNCTIONS and len(name) > 1:
            return None
    return s


def _sympy_equal(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transforms = standard_transformations + (implicit_multiplication_application, convert_xor)
    ea = parse_expr(a, transformations=transforms, evaluate=True)
    eb = parse_expr(b, transformations=transforms, evaluate=True)
    if isinstance(ea, tuple) or isinstance(eb, tuple):
        ta, tb = (ea if isinstance(ea, tuple) else (ea,)), (eb if isinstance(eb, tuple) else (eb,))
        return len(ta) == len(tb) and all(sympy.simplify(x - y) == 0 for x, y in zip(ta, tb))
    diff = sympy.simplify(ea - eb)
    if diff == 0:
        return True
    return bool(diff.is_number and abs(complex(sympy.N(diff))) < 1e-9)


def _judge_worker(conn, memory_bytes: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    import sympy.parsing.sympy_parser  # noqa: F401  (loaded before "ready": start-up is not comparison time)

    conn.send("ready")
    while True:
        try:
            a, b = conn.recv()
        except EOFError:
            return
        try:
            result = _sympy_equal(a, b)
        except Exception:  # unparsable or unsupported: not equal
            result = False
        conn.send(result)


class SympyJudge:
    """A worker process comparing sympy expressions; killed and restarted when one passes ``timeout_s``."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 2048):
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_judge_worker, args=(child, self.memory_mb << 20), daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(STARTUP_TIMEOUT_S) or self._conn.recv() != "ready":
            self._proc.kill()
            raise RuntimeError(f"sympy judge: the worker did not start within {STARTUP_TIMEOUT_S} s")

    def equal(self, a: str, b: str) -> bool | None:
        """True / False, or None when the comparison passed the timeout (the worker is then replaced)."""
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((a, b))
            if self._conn.poll(self.timeout_s):
                try:
                    return bool(self._conn.recv())
                except EOFError:  # the worker died (memory limit): not equal
                    self._proc = None
                    return False
            self._proc.kill()
            self._proc.join()
            self._proc = None
            return None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.join()
                self._proc = None


_default_judge: SympyJudge | None = None
_judge_lock = threading.Lock()


def default_judge() -> SympyJudge:
    global _default_judge
    with _judge_lock:
        if _default_judge is None:
            _default_judge = SympyJudge()
        return _default_judge


def _split_top_level(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def answers_match(predicted: str | None, reference: str | None, *, judge: SympyJudge | None = None) -> bool:
    """Whether two final answers are the same: equal after normalisation, else equal under sympy
    (element-wise for comma-separated answers). A timed-out comparison counts as different."""
    if predicted is None or reference is None:
        return False
    a, b = normalize(predicted), normalize(reference)
    if a == b:
        return True
    if _PLAIN_NUMBER.fullmatch(a) and _PLAIN_NUMBER.fullmatch(b):  # '12' vs '13': no judge process needed
        return Decimal(a) == Decimal(b)
    pa, pb = _split_top_level(a), _split_top_level(b)
    if len(pa) != len(pb):
        return False
    if len(pa) > 1:
        return all(answers_match(x, y, judge=judge) for x, y in zip(pa, pb))
    sa, sb = to_sympy_text(a), to_sympy_text(b)
    if sa is None or sb is None:
        return False
    return (judge or default_judge()).equal(sa, sb) is True


def math_reward(completion: str, reference_answer: str, *, judge: SympyJudge | None = None) -> tuple[float, dict]:
    """0 when the completion's last \\boxed{} answer matches the reference, else -1 (missing box included)."""
    predicted = last_boxed(completion)
    passed = answers_match(predicted, reference_answer, judge=judge)
    return (0.0 if passed else -1.0), {"predicted": predicted, "reference": reference_answer, "passed": passed}
