"""The reward sandbox against hostile programs: each test asserts the outcome, that the host is unchanged
and that no process of the sandbox's uids is left."""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import socket
import textwrap
import time
import uuid

import pytest

from megatron_spo.rewards._sandbox_host import processes_of_uid
from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rewards.sandbox import (
    SandboxPool,
    SandboxUnavailableError,
    outputs_match,
    run_tests,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-slot uids need root (the CI machine runs as root)")

LIMITS = {"time_limit_s": 1.0, "memory_mb": 512}
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def pool():
    # No pre-started spares here, so that "no process of the slot uids" can be checked after every report.
    cfg = SandboxConfig(slots=2, uid_base=2_000_000, prestart=False)
    try:
        p = SandboxPool(cfg)
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")
    yield p
    p.close()
    assert not leftovers(p)


def leftovers(pool: SandboxPool) -> list[int]:
    return [pid for uid in pool.slot_uids for pid in processes_of_uid(uid)]


def run(pool: SandboxPool, program: str, tests, **limits):
    report = pool.submit(textwrap.dedent(program), tests, **{**LIMITS, **limits}).result(timeout=120)
    assert not leftovers(pool), "a sandboxed process outlived its report"
    assert pool._host.poll() is None, "the pool host died"
    return report


# ---------------------------------------------------------------------------------------------
# Correct and wrong programs
# ---------------------------------------------------------------------------------------------
def test_correct_program_passes_and_wrong_answer_is_reported(pool):
    report = run(pool, ADD, [("1 2\n", "3\n"), ("10 -4", "6"), ("2 2\n", "5\n")])
    assert report.statuses == ("ok", "ok", "wrong_answer")
    assert not report.passed
    assert report.outcomes[2].stdout_head == "4\n"
    assert run(pool, ADD, [("1 2\n", "3\n"), ("5 5\n", "10")]).passed


def test_common_input_idioms(pool):
    idioms = [
        "import sys\ndef main():\n    a, b = map(int, sys.stdin.readline().split())\n    print(a + b)\n"
        "if __name__ == '__main__':\n    main()\n",
        "print(sum(map(int, open(0).read().split())))\n",
        "import sys\nsys.stdout.write(str(sum(map(int, sys.stdin.buffer.read().split()))) + '\\n')\n",
    ]
    futures = [pool.submit(p, [("1 2\n", "3\n"), ("40 2", "42")], **LIMITS) for p in idioms]
    assert [f.result(timeout=120).statuses for f in futures] == [("ok", "ok")] * 3


def test_runtime_errors_syntax_errors_and_exit_codes(pool):
    report = run(pool, "import sys\nx = int(input())\nsys.exit(x)\n", [("0\n", ""), ("3\n", ""), ("zz\n", "")])
    assert report.statuses == ("ok", "runtime_error", "runtime_error")
    assert report.outcomes[1].exit_code == 3
    assert "ValueError" in report.outcomes[2].stderr_tail
    report = run(pool, "print(1 +\n", [("", "1")])
    assert report.statuses == ("runtime_error",) and "SyntaxError" in report.outcomes[0].stderr_tail


def test_thread_stack_idiom_and_private_tmp_cleared_between_tests(pool):
    # Deep recursion in a big-stack thread (a common contest idiom) must work: threads are allowed.
    deep = """
    import sys, threading
    sys.setrecursionlimit(10 ** 6)
    threading.stack_size(1 << 26)
    def depth(n):
        return 0 if n == 0 else 1 + depth(n - 1)
    threading.Thread(target=lambda: print(depth(int(input())))).start()
    """
    assert run(pool, deep, [("50000\n", "50000\n")]).statuses == ("ok",)
    # Each test sees an empty /tmp even though the previous test of the same program wrote there.
    tmp = """
    import os
    print(sorted(os.listdir("/tmp")))
    open("/tmp/state", "w").write("x")
    """
    assert run(pool, tmp, [("", "[]"), ("", "[]")]).statuses == ("ok", "ok")


def test_float_tolerance_and_whitespace_rules():
    assert outputs_match(b"1  2\n3\n", "1 2 3")
    assert not outputs_match(b"1 2", "1 2 3")
    assert not outputs_match(b"0.3333", "0.333333")
    assert outputs_match(b"0.333333 x", "0.3333333 x", float_tolerance=1e-6)
    assert not outputs_match(b"0.33 x", "0.3333333 x", float_tolerance=1e-6)
    assert outputs_match(b"nan", "nan")
    assert not outputs_match(b"abc", "abd", float_tolerance=1.0)


def test_bad_input_is_refused_with_a_clear_message(pool):
    with pytest.raises(TypeError, match=r"tests\[1\] must be a pair of strings"):
        pool.submit(ADD, [("1 2", "3"), ("1 2",)])
    with pytest.raises(TypeError, match="program must be a str"):
        pool.submit(b"print(1)", [("", "1")])
    with pytest.raises(ValueError, match="time_limit_s must be > 0"):
        pool.submit(ADD, [("1 2", "3")], time_limit_s=0)


def test_many_programs_concurrently_and_async(pool):
    programs = [f"print(int(input()) * {k})" for k in range(6)]
    futures = [pool.submit(p, [("7\n", str(7 * k))], **LIMITS) for k, p in enumerate(programs)]
    assert [f.result(timeout=120).statuses for f in futures] == [("ok",)] * 6

    async def both():
        return await asyncio.gather(pool.run(ADD, [("1 1", "2")]), pool.run(ADD, [("1 1", "3")]))

    good, bad = asyncio.run(both())
    assert good.passed and bad.statuses == ("wrong_answer",)
    assert not leftovers(pool)


def test_a_run_its_caller_cancelled_leaves_the_pool_serving(pool):
    """A caller that gives up (a stopped rollout cancels its asyncio task, and with it the run's future): the result
    that arrives later is dropped, and the reader thread keeps serving every other run."""
    slow = pool.submit("import time\ntime.sleep(1)\nprint(3)", [("", "3")], **LIMITS)
    assert slow.cancel()
    assert pool.submit(ADD, [("1 2\n", "3\n")], **LIMITS).result(timeout=120).passed
    deadline = time.monotonic() + 120  # until the cancelled run's result has come back (the reader pops it)
    while pool._pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pool._pending, "the cancelled run's result never came back"
    assert pool._reader.is_alive() and pool.submit(ADD, [("2 2\n", "4\n")], **LIMITS).result(timeout=120).passed
    assert not leftovers(pool)


def test_two_pools_never_share_slot_uids(pool):
    # Each pool kills leftovers of its own uids: sharing one would let a pool kill the other's sandboxes.
    other = SandboxPool(SandboxConfig(slots=2, uid_base=pool.config.uid_base, prestart=False))
    try:
        assert len(set(other.slot_uids) | set(pool.slot_uids)) == 4
        slow = "import time\ntime.sleep(0.3)\nprint(1)\n"
        futures = [p.submit(slow, [("", "1")], **LIMITS) for p in (pool, other, pool, other)]
        assert [f.result(timeout=120).statuses for f in futures] == [("ok",)] * 4
    finally:
        other.close()
    assert not leftovers(other)


def test_prestarted_sandboxes_run_jobs_and_leave_nothing_after_close():
    with SandboxPool(SandboxConfig(slots=2, uid_base=2_000_000, prestart=True)) as warm:
        futures = [warm.submit(ADD, [("1 2", "3"), ("2 2", "5")], **LIMITS) for _ in range(5)]
        futures.append(warm.submit("import os\nos.fork()\n", [("", "")], **LIMITS))
        assert [f.result(timeout=120).statuses for f in futures] == [("ok", "wrong_answer")] * 5 + [("runtime_error",)]
        assert leftovers(warm)  # spares wait in the idle slots
    assert not leftovers(warm)


def test_run_tests_contract_entry_point(pool):
    report = run_tests(ADD, [("2 3\n", "5\n")], time_limit_s=1, memory_mb=256, pool=pool)
    assert report.passed and report.statuses == ("ok",) and report.isolation == "bubblewrap"


# ---------------------------------------------------------------------------------------------
# Hostile programs
# ---------------------------------------------------------------------------------------------
def test_infinite_loop_times_out(pool):
    report = run(pool, "while True:\n    pass\n", [("", "")])
    assert report.statuses == ("timeout",)
    assert report.outcomes[0].wall_s < 2.0 + 1.0  # wall deadline = max(2 x 1 s, 1 s + 1 s)


def test_ten_gib_allocation_is_a_memory_error(pool):
    report = run(pool, "x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n", [("", "")])
    assert report.statuses == ("memory",)


def test_fork_bomb_is_denied(pool):
    report = run(pool, "import os\nwhile True:\n    os.fork()\n", [("", "")])
    assert report.statuses == ("runtime_error",)
    assert "PermissionError" in report.outcomes[0].stderr_tail


def test_thread_bomb_hits_the_process_limit(pool):
    bomb = """
    import threading, time
    while True:
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    """
    report = run(pool, bomb, [("", "")])
    assert report.statuses == ("runtime_error",)
    assert "can't start new thread" in report.outcomes[0].stderr_tail


def test_host_files_are_invisible(pool):
    program = """
    import os
    print(sorted(os.listdir("/")))
    print(open("/etc/passwd").read())
    """
    report = run(pool, program, [("", "")])
    assert report.statuses == ("runtime_error",)
    assert "FileNotFoundError" in report.outcomes[0].stderr_tail
    seen = set(eval(report.outcomes[0].stdout_head.splitlines()[0]))
    allowed = {"bin", "sbin", "lib", "lib32", "lib64", "usr", "proc", "dev", "tmp", "sandbox"}
    allowed |= {root.split("/")[1] for root in pool._argv if root.startswith("/") and root.count("/") > 1}
    assert {"usr", "tmp", "proc"} <= seen <= allowed
    assert not {"etc", "home", "work", "var"} & seen


def test_writes_outside_tmp_fail_and_leave_the_host_unchanged(pool):
    name = f"spo-sandbox-{uuid.uuid4().hex}"
    host_paths = [f"/{name}", f"/usr/{name}", f"/tmp/{name}", os.path.join(os.getcwd(), name)]
    program = f"""
    for path in {host_paths!r}[:2] + ["/proc/sys/kernel/hostname", "/dev/{name}"]:
        try:
            open(path, "w").write("x")
            print("written")
        except OSError:
            print("denied")
    open("/tmp/{name}", "w").write("inside")
    print(open("/tmp/{name}").read())
    """
    report = run(pool, program, [("", "denied denied denied denied inside")])
    assert report.statuses == ("ok",), report.outcomes[0]
    assert not any(os.path.exists(p) for p in host_paths)  # the sandbox's /tmp is its own


def test_network_is_unreachable_and_the_host_listener_sees_nothing(pool):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        for address in (("127.0.0.1", port), ("1.1.1.1", 53)):
            program = f"import socket\nsocket.create_connection({address!r}, timeout=0.5)\nprint('connected')\n"
            report = run(pool, program, [("", "")])
            assert report.statuses == ("runtime_error",)
            assert "PermissionError" in report.outcomes[0].stderr_tail
            assert "connected" not in report.outcomes[0].stdout_head
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_killing_the_parent_is_denied_and_the_supervisor_survives(pool):
    program = """
    import os, signal
    for pid in (os.getppid(), 1, -1, 0):
        try:
            os.kill(pid, signal.SIGKILL)
            print("killed", pid)
        except PermissionError:
            print("denied")
    """
    report = run(pool, program, [("", "denied " * 4)] * 2)
    assert report.statuses == ("ok", "ok")  # the second test ran: the supervisor is alive
    assert run(pool, ADD, [("1 1", "2")]).passed


def test_a_gigabyte_of_output_is_cut_off(pool):
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n"
    report = run(pool, program, [("", "")], time_limit_s=5)
    assert report.statuses == ("output_limit",)
    assert pool.config.output_limit_mb * (1 << 20) < report.outcomes[0].stdout_bytes < (1 << 30)


def test_sleeping_past_the_deadline_is_a_timeout(pool):
    report = run(pool, "import time\ntime.sleep(60)\nprint('woke')\n", [("", "woke")])
    assert report.statuses == ("timeout",)
    assert 2.0 <= report.outcomes[0].wall_s < 4.0 and report.outcomes[0].cpu_s < 0.5


def test_double_forked_daemon_cannot_start(pool):
    program = """
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            while True:
                time.sleep(1)
    print("parent")
    """
    report = run(pool, program, [("", "parent")])
    assert report.statuses == ("runtime_error",)
    assert "PermissionError" in report.outcomes[0].stderr_tail


@pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers")
def test_raw_syscalls_through_ctypes_are_denied(pool):
    program = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    calls = {
        "fork": (57,), "vfork": (58,), "clone": (56, 17, 0, 0, 0, 0), "ptrace": (101, 0, 0, 0, 0),
        "unshare": (272, 0x10000000), "mount": (165, 0, 0, 0, 0, 0), "socket": (41, 2, 1, 0),
        "kill": (62, 1, 9), "setns": (308, 0, 0), "bpf": (321, 0, 0, 0),
    }
    for name, args in calls.items():
        print(name, libc.syscall(*args), ctypes.get_errno())
    """
    report = run(pool, program, [("", "")])
    lines = report.outcomes[0].stdout_head.split("\n")[:-1]
    assert report.statuses == ("wrong_answer",) and len(lines) == 10  # one process printed everything
    assert all(line.split()[1:] == ["-1", "1"] for line in lines), lines  # -1, errno EPERM


def test_rlimits_cannot_be_raised(pool):
    program = """
    import resource
    for res in (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NPROC):
        try:
            resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            print("raised")
        except (ValueError, OSError):
            print("refused")
    x = bytearray(4 * 1024 ** 3)
    """
    report = run(pool, program, [("", "")])
    assert report.statuses == ("memory",)
    assert report.outcomes[0].stdout_head.split() == ["refused"] * 3


def test_closing_stdout_and_spinning_times_out(pool):
    report = run(pool, "import os\nos.close(1)\nwhile True:\n    pass\n", [("", "")])
    assert report.statuses == ("timeout",)


# ---------------------------------------------------------------------------------------------
# Availability and the weaker mode
# ---------------------------------------------------------------------------------------------
def test_missing_bubblewrap_is_a_clear_error():
    with pytest.raises(SandboxUnavailableError, match="bubblewrap not found.*sandbox.isolation=rlimits-only"):
        SandboxPool(SandboxConfig(bwrap_path="/nonexistent/bwrap"))


def test_weak_mode_warns_on_every_start_and_still_denies_fork(caplog):
    cfg = SandboxConfig(isolation="rlimits-only", slots=1, uid_base=2_000_000, prestart=False)
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_spo.rewards.sandbox"):
            weak = SandboxPool(cfg)
        assert any("WEAK isolation" in r.getMessage() for r in caplog.records)
        try:
            assert run(weak, ADD, [("1 2", "3")]).passed
            report = run(weak, "import os\nos.fork()\n", [("", "")])
            assert report.statuses == ("runtime_error",) and report.isolation == "rlimits-only"
        finally:
            weak.close()
