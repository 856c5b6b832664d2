"""Peak memory and time: fused token_logprobs vs the naive logits -> log_softmax -> gather (and liger).

    python tools/bench_logprobs.py                      # N=4096, H=1024, V=128256, fp32, on CPU
    python tools/bench_logprobs.py --n 512 --v 32768    # smaller, quicker
    python tools/bench_logprobs.py --device cuda --dtype bfloat16 --n 16384 --h 4096   # on a GPU
    python tools/bench_logprobs.py --device cuda --dtype bfloat16 --n 16384 --h 4096 --fp8

Three phases, each in FRESH subprocesses, so no variant sees another's allocator state:
- Memory: one subprocess per variant runs one forward (+ backward) step. CPU: once the inputs exist, the
  kernel's resident-set high-water mark is reset to the current RSS (write "5" to /proc/self/clear_refs,
  Linux >= 4.0); peak extra = VmHWM - that RSS (/proc/self/status). torch's CPU allocator keeps no
  statistics and tracemalloc does not see torch's buffers; the high-water mark counts every page actually
  touched, including the gradients themselves (grad_weight [V, H] fp32 is 0.49 GiB of every variant's
  peak at V=128256, H=1024). CUDA: torch.cuda.max_memory_allocated minus the allocation before the step.
- Time: ONE subprocess builds the inputs once, warms every timed variant up once, then runs --repeats
  rounds of one forward+backward step per variant, alternating the order (ABBA...) so that a change of
  machine load hits both variants alike. Reported per variant: median and min; the ratio of medians, the
  ratio of mins, and the median over rounds of the paired ratio (the two steps of a round ran back to
  back, so the paired ratio is the least sensitive to load that comes and goes).
  The variant "gemm" is ONE plain product hidden @ weight^T into a preallocated [N, V] output: the fused
  op does 4 such GEMMs (forward, recompute, grad_hidden, grad_weight) and the naive one 3, so
  fused / (4 x gemm) is how close the op runs to its GEMM floor.
- Bandwidth: the per-block softmax kernels the op selects (Triton on a GPU, torch on CPU) on one default
  block (fp32, the op's default block size on the device), as effective GB/s = the bytes a block must move
  (statistics: read it once; probabilities: read and write it) / time, next to a device-to-device copy's
  GB/s (read + write) measured in the same process: the share of the memory bandwidth they reach.
On CPU the process CPU seconds per step are reported too: the work done, whatever share of the cores
the machine's other load left us. The torch thread count and the load average before and after are
printed: quote them with the ratios.

On the device machine (torch, triton and pytest preinstalled; nothing can be fetched there): carry a
liger-kernel wheel to compare with liger (`pip download --no-deps liger-kernel==<v>` for Python 3.12 into
.whl/, see the device tool's README), then in one call run the CUDA tests and the three benchmarks:
    python3 -m pytest -q tests/test_ops_logprobs.py tests/test_ops_spo.py -k "cuda or fp32 or padding"
    python3 tools/bench_logprobs.py --device cuda --dtype bfloat16 --n 16384 --h 4096 [--fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MEMORY_VARIANTS = ("naive", "fused", "naive_forward", "fused_forward", "liger", "liger_per_token")
TIMED_VARIANTS = ("fused", "naive", "liger", "liger_per_token", "gemm")
# (numerator, denominator) of the printed ratios: memory as den / num ("x lower"), time as num / den
COMPARISONS = (("fused", "naive"), ("fused_forward", "naive_forward"), ("liger", "naive"), ("fused", "liger"),
               ("fused", "liger_per_token"))
# LM-head GEMMs of N x H x V in one forward + backward. liger (a scalar upstream gradient, a mean or sum of token
# losses) computes both gradients in its forward; with a per-token upstream gradient (reduction "none", what SPO's
# sequence losses give) it recomputes the logits in the backward, as the fused op must: the like-for-like pair
GEMMS_PER_STEP = {"fused": 4, "naive": 3, "liger": 3, "liger_per_token": 4}


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
    """A closure running one forward (+ backward, as the trainer uses it) of the variant."""
    import torch

    from megatron_spo.ops import token_logprobs, token_logprobs_reference

    if variant == "gemm":  # the GEMM floor: one [N, H] x [H, V] product, output allocated once
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)

        def gemm_step():
            torch.mm(hidden, weight.t(), out=out)

        return gemm_step
    if variant in ("liger", "liger_per_token"):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        per_token = variant == "liger_per_token"
        loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="none" if per_token else "sum")
        upstream = torch.rand(hidden.shape[0], generator=torch.Generator(device=hidden.device).manual_seed(1),
                              device=hidden.device) if per_token else None

        def liger_step():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            loss = loss_fn(w, h, targets)  # -log p per token, or their sum
            loss.backward(upstream)

        return liger_step
    fn = token_logprobs_reference if variant.startswith("naive") else token_logprobs
    kw = {"fp8": True} if args.fp8 and variant.startswith("fused") else {}
    if variant.startswith("fused_b"):  # fused_b<MiB>: the fused op with another fp32 block budget
        kw["max_block_bytes"] = int(variant[len("fused_b"):]) * 2**20

    def step():
        if variant.endswith("forward"):
            with torch.no_grad():
                fn(hidden, weight, targets, **kw)
            return
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logp = fn(h, w, targets, **kw)
        torch.autograd.grad((logp * coef).sum(), (h, w))

    return step


def _setup_worker(args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    # One tiny step per variant first, so one-time initialisation (BLAS buffers, OpenMP thread stacks, the
    # autograd engine's threads: ~10-20 MiB) is counted neither as a variant's peak nor in its time.
    tiny = argparse.Namespace(**{**vars(args), "n": 16, "v": 256})
    for variant in args.worker_variants:
        make_step(variant, *build_inputs(tiny), tiny)()
    return torch


def memory_worker(args) -> dict:
    """Peak extra bytes and time of ONE step of one variant, in this (fresh) process."""
    torch = _setup_worker(args)
    (variant,) = args.worker_variants
    step = make_step(variant, *build_inputs(args), args)
    cuda = args.device == "cuda"
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
    return {"peak_extra_bytes": peak, "first_s": time.perf_counter() - start}


def time_worker(args) -> dict:
    """Step times of every variant, interleaved round by round in this (fresh) process."""
    torch = _setup_worker(args)
    inputs = build_inputs(args)
    steps = {variant: make_step(variant, *inputs, args) for variant in args.worker_variants}

    def timed(step) -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one step."""
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, time.process_time() - start_cpu

    warmup = {variant: timed(step)[0] for variant, step in steps.items()}
    times = {variant: [] for variant in steps}
    cpu_times = {variant: [] for variant in steps}
    order = list(steps)
    for round_index in range(args.repeats):
        for variant in order if round_index % 2 == 0 else order[::-1]:
            wall, cpu = timed(steps[variant])
            times[variant].append(wall)
            cpu_times[variant].append(cpu)
    return {"threads": torch.get_num_threads(), "warmup_s": warmup, "times_s": times, "cpu_s": cpu_times}


