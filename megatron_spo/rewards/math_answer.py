"""MATH answers: the last \\boxed{} of a text, judged by math-verify in worker processes.

    last_boxed("so \\boxed{\\frac{1}{2}}.")         # '\\frac{1}{2}'
    answers_match("0.5", "\\frac12")                # True
    math_reward("... \\boxed{2}", "2")              # (0.0, {..., "reason": "match"}); -1.0 when wrong or missing

math-verify (HF's answer verifier: LaTeX and plain answers, units, percentages, sets, intervals, equations) parses
both answers and decides their equivalence. Model output is untrusted and sympy can run for ever on it
(9^{9^{9^9}}), so the library runs only in spawned worker processes, each under an address-space limit, with its
own signal.alarm timeouts on (in the worker's main thread), killed and replaced when a verdict passes the judge's
timeout. Every answer gets one verdict and a reason (REASONS). Done here, because math-verify does not: a full stop
ending the answer ('5.', '\\text{Monday.}'), digit groups split by a space ('1\\,000' is 1000, not 1*000), and two
plain numbers compared exactly without a worker (math-verify rounds to 6 decimals): docs/extending.md, "Math
answers".
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import re
import threading
import time
from decimal import Decimal

_BOX_COMMANDS = ("\\boxed", "\\fbox")
STARTUP_TIMEOUT_S = 120.0  # spawning a worker and importing math-verify (not counted in timeout_s)
MAX_ANSWER_CHARS = 2000  # a longer predicted answer is wrong unread ("too_long")
REASONS = ("match", "wrong", "no_answer", "too_long", "unparsed", "timeout", "memory", "crashed")


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


_SPACED_THOUSANDS = re.compile(r"(?<=\d)(?:\\[,;: ]|~|\s)+(?=\d{3}(?!\d))")
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def _prepare(answer: str) -> str:
    """What math-verify does not do: drop a full stop ending the answer, join digit groups split by spaces."""
    s = answer.strip()
    body = s.rstrip("}")
    return _SPACED_THOUSANDS.sub("", body.rstrip(".") + s[len(body) :])


# ---------------------------------------------------------------------------------------------
# The worker process: math-verify in its main thread
# ---------------------------------------------------------------------------------------------
_references: dict[str, list] = {}  # parsed reference answers (a prompt's samples share one)


def _grade(predicted: str, reference: str, timeout_s: float) -> tuple[bool, str]:
    """(passed, reason) by math-verify's parse and verify, each call's alarm the whole seconds left of timeout_s."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    deadline = time.monotonic() + timeout_s
    config = [LatexExtractionConfig(), ExprExtractionConfig()]

    def left() -> int:
        return max(1, int(deadline - time.monotonic()))

    def parsed(answer: str) -> list:
        return parse(f"\\boxed{{{answer}}}", extraction_config=config, parsing_timeout=left(), raise_on_error=True)

    try:
        gold = _references.get(reference)
        if gold is None:
            if len(_references) >= 1024:
                _references.clear()
            gold = _references[reference] = parsed(reference)
        target = parsed(predicted)
    except TimeoutException:
        return False, "timeout"
    except MemoryError:
        return False, "memory"
    except Exception:
        return False, "unparsed"
    reason = "wrong" if any(not isinstance(t, str) for t in target) else "unparsed"
    for g, t in itertools.product(gold, target):  # verify()'s own order, gold first
        try:
            if verify(g, t, timeout_seconds=left(), raise_on_error=True):
                return True, "match"
        except TimeoutException:
            reason = "timeout"
        except MemoryError:
            reason = "memory"
        except Exception:  # a pair the library cannot compare is not equal (its own default)
            pass
    return False, reason


