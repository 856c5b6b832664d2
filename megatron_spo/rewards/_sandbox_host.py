"""The sandbox pool's host process: launches sandboxes, feeds them, collects their frames, reaps everything.

A separate process because it must be the child subreaper and call ``waitpid(-1)``: bubblewrap's inner
pid 1 is reparented to the nearest subreaper when the outer bwrap exits, and reaping "any child" inside the
caller's process would steal exit statuses from its other subprocesses. Stdlib only, one thread, one
selector loop. Talks to the pool (megatron_spo/rewards/sandbox.py) with pickled frames on stdin/stdout:

    in:  {"op": "config", "slots": [[uid, gid] | None, ...], "scan_uids": bool, "argv", "env", "prestart": bool}
         {"op": "run", "id", "stdin": bytes, "deadline_s", "max_frame"}
    out: {"op": "started"}, {"op": "done", "id", "frames": [bytes], "error": str | None, "stderr": str,
          "returncode": int | None}

With ``prestart``, every idle slot holds a started sandbox (bubblewrap set up, interpreter loaded, blocked
on its stdin) and a job is handed to one of them: the start-up is paid while the slot would idle anyway.
"""

import collections
import ctypes
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import time

_FRAME = struct.Struct("!I")
PR_SET_CHILD_SUBREAPER = 36
DRAIN_GRACE_S = 0.5  # after a sandbox ends, how long its uid may still own processes before SIGKILL