def bandwidth_worker(args) -> dict:
    """Effective GB/s of the per-block kernels on one default-sized fp32 block, and of a plain copy."""
    import importlib

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    op = importlib.import_module("megatron_spo.ops.token_logprobs")
    cuda = args.device == "cuda"
    max_block = op.DEFAULT_MAX_BLOCK_BYTES_CUDA if cuda else op.DEFAULT_MAX_BLOCK_BYTES
    chunk, tile = op.default_block_shape(args.n, args.v, max_block, op.DEFAULT_CHUNK_SIZE_CUDA if cuda else None)
    gen = torch.Generator(device=args.device).manual_seed(0)
    source = torch.randn(chunk, tile, device=args.device, generator=gen).mul_(3.0)  # logits of std 3
    z = source.clone()
    col = torch.randint(-1, tile, (chunk,), device=args.device, generator=gen)  # -1: another block owns it
    lse = torch.logsumexp(source, dim=1)
    m = torch.full((chunk,), float("-inf"), device=args.device)
    s, t, tgt = (torch.zeros(chunk, device=args.device) for _ in range(3))
    kernels = op._select_kernels("auto", z)
    block_bytes = 4 * chunk * tile

    def seconds(fn, repeats: int) -> float:
        """Median seconds of fn (state it leaves behind stays finite when repeated)."""
        fn()
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    repeats = 20 if cuda else 5
    results = {
        "copy": 2 * block_bytes / seconds(lambda: z.copy_(source), repeats),
        "stats": block_bytes / seconds(lambda: kernels.update_stats(z, col, m, s, None, tgt), repeats),
        "stats+entropy": block_bytes / seconds(lambda: kernels.update_stats(z, col, m, s, t, tgt), repeats),
        "probs": 2 * block_bytes / seconds(lambda: kernels.probs(z, lse), repeats),
    }
    return {"kernels": kernels.__name__, "block": [chunk, tile], "gb_per_s": results}


