"""Helpers for tests/test_qwen2_moe.py: tiny random Qwen2-MoE checkpoints in odd sizes (routed experts + a gated shared
expert) and the multi-process worker (one spawn, every layout), in the pattern of tests/moe_helpers.py."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import models_helpers
import moe_helpers
import torch

VOCAB, SEQ = 203, 24
# 5 experts, top-3, hidden 40 (head_dim 10), expert intermediate 22, shared expert 26 (13 per TP-2 rank), softmax
# over all experts then top-3 (norm_topk_prob false: Qwen1.5-MoE's and transformers' default)
SHAPE = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=45, moe_intermediate_size=22,
             shared_expert_intermediate_size=26, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, max_position_embeddings=256,
             rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
# (model, TP, PP, EP) on a world of 4: the 5-expert model at TP 1 / 2; EP 2 needs an even count: the 6-expert one
LAYOUTS = [("e5", 1, 1, 1), ("e5", 2, 1, 1), ("e6", 1, 1, 2), ("e6", 2, 1, 2), ("e6", 1, 2, 2)]


_NOISE = {"mlp.gate.weight": 1.0, "shared_expert_gate.weight": 1.0, "shared_expert.gate_proj.weight": 0.3,
          "shared_expert.up_proj.weight": 0.3, "shared_expert.down_proj.weight": 0.3}


def make_tiny_qwen2_moe(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """A random fp32 Qwen2MoeForCausalLM: norms 1 + noise, biases noise, router and shared-expert gate N(0, 1) (clear
    top-k choices; gates spread over (0, 1)), the shared expert N(0, 0.3^2) (its share of the logits is far above
    the tests' tolerance: ``ablated_logits``)."""
    import transformers

    config = transformers.Qwen2MoeConfig(**{**SHAPE, **overrides})
    return models_helpers.save_random_checkpoint(config, out_dir, seed, noise=_NOISE)


def ablated_logits(hf_dir, ids: torch.Tensor, part: str) -> torch.Tensor:
    """transformers' logits without the shared expert (part "shared") or with its gate held at 1 ("gate")."""
    model = moe_helpers.hf_model(hf_dir)
    for layer in model.model.layers:
        if part == "shared":
            layer.mlp.shared_expert.forward = torch.zeros_like
        else:
            layer.mlp.shared_expert_gate.forward = lambda x: torch.full((*x.shape[:-1], 1), 50.0)
    with torch.no_grad():
        return model(ids).logits


tokens = moe_helpers.tokens  # [batch, SEQ] ids < VOCAB (the same sizes as moe_helpers')


def forced_routes(experts: int, top_k: int, batch: int = 4, seq: int = SEQ, layers: int = 2, seed: int = 2):
    """Random valid routes int32 [B, S, layers, top_k]: k distinct experts per token and layer."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, seq, layers, experts, generator=g).argsort(-1)[..., :top_k].to(torch.int32)


def worker(hf_dirs: dict[str, str], result_path: str) -> None:
    """For each LAYOUTS entry: logits against transformers, gradients (TP 1), the export a weight push sends
    bit-exact against the checkpoint, and forced routes replayed against transformers forced to the same routes."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config
    from megatron_spo.models.hf_map import iter_hf_tensors, load_hf_into_model
    from megatron_spo.models.parallel import init_parallel
    from megatron_spo.models.pipeline import gather_logits_to_rank0, run_pipeline
    from megatron_spo.models.routing_replay import replayed, router_order

    rank = int(os.environ["RANK"])
    ids = tokens()
    mb_ids = [ids[0:2], ids[2:4]]
    refs: dict = {}

    def loss_fn(logits_local, index):
        return vocab_parallel_cross_entropy(logits_local[:, :-1].float().contiguous(), mb_ids[index][:, 1:]).mean()

    results: dict = {}
    for model, tp, pp, ep in LAYOUTS:
        hf_dir = hf_dirs[model]
        cfg = read_hf_config(hf_dir)
        reader = HFReader(hf_dir, verify=False)
        routes = forced_routes(cfg.moe.num_experts, cfg.moe.router_topk)
        if rank == 0 and model not in refs:
            refs[model] = (moe_helpers.hf_reference(hf_dir, ids), moe_helpers.hf_forced(hf_dir, ids, routes),
                           {part: ablated_logits(hf_dir, ids, part) for part in ("shared", "gate")})
        pcfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
        init_parallel(pcfg, cfg, seed=123)
        chunks = build_policy(cfg, pcfg)
        load_hf_into_model(chunks, cfg, reader.get)
        logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=2)
        with replayed(chunks, router_order(routes)):  # one micro-batch of 4 rows: the routes are the whole batch's
            replay_logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=4)
        rec: dict = {}
        if rank == 0:
            (ref_logits, ref_grads), (forced_logits, _), ablated = refs[model]
            rec.update(shared_changes_logits=(ablated["shared"] - ref_logits).abs().max().item(),
                       gate_changes_logits=(ablated["gate"] - ref_logits).abs().max().item(),
                       logit_max_abs_diff=(logits - ref_logits).abs().max().item(),
                       logit_scale=ref_logits.abs().max().item(),
                       forced_logit_max_abs_diff=(replay_logits - forced_logits).abs().max().item(),
                       forced_changes_logits=(forced_logits - ref_logits).abs().max().item())
        if tp == 1:  # megatron-core trains MoE under TP > 1 only with sequence parallelism, which needs a GPU
            for c in chunks:
                c.train()
                c.zero_grad(set_to_none=True)
            run_pipeline(chunks, ids, micro_batch_size=2, loss_fn=loss_fn)
            worst, worst_name, names = 0.0, "", []
            for hf_name, g in iter_hf_tensors(chunks, cfg, grads=True):
                # every rank holds the same batch: a routed expert sees it once from each EP rank (megatron's DDP
                # scales expert grads by 1 / EP); the shared expert is dense, on every rank with its own tokens
                g = g / ep if ".mlp.experts." in hf_name else g
                ref = ref_grads[hf_name]
                d = (g - ref).abs().max().item() / (ref.abs().max().item() + 1e-12)
                names.append(hf_name)
                if d > worst:
                    worst, worst_name = d, hf_name
            rec.update(grad_max_rel_diff=worst, grad_worst_tensor=worst_name, grad_names=names)
        exact, exported = True, []
        for hf_name, t in iter_hf_tensors(chunks, cfg):
            exact &= torch.equal(t, reader.get(hf_name))
            exported.append(hf_name)
        if rank == 0:
            rec.update(export_bit_exact=bool(exact), exported=exported, checkpoint_names=reader.names())
        results[f"{model}_tp{tp}_pp{pp}_ep{ep}"] = rec
        del chunks
        ps.destroy_model_parallel()
    if rank == 0:
        Path(result_path).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
