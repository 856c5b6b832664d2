"""GPU check, item 2: megatron-core GPTModel (local layer spec; the project's builders) on the device in one
process (NCCL group of one on a GPU, gloo on CPU) against transformers' own class on the same weights.

For each registered family (models/arch/; --size tiny: the first only) one tiny random checkpoint of tests/models_helpers.FAMILY_CASES
is loaded into both models; the logits and the gradients of the mean next-token cross-entropy are compared:
  fp32 (TF32 off): logits within 1e-4 absolute, every gradient within 1e-4 of its tensor's largest entry;
  bf16: both models in bf16 against transformers in fp32 on the same device; megatron's error may be at most
  3x transformers' own bf16 error (logits, and the worst gradient tensor), so bf16 costs us no more than it
  costs transformers.
"""

from __future__ import annotations

import torch
from gpu_result import PartResult, part_main

BF16_ERROR_RATIO = 3.0


MOE_CASES = {"qwen3_moe": "qwen3-moe (tests/moe_helpers)", "qwen2_moe": "qwen2-moe (tests/qwen2_moe_helpers)"}


def family_cases() -> dict[str, str]:
    """Registered family -> the first FAMILY_CASES entry whose transformers config is of that family (the MoE
    families: the tiny models of tests/moe_helpers and tests/qwen2_moe_helpers, MOE_CASES)."""
    import transformers
    from models_helpers import FAMILY_CASES

    from megatron_spo.models import arch

    cases = {}
    for family in arch.names():
        for case, (cls_name, _) in FAMILY_CASES.items():
            if getattr(transformers, cls_name).model_type == family:
                cases[family] = case
                break
        else:
            cases[family] = MOE_CASES.get(family)
    return cases


def make_case(root: str, case: str):
    """(checkpoint folder, token ids [4, S] on the CPU) of a family_cases() entry, 2 layers."""
    from models_helpers import make_tiny_family, tokens

    if case == MOE_CASES["qwen3_moe"]:
        import moe_helpers

        return str(moe_helpers.make_tiny_moe(f"{root}/qwen3-moe")), moe_helpers.tokens()
    if case == MOE_CASES["qwen2_moe"]:
        import qwen2_moe_helpers

        return str(qwen2_moe_helpers.make_tiny_qwen2_moe(f"{root}/qwen2-moe")), qwen2_moe_helpers.tokens()
    return str(make_tiny_family(f"{root}/{case}", case, num_layers=2)), tokens()


def hf_run(hf_dir: str, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits [B, S, V] (fp32) and gradients of the mean next-token loss, on ids' device."""
    from models_helpers import next_token_loss
    from moe_helpers import per_expert
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {}
    if getattr(AutoConfig.from_pretrained(hf_dir), "num_experts", None):  # experts one by one, as tests/test_moe.py
        kwargs["experts_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, **kwargs).to(ids.device).eval()
    logits = model(ids).logits
    next_token_loss(logits.float(), ids).backward()
    grads = {}  # transformers 5 fuses each layer's experts: by checkpoint name (per_expert is a no-op elsewhere)
    for n, p in model.named_parameters():
        grads.update(per_expert(n, p.grad.detach().float()))
    return logits.detach().float(), grads


def megatron_run(hf_dir: str, ids: torch.Tensor, dtype: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same with the project's megatron model (build_policy + load_hf_into_model), TP = PP = 1."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config
    from megatron_spo.models.hf_map import iter_hf_tensors, load_hf_into_model
    from megatron_spo.models.pipeline import gather_logits_to_rank0, run_pipeline

    cfg = read_hf_config(hf_dir).model_copy(update={"params_dtype": dtype})
    reader = HFReader(hf_dir)
    chunks = build_policy(cfg, ParallelConfig())
    load_hf_into_model(chunks, cfg, reader.get)
    logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=2).float()
    mb_ids = [ids[0:2], ids[2:4]]

    def loss_fn(logits_local, index):
        return vocab_parallel_cross_entropy(logits_local[:, :-1].float().contiguous(), mb_ids[index][:, 1:]).mean()

    for c in chunks:
        c.train()
        c.zero_grad(set_to_none=True)
    run_pipeline(chunks, ids, micro_batch_size=2, loss_fn=loss_fn)
    grads = {name: g.float() for name, g in iter_hf_tensors(chunks, cfg, grads=True)}
    return logits, grads


def worst_grad_error(grads: dict, truth: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, ref in truth.items():
        err = (grads[name] - ref).abs().max().item() / (ref.abs().max().item() + 1e-12)
        if err > worst:
            worst, where = err, name
    return worst, where


def body(result: PartResult, args) -> None:
    import tempfile

    import torch.distributed as dist

    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.hf_checkpoint import read_hf_config
    from megatron_spo.models.parallel import destroy_parallel, init_parallel

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    root = tempfile.mkdtemp(dir=args.work)
    cases = family_cases()
    if args.size == "tiny":  # the CPU debug size: the first family only
        cases = dict(list(cases.items())[:1])
    dtypes = ("float32", "bfloat16")
    first = True
    for family, case in cases.items():
        if case is None:
            result.require(f"{family}: a tiny case in tests/models_helpers.FAMILY_CASES", False)
            continue
        hf_dir, ids = make_case(root, case)
        ids = ids.to(device)  # [4, S]
        if first:  # one process group for every model of the part
            init_parallel(ParallelConfig(), read_hf_config(hf_dir), seed=123)
            result.number("process group backend", dist.get_backend())
            result.number("device", torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
            first = False
        truth_logits, truth_grads = hf_run(hf_dir, ids, torch.float32)
        for dtype in dtypes:
            logits, grads = megatron_run(hf_dir, ids, dtype)
            logit_err = (logits - truth_logits).abs().max().item()
            grad_err, grad_where = worst_grad_error(grads, truth_grads)
            tag = f"{family} ({case}) {dtype}"
            result.number(f"{tag} worst gradient tensor", grad_where)
            if dtype == "float32":
                result.check(f"{tag} logits max abs diff", logit_err, at_most=1e-4)
                result.check(f"{tag} grad max rel diff", grad_err, at_most=1e-4)
                continue
            hf_logits, hf_grads = hf_run(hf_dir, ids, torch.bfloat16)
            hf_logit_err = (hf_logits - truth_logits).abs().max().item()
            hf_grad_err, _ = worst_grad_error(hf_grads, truth_grads)
            result.number(f"{tag} logits max abs diff vs fp32 (megatron / transformers)", [logit_err, hf_logit_err])
            result.number(f"{tag} grad max rel diff vs fp32 (megatron / transformers)", [grad_err, hf_grad_err])
            result.check(f"{tag} logits error / transformers' bf16 error", logit_err / hf_logit_err,
                         at_most=BF16_ERROR_RATIO)
            result.check(f"{tag} grad error / transformers' bf16 error", grad_err / hf_grad_err,
                         at_most=BF16_ERROR_RATIO)
    if not first:
        destroy_parallel()


if __name__ == "__main__":
    raise SystemExit(part_main(body))
