"""Workers of tests/test_lora.py (run inside spawn_local ranks: write results to files, stdout is not seen)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (TP, PP) on 2 ranks; TP 1 x PP 1 runs as 2 data-parallel replicas


def random_adapters(shapes: dict[str, tuple], seed: int = 5) -> dict[str, torch.Tensor]:
    """A full tensor per adapter key (both factors), small and reproducible."""
    g = torch.Generator().manual_seed(seed)
    return {k: 0.05 * torch.randn(shape, generator=g) for k, shape in sorted(shapes.items())}


def layer_math_worker(hf_dir: str, lora_data: dict, result_path: str) -> None:
    """Per layout: shapes and requires_grad of the policy's parameters, the adapters as initialised (gathered),
    logits with B = 0 with the adapters on and off, then with random adapters (both factors, set from full tensors)
    the logits and the merged HF tensors hf_map hands to pushes and exports."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config
    from megatron_spo.models.hf_map import iter_hf_tensors, load_hf_into_model
    from megatron_spo.models.lora import (
        LoraConfig,
        adapters_off,
        count_parameters,
        gather_adapters,
        load_adapters,
    )
    from megatron_spo.models.parallel import init_parallel
    from megatron_spo.models.peft_export import write_peft_adapter
    from megatron_spo.models.pipeline import gather_logits_to_rank0

    rank = int(os.environ["RANK"])
    cfg = read_hf_config(hf_dir)
    reader = HFReader(hf_dir)
    lora = LoraConfig.model_validate(lora_data)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    results = {}
    for tp, pp in LAYOUTS:
        pcfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        init_parallel(pcfg, cfg, seed=3)
        chunks = build_policy(cfg, pcfg, lora=lora, lora_seed=11)
        load_hf_into_model(chunks, cfg, reader.get)
        rec: dict = {"params": {n: (tuple(p.shape), p.requires_grad) for c in chunks for n, p in c.named_parameters()},
                     "counts": count_parameters(chunks)}
        rec["initial"] = gather_adapters(chunks)
        rec["on"] = gather_logits_to_rank0(chunks, ids, cfg.vocab_size)
        with adapters_off(chunks):
            rec["off"] = gather_logits_to_rank0(chunks, ids, cfg.vocab_size)
        full = [random_adapters({k: tuple(v.shape) for k, v in rec["initial"].items()}) if rank == 0 else None]
        dist.broadcast_object_list(full, src=0)
        load_adapters(chunks, full[0])
        rec["lora"] = gather_logits_to_rank0(chunks, ids, cfg.vocab_size)
        rec["set"] = gather_adapters(chunks)
        if (tp, pp) == (2, 1) and rank == 0:  # the HF PEFT export of what TP 2 holds
            write_peft_adapter(Path(result_path).with_name("peft-tp2"), rec["set"], lora, cfg, hf_dir)
        rec["merged"] = {n: t.clone() for n, t in iter_hf_tensors(chunks, cfg)}
        with adapters_off(chunks):
            rec["off_after"] = gather_logits_to_rank0(chunks, ids, cfg.vocab_size)
            rec["merged_off"] = {n: t.clone() for n, t in iter_hf_tensors(chunks, cfg)}
        all_counts = [None] * dist.get_world_size()
        dist.all_gather_object(all_counts, rec["counts"])
        rec["counts"] = all_counts
        results[f"tp{tp}_pp{pp}"] = rec
        del chunks
        ps.destroy_model_parallel()
    if rank == 0:
        torch.save({"ids": ids, "results": results}, Path(result_path))
    dist.destroy_process_group()


def _state_bytes(trainer) -> dict[str, int]:
    """Bytes this rank holds for training: model parameters (policy, reference), gradient buffers, optimizer state."""
    chunks = list(trainer.policy) + list(trainer.reference or [])
    params = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for c in trainer.policy for p in c.parameters()
                if getattr(p, "main_grad", None) is not None)
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    state = sum(t.numel() * t.element_size() for opt in optimizers for s in opt.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t))
    held = sum(p.numel() for opt in optimizers for g in opt.optimizer.param_groups for p in g["params"])
    return {"params": params, "grads": grads, "optimizer_state": state, "optimizer_params": held}


def train_lora_and_dump(runs: list[tuple[dict, str]]) -> None:
    """One rank: for each (config, out_file), train with the deterministic online source; then rank 0 saves the
    merged HF-named weights to out_file (as trainer_helpers.train_and_dump) and to out_file + ".lora.pt": the full
    adapters, parameter and memory counts, and, on a fresh batch, the reference log-probs computed with the
    adapters off against those of a separately built reference model (loaded from init as the trainer loads it):
    bitwise equal or not. A run whose Trainer refuses to start writes its one-line error to out_file + ".error"."""
    import torch.distributed as dist
    from trainer_helpers import DeterministicSource

    from megatron_spo.config import ConfigError
    from megatron_spo.models import builders
    from megatron_spo.models.hf_map import iter_hf_tensors
    from megatron_spo.models.lora import count_parameters, gather_adapters
    from megatron_spo.models.parallel import destroy_parallel
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, out_file) in enumerate(runs):
        try:
            trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=DeterministicSource())
        except ConfigError as err:
            if int(os.environ["RANK"]) == 0:
                Path(out_file + ".error").write_text(str(err))
            destroy_parallel()
            continue
        try:
            trainer.train()
            weights = {name: t.clone() for name, t in iter_hf_tensors(trainer.policy, trainer.model_cfg)}
            adapters = gather_adapters(trainer.policy) if trainer.cfg.lora else None
            rec = {"counts": count_parameters(trainer.policy), "bytes": _state_bytes(trainer),
                   "reference_built": trainer.reference is not None}
            if trainer.cfg.lora:
                _, mbs, _ = trainer.batch()
                off = trainer.forward("reference", mbs, "logp")
                policy = trainer.forward("policy", mbs, "logp")
                reference = trainer._schedule_ready(builders.build_reference(trainer.model_cfg, trainer.cfg.parallel))
                trainer._load_initial_weights(reference)
                trainer.reference = reference
                built = trainer.forward("reference", mbs, "logp")
                trainer.reference = None
                mine = [(a, b, c) for a, b, c in zip(off, built, policy) if a is not None]
                rec["reference"] = {"micro_batches": len(mine),
                                    "bitwise": all(torch.equal(a, b) for a, b, _ in mine),
                                    "policy_max_diff": max((a - c).abs().max().item() for a, _, c in mine)
                                    if mine else None}
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rec)
            if trainer.rank == 0:
                torch.save(weights, out_file)
                torch.save({"adapters": adapters, "ranks": gathered}, out_file + ".lora.pt")
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)