def processes_of_uid(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid`` (a slot is reused only when this is empty)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as f:
                status = f.read(2048)
        except OSError:
            continue
        at = status.find(b"\nUid:")
        if at >= 0 and int(status[at + 5 :].split(None, 1)[0]) == uid:
            pids.append(int(entry.name))
    return pids


class Job:
    """One sandbox. A spare (id None) is started before its program is known; ``attach`` gives it one."""

    def __init__(self, msg: dict | None = None):
        self.id = None
        self.stdin = memoryview(b"")
        self.deadline_s, self.max_frame = float("inf"), 1 << 16
        self.deadline = float("inf")
        self.fds = (-1, -1, -1)  # the sandbox's stdin, stdout, stderr
        self.proc: subprocess.Popen | None = None
        self.slot = -1
        self.buffer = bytearray()
        self.frames: list[bytes] = []
        self.stderr = b""
        self.error: str | None = None
        self.open_fds: dict[int, object] = {}  # fd -> the Popen stream owning it
        self.returncode: int | None = None
        if msg is not None:
            self.attach(msg)

    def attach(self, msg: dict) -> None:
        self.id = msg["id"]
        self.stdin = memoryview(msg["stdin"])
        self.deadline_s, self.max_frame = msg["deadline_s"], msg["max_frame"]
        self.deadline = time.monotonic() + self.deadline_s


class Host:
    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.queue: collections.deque[dict] = collections.deque()  # "run" messages waiting for a slot
        self.active: set[Job] = set()  # launched, result not sent yet
        self.by_pid: dict[int, Job] = {}
        self.by_fd: dict[int, Job] = {}
        self.slots: list = []
        self.free: list[int] = []
        self.draining: dict[tuple, tuple[Job, float]] = {}  # -> (job, when its sandbox ended)
        self.scan_uids = False
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.prestart = False
        self.spares: dict[int, Job] = {}  # slot -> a started sandbox waiting for a program
        self.inbuf = bytearray()
        self.closing = False
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        os.set_blocking(0, False)
        self.sel.register(0, selectors.EVENT_READ, "control")

    # -- messages ------------------------------------------------------------------------------
    def send(self, msg: dict) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(_FRAME.pack(len(payload)) + payload)
        try:
            while view:
                view = view[os.write(1, view) :]
        except BrokenPipeError:  # the pool is gone: stop everything
            self.closing = True

    def on_control(self) -> None:
        data = os.read(0, 1 << 20)
        if not data:
            self.closing = True
            self.sel.unregister(0)
            return
        self.inbuf += data
        while len(self.inbuf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self.inbuf)
            if len(self.inbuf) < _FRAME.size + n:
                break
            msg = pickle.loads(bytes(self.inbuf[_FRAME.size : _FRAME.size + n]))
            del self.inbuf[: _FRAME.size + n]
            if msg["op"] == "config":
                self.slots = msg["slots"]
                self.free = list(range(len(self.slots)))
                self.scan_uids = msg["scan_uids"]
                self.argv, self.env, self.prestart = msg["argv"], msg["env"], msg["prestart"]
                self.send({"op": "started"})
            elif msg["op"] == "run":
                self.queue.append(msg)
            elif msg["op"] == "close":
                self.closing = True

    # -- sandboxes -----------------------------------------------------------------------------
    def launch(self, job: Job, slot: int) -> None:
        job.slot = slot
        ids = self.slots[slot]
        kwargs = {"user": ids[0], "group": ids[1], "extra_groups": []} if ids is not None else {}
        argv, pass_fds = [], []
        try:
            for arg in self.argv:  # "@data:PATH": a descriptor of a file read here (bwrap --ro-bind-data FD)
                if arg.startswith("@data:"):
                    pass_fds.append(os.open(arg[6:], os.O_RDONLY | os.O_CLOEXEC))
                    arg = str(pass_fds[-1])
                argv.append(arg)
            job.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                cwd="/", close_fds=True, pass_fds=pass_fds, start_new_session=True, **kwargs,
            )
        except OSError as err:
            for fd in pass_fds:
                os.close(fd)
            job.error = f"could not start {self.argv[0]}: {err}"
            self.finish(job)
            return
        for fd in pass_fds:
            os.close(fd)
        if job.id is not None:  # the deadline counts from the start (a spare's from when it gets its job)
            job.deadline = time.monotonic() + job.deadline_s
        self.active.add(job)
        self.by_pid[job.proc.pid] = job
        job.fds = (job.proc.stdin.fileno(), job.proc.stdout.fileno(), job.proc.stderr.fileno())
        for stream in (job.proc.stdin, job.proc.stdout, job.proc.stderr):
            os.set_blocking(stream.fileno(), False)
            job.open_fds[stream.fileno()] = stream
        for fd in job.fds[1:]:
            self.sel.register(fd, selectors.EVENT_READ, "job")
            self.by_fd[fd] = job
        if job.id is None:
            self.spares[slot] = job
        else:
            self.start_writing(job)

    def start_writing(self, job: Job) -> None:
        """Feed the program and its inputs (a spare's stdin stays unregistered until it has a job)."""
        fd = job.fds[0]
        if fd in job.open_fds:
            self.sel.register(fd, selectors.EVENT_WRITE, "job")
            self.by_fd[fd] = job

    def close_fd(self, job: Job, fd: int) -> None:
        if fd in job.open_fds:
            if self.by_fd.pop(fd, None) is not None:
                self.sel.unregister(fd)
            try:  # through its file object, which owns the descriptor (never a bare os.close)
                job.open_fds.pop(fd).close()
            except OSError:
                pass

    def on_job_fd(self, fd: int) -> None:
        job = self.by_fd[fd]
        stdin_fd, _, stderr_fd = job.fds
        if fd == stdin_fd:
            try:
                job.stdin = job.stdin[os.write(fd, job.stdin[: 1 << 16]) :]
            except BrokenPipeError:
                job.stdin = job.stdin[:0]
            if not job.stdin:
                self.close_fd(job, fd)
            return
        data = os.read(fd, 1 << 16)
        if not data:
            self.close_fd(job, fd)
            return
        if fd == stderr_fd:
            job.stderr = (job.stderr + data)[-4096:]
            return
        job.buffer += data
        while len(job.buffer) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(job.buffer)
            if n > job.max_frame:
                job.error = f"sandbox sent a frame of {n} bytes (limit {job.max_frame})"
                self.kill(job)
                return
            if len(job.buffer) < _FRAME.size + n:
                break
            job.frames.append(bytes(job.buffer[_FRAME.size : _FRAME.size + n]))
            del job.buffer[: _FRAME.size + n]

    def kill(self, job: Job) -> None:
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for fd in list(job.open_fds):
            self.close_fd(job, fd)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.by_pid.pop(pid, None)
            if job is not None:
                job.returncode = job.proc.returncode = os.waitstatus_to_exitcode(status)
                try:  # the session may still hold a straggler (weak mode: the test child)
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def finish(self, job: Job) -> None:
        """The sandbox is gone; report once its slot uid owns no process (so callers can rely on that)."""
        if self.spares.get(job.slot) is job:
            del self.spares[job.slot]
        self.draining[("job", job.id) if job.id is not None else ("spare", id(job))] = (job, time.monotonic())

    def drain_slots(self) -> None:
        for key, (job, ended) in list(self.draining.items()):
            ids = self.slots[job.slot] if job.slot >= 0 else None
            left = processes_of_uid(ids[0]) if (self.scan_uids and ids is not None) else []
            waited = time.monotonic() - ended
            if left and waited > 20 * DRAIN_GRACE_S:  # unkillable (a zombie of a foreign parent?): say so, move on
                job.error = (job.error + "; " if job.error else "") + f"processes {left} of uid {ids[0]} did not exit"
            elif left:
                if waited > DRAIN_GRACE_S:
                    for pid in left:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                continue
            del self.draining[key]
            if job.slot >= 0:
                self.free.append(job.slot)
            if job.id is None:  # a spare that died before it got a program: stop pre-starting
                if not self.closing:
                    self.prestart = False
                    print(f"sandbox host: a pre-started sandbox exited ({job.stderr[-300:]!r}); "
                          "starting sandboxes on demand from now on", file=sys.stderr)
                continue
            self.send({"op": "done", "id": job.id, "frames": job.frames, "error": job.error,
                       "stderr": job.stderr.decode("utf-8", "replace"), "returncode": job.returncode})

    def step(self) -> None:
        now = time.monotonic()
        timeout = min([job.deadline - now for job in self.active if job.deadline < float("inf")], default=None)
        if self.draining:
            timeout = 0.01 if timeout is None else min(timeout, 0.01)
        for key, _ in self.sel.select(None if timeout is None else max(timeout, 0)):
            if key.data == "wake":
                os.read(key.fd, 4096)
            elif key.data == "control":
                self.on_control()
            elif key.fd in self.by_fd:
                self.on_job_fd(key.fd)
        self.reap()
        now = time.monotonic()
        for job in list(self.active):
            if now > job.deadline and (job.returncode is None or job.open_fds):
                job.error = job.error or f"sandbox passed its deadline of {job.deadline_s:.1f} s"
                self.kill(job)
            if job.returncode is not None and not job.open_fds:
                self.active.discard(job)
                self.finish(job)
        self.drain_slots()
        while self.queue and self.spares and not self.closing:
            spare = self.spares.pop(next(iter(self.spares)))
            spare.attach(self.queue.popleft())
            self.start_writing(spare)
        while self.queue and self.free and not self.closing:
            self.launch(Job(self.queue.popleft()), self.free.pop(0))
        while self.prestart and self.free and not self.closing:
            self.launch(Job(), self.free.pop(0))

    def run(self) -> None:
        while not (self.closing and not self.active):
            if self.closing:
                for msg in self.queue:
                    job = Job(msg)
                    job.error = "sandbox pool closed"
                    self.finish(job)
                self.queue.clear()
                for job in self.active:
                    self.kill(job)
            self.step()
        deadline = time.monotonic() + 2 * DRAIN_GRACE_S
        while self.draining and time.monotonic() < deadline:
            self.drain_slots()
            self.reap()
            time.sleep(0.01)


def main() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"sandbox host: prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}", file=sys.stderr)
        return 1
    Host().run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
