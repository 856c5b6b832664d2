"""Launch probe: stands in for the trainer, the rollout engines and the Q0 job inside the real sbatch script.

It checks what the SLURM launch gives each process, without a model: the env contract, a gloo
rendezvous over MASTER_ADDR/MASTER_PORT, the router and engine URLs, and the preemption contract
(SIGUSR1 -> checkpoint -> exit 0 -> requeue -> resume from the last checkpoint). Use it to check a new
cluster before a real run (`slurm/submit.sh --probe`); the tests run it on a real single-host cluster.

    python3 slurm/probe.py trainer --steps 20 --step-seconds 0.5   # one process per rank (srun)
    python3 slurm/probe.py engine --port 30000                     # an SGLang-protocol /generate stub
                                       # (weight_version "default" until POST /update_weight_version sets one)
    python3 slurm/probe.py q0                                      # the Q0 stage's driver

Everything goes to $SPO_RUN_DIR/probe/: env-<role>-...json, metrics.jsonl, checkpoints under
$SPO_CHECKPOINT_DIR (step-N directories plus a `latest` file, written atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ENV_PREFIXES = ("SLURM_", "SLURMD_", "SPO_", "MASTER_", "CUDA_VISIBLE_DEVICES", "NCCL_", "GLOO_")  # + submit.sh --env-file
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "ENGINE_PORT", "ENGINE_TP")


def probe_dir() -> Path:
    d = Path(os.environ["SPO_RUN_DIR"]) / "probe"
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def record_env(name: str, **extra) -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}
    write_json_atomic(probe_dir() / f"env-{name}.json", {"env": env, "hostname": socket.gethostname(), **extra})


def http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else {}


def wait_healthy(url: str, timeout_s: float) -> None:
    """GET /health until it answers 2xx (the router answers plain text, engines JSON)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=2.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s") from None
            time.sleep(0.3)


