"""Memory and time of one decoder layer's forward + backward against the sequence length, per attention kernel.

    python tools/bench_attention.py                       # sdpa and dot_product at 1024 and 4096 tokens
    python tools/bench_attention.py --tokens 2048 8192 --kernels sdpa --json

One megatron-core TransformerLayer of the local spec (RMSNorm, GQA self-attention, SwiGLU MLP), built with this
project's layer_spec, runs forward + backward on one sequence in this process (world of one, gloo, CPU or GPU).
Peak memory: on a GPU torch's peak allocated bytes; on a CPU the process's peak resident set (VmHWM, reset
through /proc/self/clear_refs before each case) above the resident set just before it, with glibc told to return
every large block to the kernel at once (MALLOC_MMAP_THRESHOLD_, set by re-executing), so the figure is what the
case itself needed. Ratios are against the first length of each kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

MMAP_THRESHOLD = "65536"


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def build_layer(kernel: str, hidden: int, heads: int, groups: int, ffn: int):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_spo.models.builders import transformer_config
    from megatron_spo.models.config import ModelConfig, ParallelConfig
    from megatron_spo.models.spec import layer_spec

    model_cfg = ModelConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                            num_query_groups=groups, vocab_size=128)
    parallel_cfg = ParallelConfig(attention_kernel=kernel)
    spec, _ = layer_spec(model_cfg, "local", kernel)
    layer = TransformerLayer(transformer_config(model_cfg, parallel_cfg), spec.submodules, layer_number=1)
    return layer.cuda() if _cuda() else layer


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def measure(layer, tokens: int, hidden: int) -> dict:
    """Peak bytes and seconds of forward + backward on [tokens, 1, hidden] (after one warm-up at 64 tokens)."""
    import torch

    device = "cuda" if _cuda() else "cpu"

    def step(n: int) -> None:
        x = torch.randn(n, 1, hidden, device=device, requires_grad=True)
        out, _ = layer(x, attention_mask=None)
        out.float().square().mean().backward()

    step(64)
    layer.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    step(tokens)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _rss_kib("VmHWM") * 1024
    seconds = time.perf_counter() - t0
    layer.zero_grad(set_to_none=True)
    return {"tokens": tokens, "peak_bytes": peak - base, "seconds": seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--kernels", nargs="+", default=["sdpa", "dot_product"], choices=["sdpa", "dot_product"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:  # glibc reads it at start: re-execute
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
        os.execv(sys.executable, [sys.executable, *sys.argv])
    warnings.filterwarnings("ignore")
    import torch

    from megatron_spo.models.config import ModelConfig, ParallelConfig
    from megatron_spo.models.parallel import init_parallel

    torch.manual_seed(0)
    init_parallel(ParallelConfig(), ModelConfig(num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                                                num_attention_heads=args.heads, num_query_groups=args.groups,
                                                vocab_size=128))
    results: dict[str, list[dict]] = {}
    for kernel in args.kernels:
        layer = build_layer(kernel, args.hidden, args.heads, args.groups, args.ffn)
        results[kernel] = [measure(layer, n, args.hidden) for n in args.tokens]
        first = results[kernel][0]["peak_bytes"]
        for r in results[kernel]:
            r["memory_ratio"] = r["peak_bytes"] / first
        del layer
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.json:
        print(json.dumps({"device": device, "results": results}))
        return 0
    print(f"one decoder layer (hidden {args.hidden}, {args.heads} heads, {args.groups} groups), forward + backward, "
          f"on {device}")
    print(f"{'kernel':<12}{'tokens':>8}{'peak MiB':>12}{'x first':>10}{'seconds':>10}")
    for kernel, rows in results.items():
        for r in rows:
            print(f"{kernel:<12}{r['tokens']:>8}{r['peak_bytes'] / 2**20:>12.1f}{r['memory_ratio']:>10.2f}"
                  f"{r['seconds']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
