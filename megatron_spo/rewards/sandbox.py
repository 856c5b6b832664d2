"""Run model-written programs against tests in real isolation.

    report = run_tests(program, [("1 2\\n", "3\\n")], time_limit_s=2, memory_mb=512)
    report.passed, report.statuses        # True, ("ok",)

Layers, outermost first:
  * a pool host process (``_sandbox_host.py``) that is the child subreaper and reaps everything, runs each
    sandbox as its slot's own unprivileged host uid, enforces a whole-sandbox deadline, and frees a slot
    only when no process of that uid is left;
  * bubblewrap: new user, pid, net, ipc, uts (and cgroup) namespaces, no nested user namespaces, a
    read-only root with only /usr, the Python installation and the supervisor script, a private size-capped
    /tmp, a fresh /proc and a minimal /dev;
  * the supervisor (``_sandbox_supervisor.py``): non-dumpable, under a seccomp filter denying sockets,
    mounts, namespaces, ptrace, module/kexec/bpf/io_uring/keyring calls; it forks once per test;
  * each test child: rlimits (CPU, address space, stack, file size, open files, processes, no core) and a
    second seccomp filter that also denies fork/vfork/exec, non-thread clone, signals to other processes
    and new sessions, loaded before the program's first instruction.

One sandbox per program, a fork per test inside it: interpreter start-up is paid once per program, and
with ``prestart`` (default) while the slot is idle: each idle slot holds a started sandbox waiting for one.
Programs run with this interpreter when the slot uids can reach it, else /usr/bin/python3 (stdlib only).
Expected outputs never enter the sandbox; they are compared here, CodeContests-style (whitespace-separated
tokens, optionally with a float tolerance).

Function-call tests (HumanEval's ``check(candidate)``, MBPP's asserts, TACO's ``fn_name`` problems) run in the same
sandbox, limits and statuses: a CallHarness wraps the solution in a fixed harness program, each test's input is
its stdin, and the harness reports a pass (or the call's JSON result) after a per-test nonce it reads from stdin,
so a program that exits early (``sys.exit(0)``) or prints "ok" does not pass. A call's expected result stays here;
assert tests (HumanEval, MBPP) carry theirs in the test code, which runs inside:

    report = pool.submit(solution, [("check(add)", "")], harness=CallHarness(setup=test_code)).result()
    report = pool.submit(solution, [("[1, 2]", "3")], harness=CallHarness(fn_name="add")).result()
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import fcntl
import functools
import json
import logging
import marshal
import os
import pickle
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_spo.rewards.config import SandboxConfig

logger = logging.getLogger(__name__)

STATUSES = ("ok", "wrong_answer", "timeout", "memory", "runtime_error", "output_limit")
_HERE = Path(__file__).resolve().parent
SUPERVISOR = _HERE / "_sandbox_supervisor.py"
HOST = _HERE / "_sandbox_host.py"
_FRAME = struct.Struct("!I")
SANDBOX_UID = 1000  # the uid programs see inside the user namespace
_SANDBOX_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

# Linux clone(2) flags.
CLONE_THREAD = 0x00010000
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)

# Denied for the supervisor and everything under it.
_DENY_ALWAYS = (
    "socket", "socketpair", "connect", "bind", "listen", "accept", "accept4",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "mount_setattr", "open_tree",
    "move_mount", "fsopen", "fsconfig", "fsmount", "fspick",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "acct", "swapon", "swapoff", "reboot", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "name_to_handle_at", "open_by_handle_at", "quotactl", "syslog", "vhangup", "iopl", "ioperm",
    "lookup_dcookie", "personality",
)
# Additionally denied for the program under test.
_DENY_IN_TEST = (
    "fork", "vfork", "execve", "execveat",
    "kill", "tkill", "tgkill", "pidfd_open", "pidfd_send_signal", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    "setsid", "setpgid",
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): could not start, broke its protocol, ..."""


class SandboxUnavailableError(SandboxError):
    """Bubblewrap or user namespaces are missing on this host."""


