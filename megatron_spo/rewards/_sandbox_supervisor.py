"""Runs INSIDE the sandbox: one process per program, a fresh fork per test.

Standalone on purpose (stdlib only, no project imports): the sandbox sees this one file, the Python
installation and /usr, all read-only. Protocol on stdin/stdout, every frame a 4-byte big-endian length
then the payload:

    in:  header (a marshal dict: limits + two seccomp BPF programs), program source, one frame per test input
    out: b"ready", then per test: result fields (tab-separated text), stderr tail, captured stdout

Imports are kept to C modules (no json, re, threading, traceback): the interpreter starts once per program,
and its start-up is most of a sandbox's fixed cost.

Expected outputs never come in: the host compares. Two seccomp layers: ``base_filter`` on this process
(no sockets, mounts, namespaces, ptrace, ...) and ``test_filter`` stacked on each test child before the
program runs (additionally no fork/exec, no signals to other processes, no new sessions).
"""

import atexit
import ctypes
import io
import marshal
import os
import resource
import select
import signal
import struct
import sys
import time

MEMORY_EXIT = 86  # a test child exits with this after an uncaught MemoryError
SETUP_FAIL_EXIT = 87  # the test child could not set up its limits: an infrastructure error
_FRAME = struct.Struct("!I")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 4, 22, 38, 2


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompProgram:
    """A compiled BPF program kept in memory so that loading it after fork is one prctl."""

    def __init__(self, bpf: bytes):
        if not bpf or len(bpf) % 8:
            raise ValueError(f"seccomp program of {len(bpf)} bytes is not a whole number of BPF instructions")
        self._buf = ctypes.create_string_buffer(bpf, len(bpf))
        self._prog = _SockFprog(len(bpf) // 8, ctypes.cast(self._buf, ctypes.c_void_p))

    def load(self) -> None:
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(self._prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        data = os.read(fd, min(left, 1 << 20))
        if not data:
            raise EOFError(f"stream ended {left} bytes short")
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def read_frame(fd: int) -> bytes:
    (n,) = _FRAME.unpack(read_exact(fd, _FRAME.size))
    return read_exact(fd, n)


def write_frame(fd: int, payload: bytes) -> None:
    view = memoryview(_FRAME.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


def _set_limits(limits: dict) -> None:
    mb = 1 << 20
    cpu = max(1, int(-(-limits["time_limit_s"] // 1)))  # whole seconds, rounded up; exact check after exit
    for res, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_STACK, (min(limits["memory_mb"], 256) * mb,) * 2),
        (resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2),
        (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
        (resource.RLIMIT_NPROC, (limits["processes"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(res, value)


def _exit_code(err: SystemExit) -> int:
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code & 0xFF
    print(err.code, file=sys.stderr)
    return 1


def run_test_child(source: str, input_fd: int, out_w: int, err_w: int, limits: dict, test_filter) -> None:
    """In the forked child: wire stdio, drop to the test limits and filter, run the program. Never returns."""
    try:
        os.dup2(input_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        _set_limits(limits)
        test_filter.load()
    except BaseException:
        os._exit(SETUP_FAIL_EXIT)
    # Fresh streams: the inherited sys.stdin may hold buffered bytes of the supervisor's protocol.
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="surrogateescape"
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8", errors="surrogateescape"
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8", errors="backslashreplace",
        line_buffering=True,
    )
    main = type(sys)("__main__")
    main.__file__ = "/tmp/main.py"
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    code = 0
    try:
        try:
            exec(compile(source, "main.py", "exec"), main.__dict__)
        finally:
            if "threading" in sys.modules:  # like interpreter exit: wait for non-daemon threads (stack-size idiom)
                sys.modules["threading"]._shutdown()
            atexit._run_exitfuncs()
    except SystemExit as err:
        code = _exit_code(err)
    except MemoryError:
        code = MEMORY_EXIT
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
        except BaseException:
            pass
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def _clear_tmp() -> None:
    """Remove what the previous test left in the private /tmp (tests must not see each other's files)."""
    for root, dirs, _ in os.walk("/tmp"):  # first undo any chmod that would hide a folder's contents
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
            except OSError:
                pass
    for root, dirs, files in os.walk("/tmp", topdown=False):
        for name in files + dirs:
            path = os.path.join(root, name)
            try:
                os.rmdir(path) if name in dirs and not os.path.islink(path) else os.unlink(path)
            except OSError:
                pass


def run_one(source: str, test_input: bytes, limits: dict, test_filter, private_tmp: bool) -> tuple[bytes, bytes, bytes]:
    """Fork, run one test, return (result fields, stderr tail, stdout). Status "finished" = exit 0."""
    memfd = os.memfd_create("stdin", 0)
    view = memoryview(test_input)
    while view:
        view = view[os.write(memfd, view) :]
    os.lseek(memfd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        run_test_child(source, memfd, out_w, err_w, limits, test_filter)
    for fd in (memfd, out_w, err_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    for fd in (out_r, err_r, pidfd):
        poller.register(fd, select.POLLIN)
    cap = limits["output_limit_bytes"]
    stdout, stdout_len, stderr_tail, stderr_len = [], 0, b"", 0
    open_pipes, exited, killed_for = {out_r, err_r}, False, None
    deadline = start + limits["wall_limit_s"]
    while killed_for is None and (open_pipes or not exited):
        left = deadline - time.monotonic()
        if left <= 0:
            killed_for = "timeout"
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == pidfd:
                exited = True
                poller.unregister(pidfd)
                continue
            data = os.read(fd, 1 << 16)
            if not data:
                poller.unregister(fd)
                open_pipes.discard(fd)
            elif fd == out_r:
                stdout_len += len(data)
                if stdout_len <= cap:
                    stdout.append(data)
            else:
                stderr_len += len(data)
                stderr_tail = (stderr_tail + data)[-4096:]
            if stdout_len > cap or stderr_len > cap:
                killed_for = "output_limit"
                break
    if killed_for is not None:
        os.kill(pid, signal.SIGKILL)
    _, wait_status, usage = os.wait4(pid, 0)
    wall_s = time.monotonic() - start
    for fd in (out_r, err_r, pidfd):
        os.close(fd)
    cpu_s = usage.ru_utime + usage.ru_stime
    exit_code = os.waitstatus_to_exitcode(wait_status)
    signum = -exit_code if exit_code < 0 else None
    if killed_for is not None:
        status = killed_for
    elif cpu_s > limits["time_limit_s"] or signum == signal.SIGXCPU:
        status = "timeout"
    elif exit_code == SETUP_FAIL_EXIT:
        status = "setup_failed"
    elif exit_code == MEMORY_EXIT or signum == signal.SIGKILL:  # SIGKILL not sent by us: the OOM killer
        status = "memory"
    elif exit_code != 0:
        status = "runtime_error"
    else:
        status = "finished"
    if private_tmp:
        _clear_tmp()
    fields = (status, "" if signum is not None else exit_code, signum or "", f"{cpu_s:.4f}", f"{wall_s:.4f}",
              stdout_len, stderr_len, usage.ru_maxrss)
    return "\t".join(map(str, fields)).encode(), stderr_tail, b"".join(stdout)


def main() -> int:
    header = marshal.loads(read_frame(0))
    source = read_frame(0).decode("utf-8", "surrogateescape")
    inputs = [read_frame(0) for _ in range(header["n_tests"])]
    limits = header["limits"]
    base_filter = SeccompProgram(header["base_filter"])
    test_filter = SeccompProgram(header["test_filter"])
    # Not dumpable: a test child (same uid) cannot open /proc/<supervisor>/mem or ptrace us.
    if _libc.prctl(PR_SET_DUMPABLE, 0, None, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
    base_filter.load()
    write_frame(1, b"ready")
    for test_input in inputs:
        for frame in run_one(source, test_input, limits, test_filter, header["private_tmp"]):
            write_frame(1, frame)
    return 0


if __name__ == "__main__":
    sys.exit(main())