def precision_worker(args) -> dict:
    """Errors of each variant's log-probs and gradients against fp32 math (TF32 off) on the same inputs.

    At --precision-n tokens (the full N's [N, V] fp32 reference would not be cheap): log-probs' max abs error,
    and each gradient's relative Frobenius error, for a per-token upstream gradient (SPO's sequence losses).
    """
    import torch

    from megatron_spo.ops import token_logprobs, token_logprobs_reference

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    small = argparse.Namespace(**{**vars(args), "n": args.precision_n})
    hidden, weight, targets, coef = build_inputs(small)
    hd, wd = hidden.float().requires_grad_(), weight.float().requires_grad_()
    ref = token_logprobs_reference(hd, wd, targets)
    want = torch.autograd.grad((ref * coef).sum(), (hd, wd))
    out = {}
    for variant in args.worker_variants:
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        if variant.startswith("liger"):
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            logp = -LigerFusedLinearCrossEntropyLoss(reduction="none")(w, h, targets)
        else:
            logp = (token_logprobs_reference if variant == "naive" else token_logprobs)(h, w, targets)
        grads = torch.autograd.grad((logp.float() * coef).sum(), (h, w))
        out[variant] = {"logp_max_abs": float((logp.float() - ref.detach()).abs().max())}
        for name, g, gw in zip(("grad_hidden", "grad_weight"), grads, want):
            out[variant][f"{name}_rel"] = float((g.float() - gw).norm() / gw.norm())
    return out