@dataclass(frozen=True)
class TestOutcome:
    """One test's result. Times in seconds; byte counts of what the program wrote."""

    __test__ = False  # not a pytest class

    status: str
    exit_code: int | None = None
    signal: int | None = None
    cpu_s: float = 0.0
    wall_s: float = 0.0
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    stdout_head: str = ""  # the first 1 KiB of stdout, for diagnostics
    stderr_tail: str = ""  # the last 4 KiB of stderr


@dataclass(frozen=True)
class TestReport:
    """All tests of one program, in order. ``passed`` needs at least one test and every test ok."""

    __test__ = False

    outcomes: tuple[TestOutcome, ...]
    isolation: str = "bubblewrap"
    details: dict = field(default_factory=dict)

    @property
    def statuses(self) -> tuple[str, ...]:
        return tuple(o.status for o in self.outcomes)

    @property
    def passed(self) -> bool:
        return bool(self.outcomes) and all(o.status == "ok" for o in self.outcomes)

    @property
    def wall_s(self) -> float:
        return sum(o.wall_s for o in self.outcomes)


# ---------------------------------------------------------------------------------------------
# Output comparison (outside the sandbox)
# ---------------------------------------------------------------------------------------------
def outputs_match(actual: bytes | str, expected: str, float_tolerance: float | None = None) -> bool:
    """CodeContests semantics: equal whitespace-separated tokens; with ``float_tolerance``, tokens that
    both parse as floats may differ by that much (absolute or relative)."""
    if isinstance(actual, bytes):
        actual = actual.decode("utf-8", "replace")
    got, want = actual.split(), expected.split()
    if got == want:
        return True
    if float_tolerance is None or len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g == w:
            continue
        try:
            gf, wf = float(g), float(w)
        except ValueError:
            return False
        if not abs(gf - wf) <= float_tolerance * max(1.0, abs(wf)):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Function-call tests: a harness program around the solution (inside), the nonce and the comparison (here)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallHarness:
    """How a problem's function-call tests run. The program is ``prefix`` + the solution (HumanEval's prompt: a
    completion may be the function's body), run as module "solution" (a main block does not run), then ``setup``
    in its namespace (HumanEval's test code defining ``check``, MBPP's test_setup_code). A test is (input, expected):
    without ``fn_name``, input is code that must run without an exception (an AssertionError is a wrong answer)
    and expected is unused; with ``fn_name``, input is the JSON list of arguments of a call of ``fn_name`` (a
    method of class Solution when there is one, as TACO / APPS call it), and expected the JSON value it must
    return (a list-wrapped expected value matches too: TACO's outputs)."""

    prefix: str = ""
    setup: str = ""
    fn_name: str | None = None


_HARNESS = """\
import os as _os, sys as _sys
_nonce, _, _test = _sys.stdin.read().partition("\\n")
_sys.modules["solution"] = _mod = type(_sys)("solution")  # a real module: dataclasses, enum, pickle work
_ns = _mod.__dict__
exec(compile(%(solution)r, "solution.py", "exec"), _ns)
exec(compile(%(setup)r, "test_setup.py", "exec"), _ns)
%(call)s
_sys.stdout.flush()
_sys.__stdout__.flush()
if _out is not None:
    _b = ("\\n%%s %%d\\n%%s" %% (_nonce, len(_out), _out)).encode("utf-8", "surrogateescape")
    while _b:
        _b = _b[_os.write(1, _b):]
"""
_ASSERT_CALL = """\
try:
    exec(compile(_test, "test.py", "exec"), _ns)
    _out = ""
except AssertionError:
    import traceback as _tb
    _tb.print_exc()
    _out = None"""
_FN_CALL = """\
import json as _json
_cls = _ns.get("Solution")
_fn = getattr(_cls(), %(fn)r) if isinstance(_cls, type) and hasattr(_cls, %(fn)r) else _ns[%(fn)r]
_args = _json.loads(_test)
_out = _json.dumps(_fn(*(_args if isinstance(_args, list) else [_args])), default=repr)"""


