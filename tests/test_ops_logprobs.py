"""Fused token log-probs (megatron_spo.ops) against the plain reference: values, gradients, TP, Triton.

Truth is the reference evaluated in fp64 on the same inputs, so the fp32 tolerance (1e-5) measures the
fused op's own error, not the reference's.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_spo.ops import (
    FP8UnavailableError,
    default_block_shape,
    token_logprobs,
    token_logprobs_reference,
)
from megatron_spo.ops.torch_kernels import TorchKernels

# The module itself: in megatron_spo.ops the name token_logprobs is the function.
token_logprobs_module = importlib.import_module("megatron_spo.ops.token_logprobs")
torch_kernels = importlib.import_module("megatron_spo.ops.torch_kernels")

IGNORE = -100
# CUDA variants run where a GPU is (the device machine: see tools/bench_logprobs.py); CI has none.
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
GPU = "cuda"  # the device of the CUDA-only tests


def make_problem(n=23, h=16, v=50, seed=0, dtype=torch.float32, valid_vocab_size=None, n_ignored=3):
    """hidden [n, h], weight [v, h], targets [n] with a few ignored; logits of order 1-5."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.7).to(dtype)
    targets = torch.randint(0, valid_vocab_size or v, (n,), generator=gen)
    targets[torch.randperm(n, generator=gen)[:n_ignored]] = IGNORE
    return hidden, weight, targets


