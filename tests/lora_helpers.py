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
