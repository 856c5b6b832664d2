"""Helpers for tests/test_moe.py: a tiny random Qwen3-MoE checkpoint in odd sizes, transformers' reference with
per-expert gradients, and the multi-process worker (one spawn, every layout)."""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import models_helpers
import torch
import trainer_helpers

VOCAB, SEQ = 203, 24
# 6 experts, top-2, hidden 37, head_dim 12, expert intermediate 22, dense intermediate 45 (not used by any layer)
SHAPE = dict(vocab_size=VOCAB, hidden_size=37, intermediate_size=45, moe_intermediate_size=22, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=6, num_experts_per_tok=2,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2)]  # (TP, PP, EP) on a world of 4


def make_tiny_moe(out_dir: str | Path, seed: int = 0, router_std: float = 1.0, **overrides) -> Path:
    """A random fp32 Qwen3MoeForCausalLM: norms 1 + noise; router weights N(0, router_std^2): at 1 each token's
    top-2 are clear (a near tie would make routing, hence parity, depend on the last bit); small, routes tie often."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{**SHAPE, "norm_topk_prob": True, **overrides})
    return models_helpers.save_random_checkpoint(config, out_dir, seed, noise={"mlp.gate.weight": router_std})


def hf_model(hf_dir):
    """transformers' model, experts one by one (its grouped_mm refuses odd shapes on CPU)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, experts_implementation="eager").eval()


tokens = functools.partial(models_helpers.tokens, seq=SEQ, vocab=VOCAB)  # tokens(batch=4, seed=1): [batch, SEQ]