def harness_program(harness: CallHarness, solution: str) -> str:
    """The program the sandbox runs for ``solution`` under ``harness`` (the solution and setup as string literals:
    nothing of them is parsed until the harness runs them)."""
    call = _FN_CALL % {"fn": harness.fn_name} if harness.fn_name else _ASSERT_CALL
    return _HARNESS % {"solution": harness.prefix + solution, "setup": harness.setup, "call": call}


def _harness_result(stdout: bytes, nonce: str) -> str | None:
    """What the harness reported after its nonce (None: it never reported: failed, or exited before)."""
    i = stdout.find(f"\n{nonce} ".encode())
    if i < 0:
        return None
    head, _, rest = stdout[i + len(nonce) + 2 :].partition(b"\n")
    try:
        return rest.decode("utf-8", "surrogateescape")[: int(head)]
    except ValueError:
        return None


def values_match(got: Any, want: Any, float_tolerance: float | None = None) -> bool:
    """JSON values equal (numbers within ``float_tolerance``, absolute or relative, when given)."""
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(values_match(g, w, float_tolerance) for g, w in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(values_match(got[k], want[k], float_tolerance) for k in got)
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (got, want))
    if numbers and float_tolerance is not None:
        return abs(got - want) <= float_tolerance * max(1.0, abs(want))
    return got == want


def _call_matches(stdout: bytes, nonce: str, expected: str, fn_call: bool, float_tolerance: float | None) -> bool:
    result = _harness_result(stdout, nonce)
    if result is None or not fn_call:
        return result is not None
    try:
        got, want = json.loads(result), json.loads(expected)
    except ValueError:
        return False
    return values_match(got, want, float_tolerance) or (
        isinstance(want, list) and len(want) == 1 and values_match(got, want[0], float_tolerance))


def _job(program: str, tests: Sequence[tuple[str, str]], harness: CallHarness | None,
         float_tolerance: float | None) -> tuple[str, list[str], list[Callable[[bytes], bool]]]:
    """(program to run, stdin per test, verdict per test on its stdout) of a submission."""
    if harness is None:
        return program, [t[0] for t in tests], [
            functools.partial(outputs_match, expected=t[1], float_tolerance=float_tolerance) for t in tests]
    nonces = [secrets.token_hex(16) for _ in tests]
    checks = [functools.partial(_call_matches, nonce=n, expected=t[1], fn_call=bool(harness.fn_name),
                                float_tolerance=float_tolerance) for n, t in zip(nonces, tests)]
    return harness_program(harness, program), [f"{n}\n{t[0]}" for n, t in zip(nonces, tests)], checks


# ---------------------------------------------------------------------------------------------
# Building blocks: seccomp programs, the bubblewrap command line, the availability probe
# ---------------------------------------------------------------------------------------------
@functools.cache
def seccomp_programs() -> tuple[bytes, bytes]:
    """(supervisor filter, test filter) as raw BPF for this machine's architecture (other architectures'
    syscalls are killed: libseccomp's default), built once with libseccomp."""
    import pyseccomp as sc

    def build(deny: Sequence[str], test: bool) -> bytes:
        f = sc.SyscallFilter(sc.ALLOW)
        arch = sc.system_arch()
        for name in deny:
            if sc.resolve_syscall(arch, name) >= 0:  # absent on this architecture: nothing to deny
                f.add_rule(sc.ERRNO(errno.EPERM), name)
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes glibc fall back to clone.
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        for flag in CLONE_NAMESPACE_FLAGS:
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        if test:  # threads only: a clone without CLONE_THREAD is a new process
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
            f.add_rule(sc.ERRNO(errno.EPERM), "prlimit64", sc.Arg(0, sc.NE, 0))  # only its own limits
        with tempfile.TemporaryFile() as out:
            f.export_bpf(out)
            out.seek(0)
            return out.read()

    return build(_DENY_ALWAYS, test=False), build(_DENY_ALWAYS + _DENY_IN_TEST, test=True)