def run_worker(mode: str, variants: list[str], argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--worker", mode, "--worker-variants", ",".join(variants)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} worker for {variants} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def liger_skip_reason(device: str) -> str | None:
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as err:  # liger imports triton and may fail in several ways
        return f"liger-kernel does not import ({type(err).__name__}: {err})"
    if device != "cuda":
        return (
            "liger-kernel's fused linear cross-entropy is Triton-only: on CPU it runs only under "
            "TRITON_INTERPRET=1 (numpy, orders of magnitude too slow at this size), so it is skipped; its loss "
            "and gradients match ours there (tests/test_ops_logprobs.py)"
        )
    return None


def timing_summary(times: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    """Ratios num / den of the step times: of medians, of mins, and the median of per-round ratios."""
    a, b = times[num], times[den]
    return {
        "median_ratio": statistics.median(a) / statistics.median(b),
        "min_ratio": min(a) / min(b),
        "paired_ratio": statistics.median(x / y for x, y in zip(a, b)),
    }


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
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up step")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--memory-variants", default=",".join(MEMORY_VARIANTS), help="'' skips the phase")
    parser.add_argument("--time-variants", default=",".join(TIMED_VARIANTS), help="'' skips the phase")
    parser.add_argument(
        "--bandwidth",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the per-block kernels' effective GB/s vs a copy (default on)",
    )
    parser.add_argument("--precision-variants", default="", help="e.g. fused,naive,liger_per_token ('': none)")
    parser.add_argument("--precision-n", type=int, default=2048, help="tokens of the precision phase")
    parser.add_argument("--worker", choices=["memory", "time", "bandwidth", "precision"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-variants", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)

    if args.worker:
        args.worker_variants = args.worker_variants.split(",")
        workers = {"memory": memory_worker, "time": time_worker, "bandwidth": bandwidth_worker,
                   "precision": precision_worker}
        print(json.dumps(workers[args.worker](args)))
        return 0

    where = args.device
    if args.device == "cuda":
        import torch

        where = f"cuda ({torch.cuda.get_device_name()}, torch {torch.__version__})"
    print(
        f"shape N={args.n} H={args.h} V={args.v} {args.dtype} on {where}; "
        f"load average {tuple(round(x, 2) for x in os.getloadavg())}"
    )
    liger_reason = liger_skip_reason(args.device)
    if liger_reason:
        print(f"  liger: skipped: {liger_reason}")

    def selected(option: str) -> list[str]:
        return [v for v in option.split(",") if v and not (v.startswith("liger") and liger_reason)]

    peaks = {}
    for variant in selected(args.memory_variants):
        try:
            result = run_worker("memory", [variant], argv)
        except RuntimeError as err:
            print(f"  {variant}: FAILED: {err}")
            continue
        peaks[variant] = result["peak_extra_bytes"]
        print(
            f"  memory  {variant:14s} peak extra {gib(peaks[variant])}   (one step: {result['first_s']:.3f} s)"
        )
    for num, den in COMPARISONS:
        if num in peaks and den in peaks:
            print(f"  memory  {den} / {num}: {peaks[den] / max(peaks[num], 1):6.2f}x lower")

    timed = selected(args.time_variants)
    if timed and args.repeats > 0:
        result = run_worker("time", timed, argv)
        times = result["times_s"]
        print(
            f"  time: {result['threads']} torch threads, {args.repeats} interleaved rounds after a warm-up; "
            f"load average after {tuple(round(x, 2) for x in os.getloadavg())}"
        )
        for variant, ts in times.items():
            print(
                f"  time    {variant:14s} median {statistics.median(ts):8.3f} s   min {min(ts):8.3f} s   "
                f"all {' '.join(f'{t:.2f}' for t in ts)}"
            )
        for num, den in COMPARISONS:
            if num in times and den in times:
                r = timing_summary(times, num, den)
                print(
                    f"  time    {num} / {den}: {r['median_ratio']:5.3f}x (medians)   {r['min_ratio']:5.3f}x (mins)"
                    f"   {r['paired_ratio']:5.3f}x (median of per-round ratios)"
                )
                if args.device == "cpu":  # CPU seconds: the work done, whatever share of the cores we got
                    c = timing_summary(result["cpu_s"], num, den)
                    print(
                        f"  cpu     {num} / {den}: {c['median_ratio']:5.3f}x (medians of process CPU seconds; "
                        f"{num} {statistics.median(result['cpu_s'][num]):.2f} s, "
                        f"{den} {statistics.median(result['cpu_s'][den]):.2f} s)"
                    )
        if "gemm" in times:
            gemm = statistics.median(times["gemm"])
            print(f"  gemm    one N x H x V GEMM: {2 * args.n * args.h * args.v / gemm / 1e12:.3f} TFLOP/s")
            for variant, count in GEMMS_PER_STEP.items():
                if variant in times:
                    print(
                        f"  floor   {variant} / ({count} x gemm): "
                        f"{statistics.median(times[variant]) / (count * gemm):5.3f}x   (1.000 = GEMMs only)"
                    )
    checked = selected(args.precision_variants)
    if checked:
        errors = run_worker("precision", checked, argv)
        print(f"  precision: N={args.precision_n}, against fp32 math (TF32 off) on the same inputs, per-token upstream")
        for variant, e in errors.items():
            print(f"  precision {variant:14s} logp max abs {e['logp_max_abs']:.3e}   grad_hidden rel "
                  f"{e['grad_hidden_rel']:.3e}   grad_weight rel {e['grad_weight_rel']:.3e}")
    if args.bandwidth:
        result = run_worker("bandwidth", [], argv)
        gbps = result["gb_per_s"]
        chunk, tile = result["block"]
        print(f"  bandwidth: {result['kernels']} on one fp32 block of {chunk} x {tile}:")
        for name, rate in gbps.items():
            share = "" if name == "copy" else f"   {rate / gbps['copy']:5.2f}x the copy's"
            print(f"  bandwidth {name:13s} {rate / 1e9:9.1f} GB/s{share}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