def per_expert(name: str, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors -> the checkpoint's per-expert names (gate rows before up rows)."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        out = {}
        for e, g in enumerate(grad):
            gate, up = g.chunk(2, dim=0)
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        return out
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": g for e, g in enumerate(grad)}
    return {name: grad}


def checkpoint_logits_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """models_helpers.logits_and_grads with the gradients by checkpoint name (per expert)."""
    logits, grads = models_helpers.logits_and_grads(model, ids)
    by_name = {}
    for n, g in grads.items():
        by_name.update(per_expert(n, g))
    return logits, by_name


def hf_reference(hf_dir, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits [B, S, V] and the mean next-token cross-entropy's gradients by checkpoint name."""
    return checkpoint_logits_and_grads(hf_model(hf_dir), ids)


def forced_routes(batch: int = 4, seq: int = SEQ, seed: int = 2) -> torch.Tensor:
    """Random valid routes int32 [B, S, layers, top_k]: k distinct experts per token and layer."""
    g = torch.Generator().manual_seed(seed)
    layers, experts, k = SHAPE["num_hidden_layers"], SHAPE["num_experts"], SHAPE["num_experts_per_tok"]
    return torch.rand(batch, seq, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.int32)


def hf_forced(hf_dir, ids: torch.Tensor, routes: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits and gradients with every router's top-k replaced by ``routes`` [B, S, layers, k]
    (its probabilities of those experts kept: softmax over all experts, renormalised over the k with
    norm_topk_prob)."""
    model = hf_model(hf_dir)
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate

        def forward(hidden, gate=gate, chosen=routes[:, :, i].reshape(-1, routes.shape[-1]).long()):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            top = probs.gather(1, chosen)
            if gate.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), chosen

        gate.forward = forward
    return checkpoint_logits_and_grads(model, ids)


def moe_worker(hf_dir: str, result_path: str) -> None:
    """For each LAYOUTS entry: logits and gradients against transformers, the export (what a weight push sends)
    bit-exact against the checkpoint, and routing replay (models/routing_replay.py)."""
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
    from megatron_spo.models.routing_replay import recorded, replayed, router_order

    rank = int(os.environ["RANK"])
    ids = tokens()
    mb_ids = [ids[0:2], ids[2:4]]
    cfg = read_hf_config(hf_dir)
    reader = HFReader(hf_dir, verify=False)
    routes = forced_routes()
    if rank == 0:
        ref_logits, ref_grads = hf_reference(hf_dir, ids)
        forced_logits, forced_grads = hf_forced(hf_dir, ids, routes)

    def loss_fn(logits_local, index, batch=None):
        batch = mb_ids[index] if batch is None else batch
        return vocab_parallel_cross_entropy(logits_local[:, :-1].float().contiguous(), batch[:, 1:]).mean()

    results: dict = {}
    for tp, pp, ep in LAYOUTS:
        pcfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
        init_parallel(pcfg, cfg, seed=123)
        chunks = build_policy(cfg, pcfg)
        load_hf_into_model(chunks, cfg, reader.get)
        rec: dict = {}
        logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=2)
        # routing replay: the routers' own choice replayed changes nothing; forced routes give transformers' logits
        # under the same routes (one micro-batch of 4 rows: the replayed routes are the whole batch's)
        with recorded([c for c in chunks if c.pre_process and c.post_process]) as own:
            whole = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=4)
            own_routes = own() if pp == 1 else None
        with replayed(chunks, router_order(routes)):
            replay_logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=4)
        mixed = routes.clone()
        mixed[1] = -1  # a row without routes (offline data) routes itself beside replayed rows
        with replayed(chunks, router_order(mixed)):
            mixed_logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=4)
        if own_routes is not None:
            with replayed(chunks, own_routes):
                own_logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=4)
        if rank == 0:
            rec["logit_max_abs_diff"] = (logits - ref_logits).abs().max().item()
            rec["logit_scale"] = ref_logits.abs().max().item()
            rec["forced_logit_max_abs_diff"] = (replay_logits - forced_logits).abs().max().item()
            rec["forced_changes_logits"] = (forced_logits - ref_logits).abs().max().item()
            rec["mixed_rows_diff"] = max((mixed_logits[[0, 2, 3]] - replay_logits[[0, 2, 3]]).abs().max().item(),
                                         (mixed_logits[1] - whole[1]).abs().max().item())
            if own_routes is not None:
                rec["own_routes_replayed_bitwise"] = bool(torch.equal(own_logits, whole))
                rec["own_routes_shape"] = list(own_routes.shape)
        worst, worst_name, names = None, "", []
        if tp == 1:  # under replay the backward follows the forced routes: transformers' gradients under them
            for c in chunks:
                c.train()
                c.zero_grad(set_to_none=True)
            with replayed(chunks, router_order(routes)):  # one micro-batch of 4 rows
                run_pipeline(chunks, ids, micro_batch_size=4, loss_fn=lambda logits, _: loss_fn(logits, 0, ids))
            forced_worst = 0.0
            for hf_name, g in iter_hf_tensors(chunks, cfg, grads=True):
                g = g / ep if ".mlp.experts." in hf_name else g
                ref = forced_grads[hf_name] if rank == 0 else g
                forced_worst = max(forced_worst, (g - ref).abs().max().item() / (ref.abs().max().item() + 1e-12))
            rec["forced_grad_max_rel_diff"] = forced_worst
        if tp == 1:  # TP > 1 trains MoE only with sequence parallelism: held to one process in test_moe_layouts.py
            for c in chunks:
                c.train()
                c.zero_grad(set_to_none=True)
            run_pipeline(chunks, ids, micro_batch_size=2, loss_fn=loss_fn)
            worst = 0.0
            for hf_name, g in iter_hf_tensors(chunks, cfg, grads=True):
                # every rank holds the same batch, so an expert sees it once from each EP rank; megatron's DDP
                # scales expert grads by expert-DP / DP = 1 / EP (dense ones are averaged over identical copies)
                g = g / ep if ".mlp.experts." in hf_name else g
                ref = ref_grads[hf_name]
                d = (g - ref).abs().max().item() / (ref.abs().max().item() + 1e-12)
                names.append(hf_name)
                if d > worst:
                    worst, worst_name = d, hf_name
        exact, exported = True, []
        for hf_name, t in iter_hf_tensors(chunks, cfg):
            exact &= torch.equal(t, reader.get(hf_name))
            exported.append(hf_name)
        if rank == 0:
            rec.update(grad_max_rel_diff=worst, grad_worst_tensor=worst_name, export_bit_exact=bool(exact),
                       exported=exported, grad_names=names, checkpoint_names=reader.names())
        results[f"tp{tp}_pp{pp}_ep{ep}"] = rec
        del chunks
        ps.destroy_model_parallel()
    if rank == 0:
        Path(result_path).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


class DrawCountedSource:
    """An online source whose resumable state is how many trajectories it has drawn (self.drawn)."""

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


class EngineSource(trainer_helpers.EngineSource):
    """The local engine's samples of the MoE model at T = 1 with its routed experts (trainer_helpers.EngineSource)."""

    def __init__(self, hf_dir: str, dtype: str = "float32", seed: int = 0):
        super().__init__(hf_dir, dtype=dtype, seed=seed, routes=True)


def train_cfg(run_dir: str, hf_dir: str, replay: str, *, steps: int = 1, pack: bool = True) -> dict:
    return dict(run_dir=run_dir, steps=steps, algo="spo", beta=0.5, init={"hf": hf_dir}, routing_replay=replay,
                optimizer={"lr": 1e-3, "warmup_steps": 1},
                batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 64, "max_seq_length": 64,
                       "pack_sequences": pack},
                model_update_interval=1, checkpoint={"interval": 100}, logging={"progress": False})


def train_gap_worker(runs: list[tuple[dict, str]], engine_dtype: str | None) -> None:
    """One rank: each config trains on the engine's samples (engine_dtype; None: ForcedRoutesSource's), the same
    samples for each (a fresh source of one seed); its metrics are in its run_dir."""
    warnings.filterwarnings("ignore")
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, hf_dir) in enumerate(runs):
        source = ForcedRoutesSource(hf_dir) if engine_dtype is None else EngineSource(hf_dir, engine_dtype)
        trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=source)
        try:
            trainer.train()
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)