def values_and_grads(fn, hidden, weight, targets, seed=1, **kw):
    """(logp, entropy, grad_hidden, grad_weight) of a random linear functional of logp and entropy."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    logp, entropy = fn(hidden, weight, targets, return_entropy=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    coef_logp = torch.randn(len(targets), generator=gen, dtype=torch.float64).to(logp.device, logp.dtype)
    coef_ent = torch.randn(len(targets), generator=gen, dtype=torch.float64).to(logp.device, logp.dtype)
    loss = (logp * coef_logp).sum() + (entropy * coef_ent).sum()
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    return logp.detach(), entropy.detach(), grad_hidden, grad_weight


def truth(hidden, weight, targets, **kw):
    """The reference in fp64 on CPU, whatever device the inputs are on."""
    return values_and_grads(
        token_logprobs_reference, hidden.cpu().double(), weight.cpu().double(), targets.cpu(), **kw
    )


def on(device, *tensors):
    return tuple(t.to(device) for t in tensors)


def assert_all_close(got, want, rtol, atol, names=("logp", "entropy", "grad_hidden", "grad_weight")):
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(
            a.cpu().double(), b.cpu().double(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


# ---------------------------------------------------------------------------------------------
# Single rank
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "chunk_size, vocab_tile",
    [(None, None), (7, 11), (23, 50), (1, 64), (5, 1)],  # chunks/tiles that do not divide N=23 / V=50
)
def test_fp32_values_and_grads_match_reference_within_1e5(chunk_size, vocab_tile, device):
    hidden, weight, targets = make_problem()
    got = values_and_grads(
        token_logprobs, *on(device, hidden, weight, targets), chunk_size=chunk_size, vocab_tile=vocab_tile
    )
    assert_all_close(got, truth(hidden, weight, targets), rtol=0, atol=1e-5)
    assert got[0].dtype == got[1].dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_logprob_only_gradients_match_reference(device):
    """The backward without entropy is a separate code path (no entropy gradient term)."""
    hidden, weight, targets = make_problem()
    coef = torch.randn(len(targets), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = []
    for fn, dt, dev in (
        (token_logprobs, torch.float32, device),
        (token_logprobs_reference, torch.float64, "cpu"),
    ):
        h, w, t, c = on(dev, hidden.to(dt), weight.to(dt), targets, coef.to(dt))
        h.requires_grad_(), w.requires_grad_()
        kw = {"chunk_size": 7, "vocab_tile": 11} if fn is token_logprobs else {}
        grads.append(torch.autograd.grad((fn(h, w, t, **kw) * c).sum(), (h, w)))
    for name, a, b in zip(("grad_hidden", "grad_weight"), *grads):
        torch.testing.assert_close(a.cpu().double(), b, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("used", ["logp", "entropy"])
def test_entropy_returned_but_one_output_unused_matches_reference(used):
    """An unused output's gradient arrives as None: only the logp gradient (the factored backward that
    holds only p per block) or only the entropy gradient must still be exact."""
    hidden, weight, targets = make_problem()
    coef = torch.randn(len(targets), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = []
    for fn, dt in ((token_logprobs, torch.float32), (token_logprobs_reference, torch.float64)):
        h, w = hidden.to(dt).requires_grad_(), weight.to(dt).requires_grad_()
        kw = {"chunk_size": 7, "vocab_tile": 11} if fn is token_logprobs else {}
        logp, entropy = fn(h, w, targets, return_entropy=True, **kw)
        out = logp if used == "logp" else entropy
        grads.append(torch.autograd.grad((out * coef.to(dt)).sum(), (h, w)))
    for name, a, b in zip(("grad_hidden", "grad_weight"), *grads):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5, msg=name)


def test_entropy_terms_in_slabs_of_rows_match_reference(monkeypatch):
    """The entropy statistics and gradient walk each block a few rows at a time through a small scratch."""
    monkeypatch.setattr(torch_kernels, "_SLAB_BYTES", 3 * 4 * 11)  # 3 rows of an 11-wide tile
    hidden, weight, targets = make_problem()
    got = values_and_grads(token_logprobs, hidden, weight, targets, chunk_size=7, vocab_tile=11)
    assert_all_close(got, truth(hidden, weight, targets), rtol=0, atol=1e-5)


def test_bf16_logprob_only_gradients_accumulate_in_fp32():
    """The factored backward with bf16 inputs: same tolerance as the entropy path (one bf16 rounding)."""
    hidden, weight, targets = make_problem(n=40, h=64, v=300, dtype=torch.bfloat16)
    coef = torch.randn(len(targets), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for fn, dt in ((token_logprobs, torch.bfloat16), (token_logprobs_reference, torch.float64)):
        h, w = hidden.to(dt).requires_grad_(), weight.to(dt).requires_grad_()
        kw = {"chunk_size": 16, "vocab_tile": 128} if fn is token_logprobs else {}
        logp = fn(h, w, targets, **kw)
        grads.append(torch.autograd.grad((logp * coef.to(logp.dtype)).sum(), (h, w)))
    for name, a, b in zip(("grad_hidden", "grad_weight"), *grads):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b, rtol=2**-8, atol=1e-5 * b.abs().max().item(), msg=name)


def test_ignored_tokens_are_dropped_before_any_gemm(monkeypatch):
    """Only the rows that count are multiplied: the blocks see 20 of 23 tokens, results unchanged."""
    rows_seen = []
    original = token_logprobs_module._logits_block

    def recording(hidden_chunk, *args):
        rows_seen.append(hidden_chunk.shape[0])
        return original(hidden_chunk, *args)

    monkeypatch.setattr(token_logprobs_module, "_logits_block", recording)
    hidden, weight, targets = make_problem(n=23, n_ignored=3)
    got = values_and_grads(token_logprobs, hidden, weight, targets, vocab_tile=50)
    assert rows_seen == [20, 20]  # one block forward, one recomputed backward, ignored rows left out
    assert_all_close(got, truth(hidden, weight, targets), rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_ignored_targets_give_zero_logprob_entropy_and_gradient(device):
    hidden, weight, targets = on(device, *make_problem(n_ignored=0))
    targets[[2, 9]] = IGNORE
    logp, entropy, grad_hidden, _ = values_and_grads(token_logprobs, hidden, weight, targets, chunk_size=4)
    assert logp[[2, 9]].tolist() == [0.0, 0.0] and entropy[[2, 9]].tolist() == [0.0, 0.0]
    assert grad_hidden[[2, 9]].abs().max().item() == 0.0
    assert grad_hidden[0].abs().max().item() > 0  # a normal token does get a gradient
    # A custom ignore_index works the same way.
    targets[[2, 9]] = 7
    custom = token_logprobs(hidden, weight, torch.where(targets == 7, -1, targets), ignore_index=-1)
    torch.testing.assert_close(custom, logp.masked_fill(targets == 7, 0.0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_vocabulary_padding_never_enters_the_softmax(device):
    valid = 43
    hidden, weight, targets = make_problem(v=50, valid_vocab_size=valid)
    weight[valid:] = 1e4  # padding rows so large that any leak would dominate every softmax
    got = values_and_grads(
        token_logprobs,
        *on(device, hidden, weight, targets),
        valid_vocab_size=valid,
        chunk_size=6,
        vocab_tile=8,
    )
    want = truth(hidden, weight[:valid], targets)
    assert_all_close(got[:3], want[:3], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[3][:valid].cpu().double(), want[3], rtol=0, atol=1e-5)
    assert got[3][valid:].abs().max().item() == 0.0  # padding rows get no gradient


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_inputs_accumulate_in_fp32(device, monkeypatch):
    """Tolerance: the op's inputs are exact bf16 values and every sum is fp32, so logp/entropy are off from
    the fp64 truth only by fp32 rounding (< 1e-4 at |logit| <= ~10); gradients come back in bf16, so they
    may differ by one bf16 rounding, |err| <= 2^-9 |x| (we allow 2^-8), plus fp32 noise near zero.
    Where GEMMs cannot write fp32 from bf16 operands (CPU; CUDA under torch < 2.8, simulated here) the op
    upcasts the operands once and multiplies in fp32."""
    monkeypatch.setattr(token_logprobs_module, "_HAS_MM_OUT_DTYPE", False)
    hidden, weight, targets = make_problem(n=40, h=64, v=300, dtype=torch.bfloat16)
    got = values_and_grads(token_logprobs, *on(device, hidden, weight, targets), chunk_size=16, vocab_tile=128)
    got = tuple(x.cpu() for x in got)
    want = truth(hidden, weight, targets)
    assert got[2].dtype == got[3].dtype == torch.bfloat16 and got[0].dtype == torch.float32
    assert_all_close(got[:2], want[:2], rtol=0, atol=1e-4)
    for name, a, b in zip(("grad_hidden", "grad_weight"), got[2:], want[2:]):
        torch.testing.assert_close(a.double(), b, rtol=2**-8, atol=1e-5 * b.abs().max().item(), msg=name)
    # The naive bf16 pipeline (bf16 logits, bf16 log_softmax) is far less accurate: why stats stay fp32.
    naive = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    kept = targets != IGNORE
    naive_err = (naive.double() - want[0])[kept].abs().max().item()
    fused_err = (got[0].double() - want[0])[kept].abs().max().item()
    assert naive_err > 100 * fused_err, (naive_err, fused_err)


def test_blocks_never_exceed_chunk_times_tile(monkeypatch):
    """Peak extra memory is one block: record every block the per-block kernels see."""
    seen = []
    kernels = TorchKernels
    for name in ("update_stats", "probs", "logits_grad"):
        original = getattr(kernels, name)

        def recording(z, *args, _original=original, _name=name, **kw):
            seen.append((_name, tuple(z.shape)))
            return _original(z, *args, **kw)

        monkeypatch.setattr(kernels, name, staticmethod(recording))
    hidden, weight, targets = make_problem(n=23, v=50, n_ignored=0)
    hidden.requires_grad_()
    token_logprobs(hidden, weight, targets, chunk_size=10, vocab_tile=16).sum().backward()
    # ceil(23 / 10) * ceil(50 / 16) blocks forward, the same recomputed backward; the largest is 10 x 16.
    # The backward of log-probs alone only needs p per block; with entropy it forms dL/dz per block.
    logp, entropy = token_logprobs(hidden, weight, targets, chunk_size=10, vocab_tile=16, return_entropy=True)
    (logp + entropy).sum().backward()
    counts = {name: sum(n == name for n, _ in seen) for name in ("update_stats", "probs", "logits_grad")}
    assert counts == {"update_stats": 2 * 12, "probs": 12, "logits_grad": 12}
    for name in counts:
        blocks = [shape for n, shape in seen if n == name]
        assert max(r * c for r, c in blocks) == 10 * 16
        passes = counts[name] // 12  # each pass tiles tokens x vocabulary exactly once
        assert sum(r * c for r, c in blocks) == passes * 23 * 50


def test_default_block_fits_the_memory_budget():
    chunk, tile = default_block_shape(4096, 128_256)
    assert (chunk, tile) == (4096, 4096) and chunk * tile * 4 == 64 * 2**20
    assert default_block_shape(100, 1000) == (100, 1000)  # small problems: one block
    # on a GPU a block spans every token of a 16k micro-batch: one weight-gradient GEMM per vocabulary tile
    cuda = default_block_shape(
        16_384, 128_256, token_logprobs_module.DEFAULT_MAX_BLOCK_BYTES_CUDA, token_logprobs_module.DEFAULT_CHUNK_SIZE_CUDA
    )
    assert cuda == (16_384, 1024) and cuda[0] * cuda[1] * 4 == 64 * 2**20
    # any token count (prompt tokens are dropped first): the tile stays a multiple of 128 rows, so the blocks' row
    # stride suits Hopper's GEMM kernels (1092 rows at 15360 tokens ran ~3.5x slower on an H200)
    for n in (15_360, 12_345, 3_001, 777):
        chunk, tile = default_block_shape(n, 128_256, 64 * 2**20, 16_384)
        assert chunk == n and tile % 128 == 0 and 4 * chunk * tile <= 64 * 2**20 < 4 * chunk * (tile + 128), (n, tile)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slab", [7, 64, 2**22])  # many slabs (the first overlapping itself), one slab
def test_narrowing_in_place_equals_a_copy_and_reuses_the_storage(dtype, slab):
    from megatron_spo.ops.token_logprobs import narrow_in_place

    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(3)) * 100
    want = x.to(dtype)
    ptr = x.data_ptr()
    got = narrow_in_place(x, dtype, slab_elements=slab)
    assert got.dtype == dtype and got.shape == want.shape and got.data_ptr() == ptr
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_unfactored_backward_gpus_take_matches_the_factored_one(dtype, monkeypatch):
    """A GPU forms dL/dz = g (onehot - p) in each block (one kernel pass) where the CPU factors g out: the same
    gradients, checked here on the CPU by forcing the GPU's choice (bf16: within one bf16 rounding)."""
    hidden, weight, targets = make_problem(n=40, h=64, v=300, dtype=dtype)
    coef = torch.randn(len(targets), generator=torch.Generator().manual_seed(5))
    results = []
    for factored in (True, False):
        monkeypatch.setattr(token_logprobs_module, "_factored_backward", lambda *a, _f=factored: _f)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = token_logprobs(h, w, targets, chunk_size=16, vocab_tile=128)
        results.append(torch.autograd.grad((logp * coef).sum(), (h, w)))
    for name, a, b in zip(("grad_hidden", "grad_weight"), *results):
        tol = 2**-8 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item(), msg=name)


