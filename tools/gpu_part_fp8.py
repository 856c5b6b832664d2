"""GPU check, item 5: Transformer Engine FP8, run when TE imports, else why not, said exactly.

TE cannot travel to the GPU machine (looked up on PyPI on 2026-11-26): transformer_engine_cu13 2.20.2 is one
263.7 MiB x86_64 wheel (cu12: 695.3 MiB), over the 64 MiB the device tool carries in all, and
transformer_engine_torch ships only as an sdist that compiles against the installed torch, TE's core and
cuDNN headers. Without TE the project refuses model.fp8 with a one-line ConfigError (checked here), and
its one FP8 path that needs no TE, the LM-head logits GEMM of token_logprobs(fp8=True) through
torch._scaled_mm, is measured here against the fp32 reference (its exact test is in ops-cuda-tests).
"""

from __future__ import annotations

import importlib

import torch
from gpu_result import PartResult, part_main

TE_CANNOT_TRAVEL = ("it cannot travel: transformer_engine_cu13 2.20.2 is a 263.7 MiB wheel (the device tool carries "
                    "64 MiB in all) and transformer_engine_torch is an sdist that must compile against this torch")
FP8_LOGP_LIMIT = 0.25  # E4M3 operands (3 mantissa bits, per-tensor scales): logits off by a few percent


def te_import_error() -> str | None:
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # ImportError, or RuntimeError / OSError of a half-installed TE
        return f"{type(err).__name__}: {err}"
    return None


def model_fp8_refusal(result: PartResult) -> None:
    from megatron_spo.config import ConfigError
    from megatron_spo.models.config import ModelConfig, ParallelConfig
    from megatron_spo.models.parallel import check_layout

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=1000, fp8=True)
    try:
        check_layout(ParallelConfig(), cfg, 1)
        message = ""
    except ConfigError as err:
        message = str(err)
    result.number("model.fp8 without TE", message)
    result.require("model.fp8 refused with a one-line ConfigError", bool(message) and "\n" not in message, message)


def te_linear(result: PartResult) -> None:
    """A TE Linear forward + backward under fp8_autocast against the same layer in bf16."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    torch.manual_seed(0)
    layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = layer(x)
    ref.float().square().mean().backward()
    ref_grad, x.grad = x.grad.clone(), None
    with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
        out = layer(x)
    out.float().square().mean().backward()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    grad_rel = ((x.grad.float() - ref_grad.float()).norm() / ref_grad.float().norm()).item()
    result.check("TE Linear fp8 output rel error vs bf16", rel, at_most=0.1)
    result.check("TE Linear fp8 input-grad rel error vs bf16", grad_rel, at_most=0.1)


def lm_head_fp8(result: PartResult) -> None:
    from megatron_spo.ops import fp8_available, token_logprobs, token_logprobs_reference

    if not fp8_available():
        result.note("token_logprobs(fp8=True) not run: no GPU of compute capability >= 8.9")
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 4096, 1024, 32768
    hidden = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    weight = (0.02 * torch.randn(v, h, device="cuda", generator=gen)).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    truth = token_logprobs_reference(hidden.float(), weight.float(), targets)
    for tag, fp8 in (("bf16", False), ("fp8", True)):
        err = (token_logprobs(hidden, weight, targets, fp8=fp8) - truth).abs().max().item()
        result.number(f"LM-head {tag} logp max abs error [{n}x{h}x{v}]", err)
    result.check("LM-head fp8 (torch._scaled_mm) logp max abs error", err, at_most=FP8_LOGP_LIMIT)


def body(result: PartResult, args) -> None:
    error = te_import_error()
    result.number("transformer_engine.pytorch", error or "imports")
    if args.device == "cuda":
        lm_head_fp8(result)
    if error is None and args.device == "cuda":
        te_linear(result)
        result.note("TE imports: only a TE Linear ran in FP8; a model with model.fp8 was not built here")
        return
    model_fp8_refusal(result)
    if args.device != "cuda":
        result.skip(f"no GPU (--device cpu); Transformer Engine: {error or 'imports'}")
    else:
        result.skip(f"Transformer Engine does not import ({error}); {TE_CANNOT_TRAVEL}")


if __name__ == "__main__":
    raise SystemExit(part_main(body))