def _reachable_by_others(path: str) -> bool:
    """Whether an unprivileged uid can reach ``path`` (every ancestor folder searchable by 'other')."""
    parts = Path(os.path.realpath(path)).parents
    return all(os.stat(p).st_mode & 0o001 for p in parts) and bool(os.stat(path).st_mode & 0o005)


@functools.cache
def _interpreter_roots(python: str) -> tuple[str, ...]:
    """Folders ``python`` needs besides /usr: its prefix(es) and the folder of its executable."""
    run = subprocess.run([python, "-I", "-c", "import sys; print(sys.base_prefix); print(sys.prefix)"],
                         capture_output=True, text=True, timeout=60, check=True)
    roots: list[str] = []
    for p in [*run.stdout.split(), os.path.dirname(os.path.realpath(python))]:
        real = os.path.realpath(p)
        if real == "/usr" or real.startswith("/usr/") or any(real == r or real.startswith(r + "/") for r in roots):
            continue
        roots.append(real)
    return tuple(roots)


def resolve_python(cfg: SandboxConfig, switch_uid: bool) -> str:
    """The interpreter programs run with: ``sandbox.python``, or this one when other uids can reach it,
    else the system /usr/bin/python3 (stdlib only)."""
    if cfg.python != "auto":
        found = shutil.which(cfg.python)
        if found is None:
            raise SandboxUnavailableError(f"sandbox.python: interpreter {cfg.python!r} not found")
        return os.path.realpath(found)
    here = os.path.realpath(sys.executable)
    if not switch_uid or all(_reachable_by_others(r) for r in (here, *_interpreter_roots(here))):
        return here
    if os.path.exists("/usr/bin/python3"):
        logger.info("sandbox: %s is not reachable by the slot uids; programs run with /usr/bin/python3", here)
        return os.path.realpath("/usr/bin/python3")
    raise SandboxUnavailableError(
        f"sandbox: the interpreter {here} lies where unprivileged slot uids cannot reach it and there is no "
        "/usr/bin/python3; set sandbox.python to an interpreter under a world-readable path"
    )


def bubblewrap_argv(cfg: SandboxConfig, bwrap: str, python: str) -> list[str]:
    argv = [
        bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
        "--unshare-cgroup-try", "--disable-userns", "--die-with-parent", "--new-session",
        "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr",
    ]
    for top in ("bin", "sbin", "lib", "lib64", "lib32"):
        path = f"/{top}"
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for root in _interpreter_roots(python):
        argv += ["--ro-bind", root, root]
    argv += [
        # The supervisor's text is copied in by the pool host (a slot uid may not reach this checkout).
        "--ro-bind-data", f"@data:{SUPERVISOR}", "/sandbox/supervisor.py",
        "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",  # its tmpfs would otherwise be writable
        "--size", str(cfg.tmp_size_mb << 20), "--tmpfs", "/tmp",
        "--remount-ro", "/", "--chdir", "/tmp", "--clearenv",
    ]
    for key, value in _SANDBOX_ENV.items():
        argv += ["--setenv", key, value]
    return argv + [python, "-I", "-B", "/sandbox/supervisor.py"]


UID_LOCK_DIRS = ("/run/lock/megatron-spo-sandbox", "/tmp/megatron-spo-sandbox-uids")