def test_no_grad_path_matches_and_weight_only_gradient():
    hidden, weight, targets = make_problem()
    with torch.no_grad():
        logp = token_logprobs(hidden, weight, targets, chunk_size=5)
    want = truth(hidden, weight, targets)
    torch.testing.assert_close(logp.double(), want[0], rtol=0, atol=1e-5)
    w = weight.clone().requires_grad_()
    logp_w, ent_w = token_logprobs(hidden, w, targets, return_entropy=True)
    gen = torch.Generator().manual_seed(1)
    coef = torch.randn(len(targets), generator=gen, dtype=torch.float64).float()
    coef_e = torch.randn(len(targets), generator=gen, dtype=torch.float64).float()
    ((logp_w * coef).sum() + (ent_w * coef_e).sum()).backward()
    torch.testing.assert_close(w.grad.double(), want[3], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"targets": torch.tensor([0, 50, 1])}, r"targets\[1\]=50 is outside the vocabulary \[0, 50\)"),
        ({"targets": torch.tensor([0, -3, 1])}, r"targets\[1\]=-3 is outside the vocabulary"),
        ({"hidden": torch.randn(3, 5)}, r"weight must be \[V_local, H\] with H=5"),
        ({"targets": torch.tensor([0, 1])}, r"targets must be \[N\] with N=3"),
        ({"targets": torch.tensor([0.0, 1.0, 2.0])}, "targets must be integer token ids"),
        ({"weight": torch.randn(50, 16, dtype=torch.float64)}, "must share one of float32/bfloat16/float16"),
        ({"chunk_size": 0}, "chunk_size must be >= 1, got 0"),
        ({"valid_vocab_size": 51}, r"valid_vocab_size=51 must be in \[1, 50\]"),
        ({"backend": "cuda"}, "backend must be one of"),
    ],
)
def test_bad_input_gives_one_line_error_naming_it(kwargs, message):
    args = {"hidden": torch.randn(3, 16), "weight": torch.randn(50, 16), "targets": torch.tensor([0, 1, 2])}
    extra = {k: v for k, v in kwargs.items() if k not in args}
    args.update({k: v for k, v in kwargs.items() if k in args})
    with pytest.raises(ValueError, match=message) as info:
        token_logprobs(args["hidden"], args["weight"], args["targets"], **extra)
    assert "\n" not in str(info.value)


