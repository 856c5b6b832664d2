"""megatron-core dist_checkpointing for the Llama chunks: written under one TP/PP layout, loadable under any.

    save_megatron(chunks, model_cfg, ckpt_dir)     # collective; writes ckpt_dir/model_config.json too
    load_megatron(chunks, ckpt_dir)                # collective; in place
    cfg = read_megatron_config(ckpt_dir)

Sharded tensors are keyed globally (layers stacked on a prepended axis), so the layout that wrote a
checkpoint does not constrain the one that reads it. The vocabulary dimension may differ (different
TP padding): megatron marks embeddings / LM head ``allow_shape_mismatch`` and zero-fills extra rows.
Scripts calling these need an ``if __name__ == "__main__":`` guard (megatron starts a spawn helper).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_spo.config import ModelConfig

MODEL_CONFIG_NAME = "model_config.json"


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _sharded_state_dict(model_chunks) -> dict:
    return {f"chunk{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}


def save_megatron(model_chunks, cfg: ModelConfig, ckpt_dir: str | Path) -> None:
    """Collective save of all chunks of all ranks into ``ckpt_dir`` (created)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(model_chunks), str(ckpt_dir))
    if rank == 0:
        (ckpt_dir / MODEL_CONFIG_NAME).write_text(cfg.model_dump_json(indent=2) + "\n")


def load_megatron(model_chunks, ckpt_dir: str | Path, *, assign: bool = False) -> None:
    """Collective load into the chunks (any TP/PP layout).

    ``assign=True`` makes the loaded tensors the parameters' storage (no copy); only before any DDP
    wrapping or optimizer exists (offline conversion)."""
    from megatron.core import dist_checkpointing

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir}: not a megatron dist checkpoint (no metadata.json)")
    loaded = dist_checkpointing.load(_sharded_state_dict(model_chunks), str(ckpt_dir))
    for i, chunk in enumerate(model_chunks):
        state = {k: v for k, v in loaded[f"chunk{i}"].items() if not k.endswith("._extra_state")}
        missing, unexpected = _unwrap(chunk).load_state_dict(state, strict=False, assign=assign)
        missing = [k for k in missing if not k.endswith("._extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"{ckpt_dir}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )


def read_megatron_config(ckpt_dir: str | Path) -> ModelConfig:
    path = Path(ckpt_dir) / MODEL_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir}: no {MODEL_CONFIG_NAME} (not written by megatron-spo convert)")
    return ModelConfig.model_validate(json.loads(path.read_text()))


def checkpoint_dtype(cfg: ModelConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.params_dtype]