def claim_slot_uids(base: int, n: int) -> tuple[list[int], list[int]]:
    """n host uids from ``base`` up, each held by an flock (released when the holder exits), skipping uids
    another pool holds or that own processes. Two pools must never share a uid: each kills leftovers of
    its own uids. Returns (uids, lock descriptors)."""
    from megatron_spo.rewards._sandbox_host import processes_of_uid

    for lock_dir in UID_LOCK_DIRS:
        try:
            os.makedirs(lock_dir, mode=0o700, exist_ok=True)
            break
        except OSError:
            continue
    uids, fds, uid = [], [], base
    while len(uids) < n:
        if uid >= base + 100_000:
            for fd in fds:
                os.close(fd)
            raise SandboxError(f"sandbox: no free slot uid in [{base}, {base + 100_000}) (sandbox.uid_base)")
        fd = os.open(os.path.join(lock_dir, f"uid-{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
        else:
            if processes_of_uid(uid):
                os.close(fd)
            else:
                uids.append(uid)
                fds.append(fd)
        uid += 1
    return uids, fds


@functools.cache
def _probe_bubblewrap(bwrap: str, uid: int | None) -> str | None:
    """None when bubblewrap can create the namespaces we need here, else why not."""
    kwargs = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--disable-userns", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
            "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "/usr/bin/true"]
    try:
        run = subprocess.run(argv, capture_output=True, timeout=30, cwd="/", **kwargs)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    return None if run.returncode == 0 else run.stderr.decode(errors="replace").strip() or f"exit {run.returncode}"


def check_isolation(cfg: SandboxConfig, probe_uid: int | None = None) -> str:
    """Resolve the isolation mode, raising a clear error when bubblewrap cannot work here.
    ``probe_uid``: the host uid sandboxes will run as (None: this process's)."""
    if cfg.isolation == "rlimits-only":
        logger.warning(
            "sandbox: WEAK isolation (sandbox.isolation=rlimits-only): seccomp + rlimits + a separate uid, "
            "but no namespaces and the host filesystem visible read-write where that uid may write"
        )
        return "rlimits-only"
    bwrap = shutil.which(cfg.bwrap_path)
    if bwrap is None:
        raise SandboxUnavailableError(
            f"sandbox: bubblewrap not found (sandbox.bwrap_path={cfg.bwrap_path!r}); install the Debian/Ubuntu "
            "package 'bubblewrap', or select the weaker mode explicitly with sandbox.isolation=rlimits-only"
        )
    why = _probe_bubblewrap(bwrap, probe_uid)
    if why is not None:
        raise SandboxUnavailableError(
            f"sandbox: bubblewrap cannot create user/pid/net namespaces here ({why}); enable unprivileged user "
            "namespaces (sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone), or select the "
            "weaker mode explicitly with sandbox.isolation=rlimits-only"
        )
    return "bubblewrap"


# ---------------------------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------------------------
def _frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload)) + payload


def _check_tests(tests: Sequence) -> None:
    if not isinstance(tests, Sequence) or isinstance(tests, (str, bytes)):
        raise TypeError(f"run_tests: tests must be a list of (input, expected_output) pairs, got {type(tests).__name__}")
    for i, pair in enumerate(tests):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise TypeError(f"run_tests: tests[{i}] must be a pair of strings (input, expected_output), got {pair!r:.80}")