def test_fp8_on_cpu_raises_a_clear_error():
    hidden, weight, targets = make_problem()
    with pytest.raises(FP8UnavailableError, match="FP8 needs a GPU with FP8 tensor cores") as info:
        token_logprobs(hidden, weight, targets, fp8=True)
    assert "\n" not in str(info.value)


def test_fp8_gemm_quantises_per_tensor_and_pads_ragged_tiles():
    """The FP8 logits GEMM (torch._scaled_mm also has a CPU kernel): exact on the quantised operands."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 32, generator=gen), torch.randn(21, 32, generator=gen) * 0.05  # 21: not % 16
    sa, sb = token_logprobs_module._fp8_scale(a), token_logprobs_module._fp8_scale(b)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    assert sa.item() == pytest.approx(a.abs().max().item() / fp8_max, rel=1e-6)
    b_q = token_logprobs_module._quantise_fp8(b, sb, row_multiple=16)
    assert b_q.shape == (32, 32) and b_q[21:].float().abs().max().item() == 0.0  # zero rows appended
    out = torch.empty(8, 21)
    token_logprobs_module._fp8_matmul(token_logprobs_module._quantise_fp8(a, sa), b_q, sa, sb, out)
    dequant_a = (a / sa).to(torch.float8_e4m3fn).float() * sa
    dequant_b = (b / sb).to(torch.float8_e4m3fn).float() * sb
    torch.testing.assert_close(out, dequant_a @ dequant_b.t(), rtol=1e-5, atol=1e-5)


def test_fp8_quantisation_in_slabs_equals_one_pass(monkeypatch):
    """Large operands are quantised a slab of rows at a time (bounded fp32 scratch): same bits."""
    x = torch.randn(37, 32, generator=torch.Generator().manual_seed(2))
    scale = token_logprobs_module._fp8_scale(x)
    whole = token_logprobs_module._quantise_fp8(x, scale)
    monkeypatch.setattr(token_logprobs_module, "_QUANTISE_SLAB_BYTES", 5 * 4 * 32)  # 5 rows per slab
    before = x.clone()
    slabs = token_logprobs_module._quantise_fp8(x, scale)
    assert torch.equal(whole.view(torch.uint8), slabs.view(torch.uint8))
    assert torch.equal(x, before)  # the input is never scaled in place


def check_fp8_against_straight_through(device, chunk_size, vocab_tile):
    """One per-tensor scale for hidden and one for the weight, whatever the blocks: the op must equal,
    values and gradients, the straight-through reference whose logits are the product of the dequantised
    E4M3 operands (softmax statistics in fp32); the backward's recomputed blocks equal the forward's."""
    # No ignored targets: those rows are dropped before the GEMM, so they would not enter the FP8 scale.
    hidden, weight, targets = make_problem(n=20, h=32, v=40, n_ignored=0)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def dequantised(x):
        scale = x.abs().max() / fp8_max
        return (x / scale).to(torch.float8_e4m3fn).double() * scale.double()

    fp8_logits = dequantised(hidden) @ dequantised(weight).t()

    def straight_through(h, w, targets, return_entropy):
        exact = h @ w.t()
        logprobs = torch.log_softmax(exact + (fp8_logits - exact).detach(), -1)
        ignored = targets == IGNORE
        logp = logprobs.gather(1, targets.clamp(min=0)[:, None]).squeeze(1).masked_fill(ignored, 0.0)
        return logp, -(logprobs.exp() * logprobs).sum(-1).masked_fill(ignored, 0.0)

    got = values_and_grads(
        token_logprobs,
        *on(device, hidden, weight, targets),
        fp8=True,
        chunk_size=chunk_size,
        vocab_tile=vocab_tile,
    )
    want = values_and_grads(straight_through, hidden.double(), weight.double(), targets)
    if torch.device(device).type == "cpu":
        assert_all_close(got, want, rtol=0, atol=1e-5)
    else:
        # Hopper's FP8 tensor cores keep ~14 bits of the running sum inside an MMA (DeepSeek-V3 report, 3.3.2),
        # so cuBLAS's product is the dequantised one to ~2^-13 relative, not to fp32 rounding (H100,
        # 2026-11-26: logp off by 1.4e-3 = 8e-5 of its largest entry). Held to 2^-10 of each tensor's largest.
        for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, want):
            a, b = a.cpu().double(), b.cpu().double()
            rel = ((a - b).abs().max() / b.abs().max()).item()
            assert rel <= 2**-10, f"{name}: FP8 op vs dequantised product {rel:.2e} of its largest entry > 2^-10"
    assert (
        got[0].cpu().double() - truth(hidden, weight, targets)[0]
    ).abs().max().item() > 1e-3  # FP8 did change it


@pytest.mark.parametrize("chunk_size, vocab_tile", [(None, None), (7, 11)])  # one block; 3 x 4 ragged blocks
def test_fp8_path_end_to_end_on_cpu_when_the_gate_is_bypassed(monkeypatch, chunk_size, vocab_tile):
    monkeypatch.setattr(token_logprobs_module, "_require_fp8", lambda hidden: None)
    check_fp8_against_straight_through("cpu", chunk_size, vocab_tile)


def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, targets = make_problem()
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        token_logprobs(hidden, weight, targets, backend="triton")


# ---------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (TRITON_INTERPRET must be set before triton is imported)
# ---------------------------------------------------------------------------------------------
TRITON_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from megatron_spo.ops import token_logprobs
    from megatron_spo.ops.triton_logprobs import reference_block_check
    out = {"block": reference_block_check(rows=5, cols=37, block_v=16)}  # 3 vocab steps, ragged last
    gen = torch.Generator().manual_seed(0)
    n, h, v, valid = 11, 8, 40, 37
    hidden, weight = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    targets = torch.randint(0, valid, (n,), generator=gen)
    targets[3] = -100
    coef = torch.randn(2, n, generator=gen)
    for entropy in (True, False):  # the kernels have a separate branch without the entropy terms
        results = []
        for backend in ("torch", "triton"):
            hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out_ = token_logprobs(hd, wt, targets, chunk_size=4, vocab_tile=16, valid_vocab_size=valid,
                                  return_entropy=entropy, backend=backend)
            logp, ent = out_ if entropy else (out_, torch.zeros(n))
            grads = torch.autograd.grad((logp * coef[0]).sum() + (ent * coef[1]).sum(), (hd, wt))
            results.append((logp, ent) + grads)
        names = ("logp", "entropy", "grad_hidden", "grad_weight")
        out[f"op_entropy_{entropy}"] = {k: float((a - b).abs().max()) for k, a, b in zip(names, *results)}
    print(json.dumps(out))
    """
)


