"""Peak memory and time: fused token_logprobs vs the naive logits -> log_softmax -> gather (and liger).

    python tools/bench_logprobs.py                      # N=4096, H=1024, V=128256, fp32, on CPU
    python tools/bench_logprobs.py --n 512 --v 32768    # smaller, quicker
    python tools/bench_logprobs.py --device cuda --dtype bfloat16 --n 16384 --h 4096   # on a GPU

Every variant runs in a FRESH subprocess, so no variant sees another's allocator state:
- CPU peak memory: once the inputs exist, the kernel's resident-set high-water mark is reset to the
  current RSS (write "5" to /proc/self/clear_refs, Linux >= 4.0); after one forward+backward, peak extra =
  VmHWM - that RSS (/proc/self/status). torch's CPU allocator keeps no statistics and tracemalloc does not
  see torch's buffers; the high-water mark counts every page actually touched, including the gradients
  themselves (grad_weight [V, H] fp32 is 0.49 GiB of every variant's peak at V=128256, H=1024).
- CUDA peak memory: torch.cuda.max_memory_allocated minus the allocation before the step.
- Time: the median of --repeats forward+backward steps after the measured first one (warm-up).
Ratios (naive / fused for memory, fused / naive for time) come from one run of this script, on a machine
that may be shared: say how loaded it was (the load average is printed) when quoting them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("naive", "fused", "naive_forward", "fused_forward", "liger")


def build_inputs(args):
    import torch

    gen = torch.Generator(device=args.device).manual_seed(0)
    kw = {"dtype": getattr(torch, args.dtype), "device": args.device}
    hidden = torch.empty(args.n, args.h, **kw).normal_(0.0, 1.0, generator=gen)  # in place: no temporaries
    weight = torch.empty(args.v, args.h, **kw).normal_(0.0, 0.02, generator=gen)  # logits of std ~0.64
    targets = torch.randint(0, args.v, (args.n,), generator=gen, device=args.device)
    coef = torch.randn(args.n, generator=gen, device=args.device)  # a generic upstream gradient
    return hidden, weight, targets, coef


def _proc_status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset the RSS high-water mark to the current RSS; return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc_status_bytes("VmRSS")


def make_step(variant: str, hidden, weight, targets, coef, args):
    """A closure running one forward (+ backward) of the variant."""
    import torch

    from megatron_spo.ops import token_logprobs, token_logprobs_reference

    if variant == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_step():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            loss_fn(w, h, targets).backward()  # = -sum logp: liger only takes a scalar upstream gradient

        return liger_step
    fn = token_logprobs_reference if variant.startswith("naive") else token_logprobs
    kw = {"fp8": True} if args.fp8 and variant.startswith("fused") else {}

    def step():
        if variant.endswith("forward"):
            with torch.no_grad():
                fn(hidden, weight, targets, **kw)
            return
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logp = fn(h, w, targets, **kw)
        torch.autograd.grad((logp * coef).sum(), (h, w))

    return step


def worker(args) -> dict:
    """Run one variant in this (fresh) process; return peak extra bytes and step times."""
    import torch

    torch.set_num_threads(args.threads or torch.get_num_threads())
    cuda = args.device == "cuda"
    # One tiny step first, so one-time initialisation (BLAS buffers, OpenMP thread stacks, the autograd
    # engine's threads: ~10-20 MiB) is not counted as the variant's peak.
    tiny = argparse.Namespace(**{**vars(args), "n": 16, "v": 256})
    make_step(args.variant, *build_inputs(tiny), tiny)()
    inputs = build_inputs(args)
    step = make_step(args.variant, *inputs, args)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = reset_peak_rss()
    start = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _proc_status_bytes("VmHWM") - before
    first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"variant": args.variant, "peak_extra_bytes": peak, "first_s": first, "times_s": times}


def liger_skip_reason(device: str) -> str | None:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as err:  # liger imports triton and may fail in several ways
        return f"liger-kernel does not import ({type(err).__name__}: {err})"
    if device != "cuda":
        return (
            "liger-kernel's fused linear cross-entropy is Triton-only: on CPU it runs only under "
            "TRITON_INTERPRET=1 (numpy, orders of magnitude too slow at this size), so it is skipped"
        )
    return None


def gib(x: float) -> str:
    return f"{x / 2**30:7.3f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_logprobs", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="tokens")
    parser.add_argument("--h", type=int, default=1024, help="hidden size")
    parser.add_argument("--v", type=int, default=128_256, help="vocabulary (one TP rank's shard)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--fp8", action="store_true", help="fused variants run the logits GEMM in FP8 (GPU + TE only)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="timed steps after the first (median reported)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = parser.parse_args(argv)

    if args.variant:
        print(json.dumps(worker(args)))
        return 0

    print(
        f"shape N={args.n} H={args.h} V={args.v} {args.dtype} on {args.device}; load average {os.getloadavg()}"
    )
    results = {}
    for variant in args.variants.split(","):
        if variant == "liger" and (reason := liger_skip_reason(args.device)):
            print(f"  liger: skipped: {reason}")
            continue
        cmd = [sys.executable, __file__, "--variant", variant] + [a for a in (argv or sys.argv[1:])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"  {variant}: FAILED\n{proc.stderr[-2000:]}")
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results[variant] = result
        step_s = statistics.median(result["times_s"]) if result["times_s"] else result["first_s"]
        result["step_s"] = step_s
        print(
            f"  {variant:14s} peak extra {gib(result['peak_extra_bytes'])}   step {step_s:8.3f} s (first {result['first_s']:.3f} s)"
        )

    print(f"load average after: {os.getloadavg()}")
    for fused, naive in (
        ("fused", "naive"),
        ("fused_forward", "naive_forward"),
        ("liger", "naive"),
        ("fused", "liger"),
    ):
        if fused in results and naive in results:
            mem = results[naive]["peak_extra_bytes"] / max(results[fused]["peak_extra_bytes"], 1)
            speed = results[fused]["step_s"] / results[naive]["step_s"]
            print(
                f"  {naive} / {fused} peak memory: {mem:6.2f}x lower     {fused} / {naive} time: {speed:5.2f}x"
            )
    if args.device == "cuda" and "fused" in results:
        flops = 4 * 2 * args.n * args.h * args.v  # forward GEMM, its recompute, grad_hidden, grad_weight
        print(f"  fused: {flops / results['fused']['step_s'] / 1e12:.1f} TFLOP/s (4 GEMMs of 2*N*H*V)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