def _resolve(future: Future, outcome: Any) -> None:
    """Set a run's result (or its SandboxError), unless its caller cancelled it meanwhile (a rollout stopped, a
    timed-out evaluation): the reader thread must outlive every caller that gives up."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass


class SandboxPool:
    """Runs many programs at once, one sandbox per program, ``slots`` sandboxes concurrently.

        with SandboxPool(SandboxConfig(slots=4)) as pool:
            futures = [pool.submit(p, tests) for p in programs]      # concurrent.futures.Future[TestReport]
            report = await pool.run(program, tests)                  # from asyncio code
    """

    def __init__(self, config: SandboxConfig | None = None):
        self.config = cfg = config or SandboxConfig()
        self.slots = cfg.slots or os.cpu_count() or 1
        self._uid_locks: list[int] = []
        if os.geteuid() == 0:  # one unprivileged host uid per slot
            self.slot_uids, self._uid_locks = claim_slot_uids(cfg.uid_base, self.slots)
            slot_ids: list = [[uid, uid] for uid in self.slot_uids]
        else:  # cannot switch uid: every slot runs as this user (inside its own user namespace)
            self.slot_uids, slot_ids = [], [None] * self.slots
        try:
            self._start(cfg, slot_ids)
        except BaseException:
            self._release_uids()
            raise

    def _start(self, cfg: SandboxConfig, slot_ids: list) -> None:
        self.isolation = check_isolation(cfg, self.slot_uids[0] if self.slot_uids else None)
        self._processes_limit = cfg.processes
        if not self.slot_uids:  # RLIMIT_NPROC counts every process of this uid on the host
            from megatron_spo.rewards._sandbox_host import processes_of_uid

            self._processes_limit += len(processes_of_uid(os.getuid()))
        self._base_filter, self._test_filter = seccomp_programs()
        self.python = resolve_python(cfg, switch_uid=bool(self.slot_uids))
        if self.isolation == "bubblewrap":
            self._argv = bubblewrap_argv(cfg, shutil.which(cfg.bwrap_path), self.python)
        else:
            self._argv = [self.python, "-I", "-B", "-c", SUPERVISOR.read_text()]
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, list[Callable[[bytes], bool]]]] = {}
        self._next_id = 0
        self._closed = False
        self._host = subprocess.Popen(
            [sys.executable, "-I", "-B", str(HOST)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/",
        )
        self._send({"op": "config", "slots": slot_ids, "scan_uids": bool(self.slot_uids), "argv": self._argv,
                    "env": dict(_SANDBOX_ENV), "prestart": cfg.prestart})
        started = self._recv()
        if started is None or started.get("op") != "started":
            self._host.kill()
            self._host.wait()
            raise SandboxError("sandbox: the pool host process failed to start")
        self._reader = threading.Thread(target=self._read_results, name="sandbox-pool-reader", daemon=True)
        self._reader.start()

    # -- public --------------------------------------------------------------------------------
    def submit(self, program: str, tests: Sequence[tuple[str, str]], *, time_limit_s: float | None = None,
               memory_mb: int | None = None, float_tolerance: float | None = None,
               harness: CallHarness | None = None) -> Future:
        """Run ``program`` on every test input (under ``harness``: function-call tests); the Future resolves to a
        TestReport (or SandboxError)."""
        if not isinstance(program, str):
            raise TypeError(f"run_tests: program must be a str, got {type(program).__name__}")
        _check_tests(tests)
        cfg = self.config
        time_limit_s = cfg.time_limit_s if time_limit_s is None else float(time_limit_s)
        memory_mb = cfg.memory_mb if memory_mb is None else int(memory_mb)
        if not time_limit_s > 0:
            raise ValueError(f"run_tests: time_limit_s must be > 0, got {time_limit_s}")
        if memory_mb < 32:
            raise ValueError(f"run_tests: memory_mb must be >= 32, got {memory_mb}")
        float_tolerance = cfg.float_tolerance if float_tolerance is None else float_tolerance
        wall_limit_s = max(time_limit_s * cfg.wall_factor, time_limit_s + 1.0)
        output_limit = int(cfg.output_limit_mb * (1 << 20))
        header = {
            "n_tests": len(tests),
            "limits": {
                "time_limit_s": time_limit_s, "wall_limit_s": wall_limit_s, "memory_mb": memory_mb,
                "output_limit_bytes": output_limit, "file_size_mb": cfg.file_size_mb,
                "open_files": cfg.open_files, "processes": self._processes_limit,
            },
            "private_tmp": self.isolation == "bubblewrap",  # only then may the supervisor empty /tmp
            "base_filter": self._base_filter,
            "test_filter": self._test_filter,
        }
        program, inputs, checks = _job(program, tests, harness, float_tolerance)
        stdin = b"".join([_frame(marshal.dumps(header)), _frame(program.encode("utf-8", "surrogateescape"))]
                         + [_frame(i.encode()) for i in inputs])
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise SandboxError("sandbox pool is closed")
            job_id = self._next_id
            self._next_id += 1
            self._pending[job_id] = (future, checks)
            self._send({
                "op": "run", "id": job_id, "stdin": stdin,
                "deadline_s": cfg.startup_timeout_s + len(tests) * (wall_limit_s + 0.5),
                "max_frame": output_limit + (1 << 16),
            })
        return future

    async def run(self, program: str, tests: Sequence[tuple[str, str]], **limits) -> TestReport:
        """asyncio wrapper of submit."""
        return await asyncio.wrap_future(self.submit(program, tests, **limits))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._send({"op": "close"})
                self._host.stdin.close()
            except OSError:
                pass
        try:
            self._host.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._host.kill()
            self._host.wait()
        self._reader.join(timeout=5)
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(SandboxError("sandbox pool closed before the program ran"))
        self._pending.clear()
        self._release_uids()

    def _release_uids(self) -> None:
        for fd in self._uid_locks:
            os.close(fd)
        self._uid_locks = []

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        self._host.stdin.write(_frame(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))
        self._host.stdin.flush()

    def _recv(self) -> dict | None:
        head = self._host.stdout.read(_FRAME.size)
        if len(head) < _FRAME.size:
            return None
        (n,) = _FRAME.unpack(head)
        return pickle.loads(self._host.stdout.read(n))

    def _read_results(self) -> None:
        while (msg := self._recv()) is not None:
            with self._lock:
                future, checks = self._pending.pop(msg["id"])
            try:
                outcome = self._report(msg, checks)
            except SandboxError as err:
                outcome = err
            _resolve(future, outcome)
        with self._lock:  # the host died: nothing pending will ever resolve
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            _resolve(future, SandboxError("sandbox pool host process exited"))

    def _report(self, msg: dict, checks: list[Callable[[bytes], bool]]) -> TestReport:
        frames, error = msg["frames"], msg["error"]
        if not frames or frames[0] != b"ready":
            raise SandboxError(
                f"sandbox did not start ({error or 'exit ' + str(msg['returncode'])}): {msg['stderr'].strip()[-500:]}"
            )
        outcomes = []
        for i, check in enumerate(checks):
            if 3 + 3 * i >= len(frames):
                # The supervisor died or the whole-sandbox deadline hit: the program's doing.
                status = "timeout" if error and "deadline" in error else "runtime_error"
                outcomes.append(TestOutcome(status=status, stderr_tail=msg["stderr"][-4096:]))
                continue
            meta, stderr, stdout = frames[1 + 3 * i : 4 + 3 * i]
            try:
                status, code, signum, cpu_s, wall_s, out_n, err_n, _ = meta.decode().split("\t")
                code_i, sig_i = (int(code) if code else None), (int(signum) if signum else None)
                cpu, wall, out_bytes, err_bytes = float(cpu_s), float(wall_s), int(out_n), int(err_n)
            except ValueError:
                raise SandboxError(f"sandbox sent a malformed result for test {i}: {meta[:200]!r}") from None
            if status == "setup_failed":
                raise SandboxError(f"sandbox could not apply limits for test {i}: {stderr[-500:]!r}")
            if status == "finished":
                status = "ok" if check(stdout) else "wrong_answer"
            elif status not in STATUSES:
                status = "runtime_error"
            outcomes.append(TestOutcome(
                status=status, exit_code=code_i, signal=sig_i, cpu_s=cpu, wall_s=wall, stdout_bytes=out_bytes,
                stderr_bytes=err_bytes, stdout_head=stdout[:1024].decode("utf-8", "replace"),
                stderr_tail=stderr.decode("utf-8", "replace"),
            ))
        return TestReport(outcomes=tuple(outcomes), isolation=self.isolation,
                          details={"sandbox_error": error} if error else {})


# ---------------------------------------------------------------------------------------------
# The contract entry point
# ---------------------------------------------------------------------------------------------
_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool:
    """A process-wide pool with the default SandboxConfig, started on first use, closed at exit."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = SandboxPool()
            atexit.register(_default_pool.close)
        return _default_pool


def run_tests(program: str, tests: list[tuple[str, str]], *, time_limit_s: float, memory_mb: int,
              float_tolerance: float | None = None, pool: SandboxPool | None = None,
              harness: CallHarness | None = None) -> TestReport:
    """Run ``program`` (Python source) on each (stdin, expected stdout) pair, or under ``harness`` on each
    function-call test; one status per test."""
    pool = pool or default_pool()
    return pool.submit(program, tests, time_limit_s=time_limit_s, memory_mb=memory_mb,
                       float_tolerance=float_tolerance, harness=harness).result()