def generate_through(router_url: str, timeout_s: float) -> dict:
    """One SGLang /generate through the router (retried while it registers its workers).

    The probe engine names itself in meta_info.id, so the caller learns which engine served it."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.5}, "return_logprob": True}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return http_json(router_url.rstrip("/") + "/generate", body)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# engine: the smallest server the real sglang-router accepts as a worker
# ---------------------------------------------------------------------------------------------
def engine_main(args: argparse.Namespace) -> int:
    name = f"{os.environ.get('SLURMD_NODENAME', socket.gethostname())}:{args.port}"
    info = {"model_path": "probe", "served_model_name": "probe", "tp_size": 1, "dp_size": 1,
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "is_generation": True,
            "weight_version": "default"}  # SGLang's until a weight update names one

    class Handler(BaseHTTPRequestHandler):
        def _send(self, obj: dict, status: int = 200) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path in ("/health", "/health_generate"):
                self._send({})
            elif self.path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info"):
                self._send(info)
            else:
                self._send({"error": f"unknown path {self.path}"}, 404)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path == "/update_weight_version":
                info["weight_version"] = str(body["new_version"])
            if self.path != "/generate":
                self._send({"success": True})
                return
            n = int(body.get("sampling_params", {}).get("max_new_tokens", 1))
            self._send({
                "text": "", "output_ids": [7] * n,
                "meta_info": {"id": f"probe-engine@{name}", "finish_reason": {"type": "length", "length": n},
                              "prompt_tokens": len(body.get("input_ids") or []), "completion_tokens": n,
                              "output_token_logprobs": [[-0.5, 7, None]] * n,
                              "weight_version": info["weight_version"]},
            })

        def log_message(self, *a) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    record_env(f"engine-{name.replace(':', '-')}", engine=name)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"probe engine {name} serving", flush=True)
    server.serve_forever()
    return 0


# ---------------------------------------------------------------------------------------------
# trainer: one process per rank; rendezvous, step loop, checkpoint on SIGUSR1/SIGTERM, resume
# ---------------------------------------------------------------------------------------------
def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path | None]:
    marker = ckpt_dir / "latest"
    if not marker.is_file():
        return 0, None
    path = ckpt_dir / marker.read_text().strip()
    state = json.loads((path / "state.json").read_text())
    return int(state["step"]), path


def save_checkpoint(ckpt_dir: Path, step: int, world_size: int) -> Path:
    """step-N/state.json, then the `latest` marker replaced atomically: a crash never leaves a half checkpoint."""
    path = ckpt_dir / f"step-{step}"
    path.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path / "state.json", {"step": step, "world_size": world_size, "time": time.time()})
    tmp = ckpt_dir / f"latest.tmp{os.getpid()}"
    tmp.write_text(path.name)
    os.replace(tmp, ckpt_dir / "latest")
    return path


def trainer_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    stop_signal: list[int] = []
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop_signal.append(signum))

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("SPO_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    rank_sum = torch.tensor([float(rank)])
    dist.all_reduce(rank_sum)  # proves MASTER_ADDR/PORT, RANK and WORLD_SIZE agree across nodes

    ckpt_dir = Path(os.environ["SPO_CHECKPOINT_DIR"])
    start_step, resumed_from = latest_checkpoint(ckpt_dir)
    q0_file = os.environ.get("SPO_Q0_DIR") and Path(os.environ["SPO_Q0_DIR"]) / "q0.jsonl"
    extra = {"rank_sum": rank_sum.item(), "start_step": start_step, "resumed_from": str(resumed_from or ""),
             "q0_present": bool(q0_file and q0_file.is_file())}
    if rank == 0:
        router = os.environ["SPO_ROUTER_URL"]
        engines = [u for u in os.environ["SPO_ENGINE_URLS"].split(",") if u]
        wait_healthy(router, args.wait_s)
        for url in engines:
            wait_healthy(url, args.wait_s)
        extra["generate_via_router"] = generate_through(router, args.wait_s)["meta_info"]["id"]
    record_env(f"trainer-rank{rank}-restart{restart}", **extra)

    metrics = probe_dir() / "metrics.jsonl"
    step = start_step
    while step < args.steps:
        time.sleep(args.step_seconds)
        step += 1
        if rank == 0:
            with metrics.open("a") as f:
                f.write(json.dumps({"step": step, "restart": restart, "time": time.time()}) + "\n")
        # Every rank stops at the same step: the signal reaches ranks at slightly different times.
        stop = torch.tensor([float(bool(stop_signal))])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() or step % args.save_every == 0 or step == args.steps:
            if rank == 0:
                save_checkpoint(ckpt_dir, step, world)
            dist.barrier()
        if stop.item():
            if rank == 0:
                print(f"probe trainer: signal {stop_signal or '(on another rank)'}: saved step {step}, exiting",
                      flush=True)
            break
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# q0: the driver of the Q0 stage (a job the training job depends on with afterok)
# ---------------------------------------------------------------------------------------------
def q0_main(args: argparse.Namespace) -> int:
    router = os.environ["SPO_ROUTER_URL"]
    wait_healthy(router, args.wait_s)
    served_by = generate_through(router, args.wait_s)["meta_info"]["id"]
    out = Path(os.environ["SPO_Q0_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "q0.jsonl.tmp"
    tmp.write_text(json.dumps({"prompt_id": 0, "s0": 0.5, "q0": 0.0, "served_by": served_by}) + "\n")
    os.replace(tmp, out / "q0.jsonl")
    record_env("q0")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slurm/probe.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role", required=True)
    t = sub.add_parser("trainer")
    t.add_argument("--steps", type=int, default=20, help="total steps of the run (across restarts)")
    t.add_argument("--step-seconds", type=float, default=0.5)
    t.add_argument("--save-every", type=int, default=5)
    t.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for the router and engines")
    e = sub.add_parser("engine")
    e.add_argument("--host", default="0.0.0.0")
    e.add_argument("--port", type=int, default=int(os.environ.get("ENGINE_PORT", "30000")))
    q = sub.add_parser("q0")
    q.add_argument("--wait-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    return {"trainer": trainer_main, "engine": engine_main, "q0": q0_main}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())