def run_under_interpreter(script: str) -> dict:
    """Run ``script`` in a fresh Python with TRITON_INTERPRET=1; return the JSON of its last output line."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_kernels_match_torch_under_the_interpreter():
    pytest.importorskip("triton")
    diffs = run_under_interpreter(TRITON_SCRIPT)
    for group, values in diffs.items():
        for name, diff in values.items():
            # a bf16 operand: the two backends' fp32 values differ in their last bits (exp vs exp2), so their
            # roundings may differ by one bf16 step of the block's largest |dz| (< 4: one step is 2^-6)
            limit = 2**-6 if name == "dz_bf16_no_entropy" else 1e-5
            assert diff <= limit, f"{group}.{name}: triton vs torch differ by {diff}"


LIGER_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    from megatron_spo.ops import token_logprobs
    gen = torch.Generator().manual_seed(1)
    n, h, v = 37, 16, 300
    hidden, weight = torch.randn(n, h, generator=gen), 0.3 * torch.randn(v, h, generator=gen)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[[2, 30]] = -100
    upstream = torch.rand(n, generator=gen)  # a per-token upstream gradient, as SPO's sequence losses give
    results, per_token = [], []
    for name in ("liger", "ours"):
        hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if name == "liger":  # liger's loss is -sum log p over the kept tokens (scalar upstream only)
            loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")(wt, hd, targets)
        else:
            loss = -token_logprobs(hd, wt, targets, chunk_size=8, vocab_tile=64).sum()
        results.append((loss,) + torch.autograd.grad(loss, (hd, wt)))
        hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if name == "liger":  # reduction "none": -log p per token, gradients recomputed in its backward
            nll = LigerFusedLinearCrossEntropyLoss(reduction="none")(wt, hd, targets)
        else:
            nll = -token_logprobs(hd, wt, targets, chunk_size=8, vocab_tile=64)
        per_token.append((nll,) + torch.autograd.grad(nll, (hd, wt), upstream))
    names = ("loss", "grad_hidden", "grad_weight")
    out = {k: float((a - b).abs().max()) for k, a, b in zip(names, *results)}
    out.update({f"per_token_{k}": float((a - b).abs().max()) for k, a, b in zip(names, *per_token)})
    out["loss_value"] = float(results[0][0])
    print(json.dumps(out))
    """
)


