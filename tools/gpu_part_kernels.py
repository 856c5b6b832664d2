"""GPU check, item 1: the fused token log-probs (Triton per-block kernels compiled for real, and the torch
ones) and cumulative Q on the device, against the fp64 reference on CPU, in fp32 and bf16.

Reuses the helpers of tests/test_ops_logprobs.py (make_problem, values_and_grads, truth). Cumulative Q
(algorithms/spo.py) is torch cumsum: the project has no Triton kernel for it, so its check is the device's
cumsum against fp64. Limits: fp32 (TF32 off) logp / entropy within 1e-4 absolute and gradients within 1e-4
relative (Frobenius); bf16 inputs: logp within 1e-3 (fp32 statistics), gradients within 2^-8 relative (one
bf16 rounding per GEMM operand), as tests/test_ops_logprobs.py argues; Triton and torch blocks agree to 1e-4 of
each tensor's largest entry in fp32 (1e-2 in bf16).
GPU_CHECK_EXERCISE_ALL=1 on the CPU runs the Triton blocks too, under TRITON_INTERPRET=1 (to debug it here).
"""

from __future__ import annotations

import os

import torch
from gpu_result import PartResult, part_main

NAMES = ("logp", "entropy", "grad_hidden", "grad_weight")


def _errors(got, want, valid: int) -> dict[str, float]:
    """logp / entropy: max abs error; gradients: relative Frobenius error (padding rows left out)."""
    out = {}
    for name, a, b in zip(NAMES, got, want):
        a = a.detach().cpu().double()
        if name == "grad_weight":
            a = a[:valid]
        out[name] = (a - b).abs().max().item() if name in ("logp", "entropy") else ((a - b).norm() / b.norm()).item()
    return out


def fused_op(result: PartResult, device: str, n: int, h: int, v: int) -> None:
    from test_ops_logprobs import make_problem, truth, values_and_grads

    from megatron_spo.ops import token_logprobs

    valid = v - 37  # vocabulary padding
    if device == "cuda":  # which accumulation the gradient GEMMs use (in place, or a temporary + add on old torch)
        from megatron_spo.ops.token_logprobs import _addmm_into_fp32_works

        result.number("bf16 products accumulate into fp32 in place", _addmm_into_fp32_works(torch.device("cuda", 0)))
    backends = ["triton", "torch"] if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else ["torch"]
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        hidden, weight, targets = make_problem(n=n, h=h, v=v, dtype=dtype, valid_vocab_size=valid, n_ignored=n // 10)
        want = truth(hidden, weight[:valid], targets)
        got = {}
        for backend in backends:
            kw = {"backend": backend, "valid_vocab_size": valid, "chunk_size": max(1, n // 3),
                  "vocab_tile": max(1, v // 5)}  # several ragged blocks
            on_device = (t.to(device) for t in (hidden, weight, targets))
            got[backend] = values_and_grads(token_logprobs, *on_device, **kw)
            err = _errors(got[backend], want, valid)
            abs_limit, rel_limit = (1e-4, 1e-4) if dtype == torch.float32 else (1e-3, 2**-8)
            for name, e in err.items():
                limit = abs_limit if name in ("logp", "entropy") else rel_limit
                result.check(f"{tag} {backend} {name} error", e, at_most=limit)
            pad = got[backend][3][valid:].abs().max().item()
            result.check(f"{tag} {backend} padding rows' grad", pad, at_most=0.0)
        if len(backends) == 2:
            # largest elementwise difference over each tensor's largest entry; fp32's limit is the limit against
            # fp64: the blocks sum grad_weight over the N rows in different orders (H100, 2026-11-26: 1.16e-5)
            for name, a, b in zip(NAMES, got["triton"], got["torch"]):
                diff = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                result.check(f"{tag} triton vs torch blocks {name} (max rel)", diff,
                             at_most=1e-4 if tag == "fp32" else 1e-2)
    if len(backends) == 1:
        result.note("Triton blocks not run: they need CUDA (or TRITON_INTERPRET=1, which the CPU tests cover)")


def cumulative_q_on_device(result: PartResult, device: str, b: int, t: int) -> None:
    from megatron_spo.algorithms import cumulative_q, reverse_q_targets

    gen = torch.Generator().manual_seed(3)
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    ref_logp = logp + 0.1 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    q0, reward = -torch.rand(b, generator=gen, dtype=torch.float64), torch.rand(b, generator=gen, dtype=torch.float64)
    beta = 0.05
    want_q = cumulative_q(logp, ref_logp, mask, q0, beta)
    want_r = reverse_q_targets(logp, ref_logp, mask, reward, beta)
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        args = [x.to(dtype).to(device) for x in (logp, ref_logp)]
        got_q = cumulative_q(*args, mask.to(device), q0.float().to(device), beta)
        got_r = reverse_q_targets(*args, mask.to(device), reward.float().to(device), beta)
        # bf16 inputs are rounded before the (fp32) sums: compare with the fp64 result of the rounded inputs
        rounded = [x.to(dtype).double() for x in (logp, ref_logp)]
        truth_q = want_q if dtype == torch.float32 else cumulative_q(*rounded, mask, q0.float().double(), beta)
        truth_r = want_r if dtype == torch.float32 else reverse_q_targets(*rounded, mask, reward.float().double(), beta)
        for name, got, want in (("cumulative_q", got_q, truth_q), ("reverse_q_targets", got_r, truth_r)):
            err = (got.cpu().double() - want).abs().max().item() / want.abs().max().item()
            result.check(f"{tag} {name} max rel error [{b}x{t}]", err, at_most=1e-5)


def body(result: PartResult, args) -> None:
    device = args.device
    if device == "cpu" and os.environ.get("GPU_CHECK_EXERCISE_ALL") == "1":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 limits are for full fp32 GEMMs
        torch.backends.cudnn.allow_tf32 = False
    full = args.size == "full"
    n, h, v = (2048, 256, 16384) if full else (64, 16, 300)  # truth: fp64 on the CPU
    result.number("fused op shape N x H x V", f"{n} x {h} x {v}")
    fused_op(result, device, n, h, v)
    cumulative_q_on_device(result, device, *((256, 2048) if full else (8, 64)))


if __name__ == "__main__":
    raise SystemExit(part_main(body))