class ForcedRoutesSource(DrawCountedSource):
    """Online trajectories with random routes (k distinct experts per token and layer) and, as behaviour log-probs,
    transformers' log-probs of the response under exactly those routes (fp32, T = 1): a trainer that replays the
    routes reproduces them to rounding; one that routes itself does not."""

    def __init__(self, hf_dir: str, seed: int = 0):
        self.hf_dir, self.g, self.drawn = hf_dir, torch.Generator().manual_seed(seed), 0

    def take(self, k: int, timeout_s: float | None = None) -> list:
        from megatron_spo.data.routes import RoutedExperts
        from megatron_spo.rollout.manager import Trajectory

        out = []
        for i in range(k):
            n_prompt, n_resp = 5, int(torch.randint(3, 12, (1,), generator=self.g))
            seq = torch.randint(1, VOCAB, (1, n_prompt + n_resp), generator=self.g)
            routes = forced_routes(1, n_prompt + n_resp - 1, seed=int(torch.randint(0, 2**31, (1,), generator=self.g)))
            logits, _ = hf_forced(self.hf_dir, seq[:, :-1], routes)
            logp = torch.log_softmax(logits[0].double(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            out.append(Trajectory(prompt_id=f"p{(self.drawn + i) // 4}", prompt_tokens=seq[0, :n_prompt].tolist(),
                                  response_tokens=seq[0, n_prompt:].tolist(), reward=-float(i % 2), source="online",
                                  policy_version=0, behaviour_logprobs=logp[n_prompt - 1:].tolist(), q0=-0.5,
                                  temperature=1.0, top_p=1.0, routed_experts=RoutedExperts.from_array(routes[0].numpy())))
        self.drawn += k
        return out