def test_matches_liger_fused_linear_cross_entropy_under_the_interpreter():
    """liger-kernel's Triton FLCE (the field's reference fused op) and ours agree on -sum log p and grads, and with a
    per-token upstream gradient (liger's reduction "none", the like-for-like comparison of tools/bench_logprobs)."""
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (pip install -e .[test] installs it)")
    diffs = run_under_interpreter(LIGER_SCRIPT)
    assert diffs.pop("loss_value") > 100.0  # 35 kept tokens at ~log(300) each: not a vacuous 0 == 0
    for name, diff in diffs.items():
        assert diff < 2e-5, f"{name}: liger vs token_logprobs differ by {diff}"


# ---------------------------------------------------------------------------------------------
# On a CUDA GPU: cuBLAS bf16 GEMMs with fp32 output, Triton compiled for real, FP8 tensor cores, memory
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_tf32():
    """fp32 GEMMs at full precision: TF32 would cost ~1e-3."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.cpu().double() - want).norm() / want.norm()).item()


@CUDA
@pytest.mark.parametrize("entropy", [False, True])  # the factored backward, and the one forming dL/dz
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_backends_match_reference(backend, entropy, no_tf32):
    if backend == "triton":
        pytest.importorskip("triton")
    valid = 43  # vocabulary padding, ragged blocks, ignored targets
    hidden, weight, targets = make_problem(v=50, valid_vocab_size=valid)
    kw = {"backend": backend, "valid_vocab_size": valid, "chunk_size": 6, "vocab_tile": 8}
    if entropy:
        got = values_and_grads(token_logprobs, *on(GPU, hidden, weight, targets), **kw)
        want = truth(hidden, weight[:valid], targets)
    else:
        coef = torch.randn(len(targets), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        h, w, t = on(GPU, hidden, weight, targets)
        h.requires_grad_(), w.requires_grad_()
        logp = token_logprobs(h, w, t, **kw)
        got = (logp.detach(), *torch.autograd.grad((logp * coef.float().to(logp.device)).sum(), (h, w)))
        hd, wd = hidden.double().requires_grad_(), weight[:valid].double().requires_grad_()
        ref = token_logprobs_reference(hd, wd, targets)
        want = (ref.detach(), *torch.autograd.grad((ref * coef).sum(), (hd, wd)))
        got, want = (got[0], None, got[1], got[2]), (want[0], None, want[1], want[2])
    for name, a, b in zip(("logp", "entropy", "grad_hidden"), got[:3], want[:3]):
        if b is not None:
            torch.testing.assert_close(
                a.cpu().double(), b, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
    torch.testing.assert_close(got[3][:valid].cpu().double(), want[3], rtol=0, atol=1e-5)
    assert got[3][valid:].abs().max().item() == 0.0


@CUDA
def test_cuda_bf16_gradients_within_bf16_rounding_and_better_than_naive():
    """On CUDA the gradient GEMMs take the logits gradient in bf16 with fp32 accumulation, as megatron's bf16
    GEMMs do: each operand carries one bf16 rounding (2^-9 relative) and the result another, so the relative
    (Frobenius) error stays under 2^-8 (emulated on CPU: ~2e-3), below the naive bf16 pipeline's (bf16
    logits and log_softmax: 4.5e-3 to 7e-3 emulated). log-probs: fp32 statistics, within 1e-4."""
    hidden, weight, targets = make_problem(n=40, h=64, v=300, dtype=torch.bfloat16)
    coef = torch.randn(len(targets), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = token_logprobs_reference(hd, wd, targets)
    want = torch.autograd.grad((ref * coef).sum(), (hd, wd))
    h, w, t, c = on(GPU, hidden, weight, targets, coef)
    results = {}
    for name in ("fused", "naive"):
        hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
        if name == "fused":
            logp = token_logprobs(hc, wc, t, chunk_size=16, vocab_tile=128)
            torch.testing.assert_close(logp.cpu().double(), ref.detach(), rtol=0, atol=1e-4)
        else:
            logp = torch.log_softmax(hc @ wc.t(), -1).gather(1, t.clamp(min=0)[:, None]).squeeze(1)
            logp = logp.masked_fill(t == IGNORE, 0.0)
        grads = torch.autograd.grad((logp.double() * c).sum(), (hc, wc))
        results[name] = [relative_error(g, wg) for g, wg in zip(grads, want)]
    for i, grad in enumerate(("grad_hidden", "grad_weight")):
        fused, naive = results["fused"][i], results["naive"][i]
        assert fused < 2**-8 and fused < naive, f"{grad}: fused {fused:.2e}, naive bf16 {naive:.2e}"


@CUDA
@pytest.mark.parametrize("chunk_size, vocab_tile", [(None, None), (7, 11)])
def test_cuda_fp8_matches_the_dequantised_reference(chunk_size, vocab_tile):
    from megatron_spo.ops import fp8_available

    if not fp8_available():
        pytest.skip("FP8 needs compute capability >= 8.9")
    check_fp8_against_straight_through(GPU, chunk_size, vocab_tile)


@CUDA
def test_cuda_peak_memory_is_one_block_plus_the_gradients():
    """N x V never exists: the extra memory of forward + backward is the gradients themselves, one fp32 block
    and its bf16 copy, and O(N) statistics, far below the [N, V] fp32 logits (512 MiB here)."""
    n, h, v, block = 4096, 256, 32768, 16 * 2**20
    gen = torch.Generator(device=GPU).manual_seed(0)
    hidden = torch.randn(n, h, device=GPU, generator=gen, dtype=torch.bfloat16).requires_grad_()
    weight = (0.02 * torch.randn(v, h, device=GPU, generator=gen)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,), device=GPU, generator=gen)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    token_logprobs(hidden, weight, targets, max_block_bytes=block).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    gradients = 2 * (n * h + v * h)  # bf16 grad_hidden + grad_weight
    # expected ~45 MiB: the gradients (18), grad_hidden's fp32 accumulator (4, narrowed to bf16 inside itself:
    # 2 more than the bf16 gradient), the fp32 block (16: all 4096 tokens x 1024 vocabulary rows), its bf16
    # operand (8), the fp32 weight-gradient tile (1); allowed: those + 2 MiB (statistics, per-token vectors)
    tile = block // (4 * n)
    allowed = gradients + 2 * n * h + block + block // 2 + 4 * tile * h + 2 * 2**20
    assert extra <= allowed, f"peak extra {extra / 2**20:.1f} MiB > {allowed / 2**20:.1f} MiB"
    assert extra < 4 * n * v / 4  # a quarter of the naive fp32 logits alone


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: 2 gloo ranks against TP=1, all checks in one spawn
# ---------------------------------------------------------------------------------------------
def _tp_worker(rank: int, world: int, store_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        v_local = 20
        # (valid vocabulary, what it exercises): padding on the last rank; a last rank with no valid rows
        for valid in (37, 17):
            hidden, weight, targets = make_problem(
                n=13, h=8, v=world * v_local, valid_vocab_size=valid, seed=valid
            )
            assert (
                (targets >= v_local) & (targets < valid)
            ).any() or valid <= v_local  # both ranks own targets
            shard = weight[rank * v_local : (rank + 1) * v_local]
            kw = {"valid_vocab_size": valid, "chunk_size": 5, "vocab_tile": 6}
            got = values_and_grads(token_logprobs, hidden, shard, targets, tp_group=dist.group.WORLD, **kw)
            tp1 = values_and_grads(token_logprobs, hidden, weight, targets, **kw)
            want = truth(hidden, weight[:valid], targets)
            tp1_shard = tp1[3][rank * v_local : (rank + 1) * v_local]
            assert_all_close(got[:3], tp1[:3], rtol=0, atol=1e-5)
            torch.testing.assert_close(
                got[3], tp1_shard, rtol=0, atol=1e-5, msg=lambda m: f"grad_weight shard: {m}"
            )
            assert_all_close(got[:3], want[:3], rtol=0, atol=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
def test_tensor_parallel_2_ranks_match_single_rank(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