def _worker_main(conn, memory_bytes: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the trainer's to handle; it kills its workers
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    try:
        _grade("1", "1", 5.0)  # imports math-verify and compiles its patterns before "ready"
    except ImportError as err:
        conn.send(f"{err} (math-verify is a dependency of megatron-spo: pip install math-verify==0.9.0)")
        return
    conn.send("ready")
    while True:
        try:
            predicted, reference, timeout_s = conn.recv()
        except EOFError:
            return
        try:
            result = _grade(predicted, reference, timeout_s)
        except MemoryError:
            result = (False, "memory")
        del predicted, reference
        try:
            conn.send(result)
        except MemoryError:  # pickling the verdict itself, at the limit
            conn.send((False, "memory"))


class _Worker:
    """One judge process, spawned on first use; killed when a verdict passes its deadline, then spawned again."""

    def __init__(self, memory_mb: int):
        self.memory_mb = memory_mb
        self.lock = threading.Lock()
        self.proc = None
        self.conn = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def start(self) -> None:
        """Under self.lock: spawn the process unless it runs."""
        if self.alive():
            return
        self.kill()
        ctx = multiprocessing.get_context("spawn")  # never fork a trainer's threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, self.memory_mb << 20), daemon=True,
                                name="math-judge")
        self.proc.start()
        child.close()
        try:
            msg = self.conn.recv() if self.conn.poll(STARTUP_TIMEOUT_S) else f"no word in {STARTUP_TIMEOUT_S:g} s"
        except EOFError:
            self.proc.join(5)
            msg = f"it exited with code {self.proc.exitcode}"
        if msg != "ready":
            self.kill()
            raise RuntimeError(f"math judge: the worker did not start: {msg}")

    def ask(self, predicted: str, reference: str, timeout_s: float) -> tuple[bool, str]:
        with self.lock:
            self.start()
            try:
                self.conn.send((predicted, reference, timeout_s))
                if not self.conn.poll(timeout_s):
                    self.kill()
                    return False, "timeout"
                return tuple(self.conn.recv())
            except (EOFError, OSError):  # died without a word (e.g. a C stack overflow)
                self.kill()
                return False, "crashed"
            except BaseException:  # interrupted mid-verdict: its late answer must not reach the next caller
                self.kill()
                raise

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
        self.proc = self.conn = None


class MathJudge:
    """math-verify's verdicts from ``workers`` processes (each spawned on first need, under an address-space limit
    of ``memory_mb``, killed and replaced when a verdict passes ``timeout_s``). Thread-safe."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 2048, workers: int = 2,
                 max_answer_chars: int | None = MAX_ANSWER_CHARS):
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"MathJudge: timeout_s must be > 0 and workers >= 1, got {timeout_s} and {workers}")
        self.timeout_s = timeout_s
        self.max_answer_chars = max_answer_chars
        self._workers = [_Worker(memory_mb) for _ in range(workers)]
        self._idle: queue.LifoQueue = queue.LifoQueue()  # the warmest worker first: others start under load only
        for worker in reversed(self._workers):
            self._idle.put(worker)

    @property
    def started(self) -> int:
        """Worker processes running now."""
        return sum(w.alive() for w in self._workers)

    def warm(self) -> None:
        """Start every worker now (otherwise each starts on first need; start-up is not verdict time)."""
        for worker in self._workers:
            with worker.lock:
                worker.start()

    def verdict(self, predicted: str | None, reference: str) -> tuple[bool, str]:
        """(passed, reason in REASONS): one verdict within timeout_s (plus any wait for a free worker and its
        start-up), whatever ``predicted`` holds."""
        if self.max_answer_chars is not None and predicted is not None and len(predicted) > self.max_answer_chars:
            return False, "too_long"
        if predicted is None or not (a := _prepare(predicted)):
            return False, "no_answer"
        b = _prepare(reference)
        if a == b or (_PLAIN_NUMBER.fullmatch(a) and _PLAIN_NUMBER.fullmatch(b)):  # '12' vs '13.0': no worker
            passed = a == b or Decimal(a) == Decimal(b)  # exact (math-verify rounds to 6 decimals)
            return passed, "match" if passed else "wrong"
        worker = self._idle.get()
        try:
            return worker.ask(a, b, self.timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for worker in self._workers:
            with worker.lock:
                worker.kill()


_default_judge: MathJudge | None = None
_judge_lock = threading.Lock()


def default_judge() -> MathJudge:
    global _default_judge
    with _judge_lock:
        if _default_judge is None:
            _default_judge = MathJudge()
        return _default_judge


def answers_match(predicted: str | None, reference: str | None, *, judge: MathJudge | None = None) -> bool:
    """Whether two final answers are the same by math-verify (a timed-out or failed verdict: not the same)."""
    if reference is None:
        return False
    return (judge or default_judge()).verdict(predicted, reference)[0]


def math_reward(completion: str, reference_answer: str, *, judge: MathJudge | None = None) -> tuple[float, dict]:
    """0 when the completion's last \\boxed{} answer matches the reference, else -1 (missing box included);
    info["reason"] says why (REASONS)."""
    predicted = last_boxed(completion)
    passed, reason = (judge or default_judge()).verdict(predicted, reference_answer)
    return (0.0 if passed else -1.0), {"predicted": predicted, "reference": reference_answer, "passed": passed,
                                       "reason": reason}
