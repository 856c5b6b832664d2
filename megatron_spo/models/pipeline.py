"""Run micro-batches through megatron's pipeline schedule (any TP/PP/VPP), for tests, checks and eval.

    outs = run_pipeline(chunks, input_ids, micro_batch_size=2)                    # forward only
    outs = run_pipeline(chunks, input_ids, loss_fn=lambda out, mb: ...)          # forward + backward
    logits = gather_logits_to_rank0(chunks, input_ids, vocab_size)                # [B, S, V] on rank 0

On the last pipeline stage ``run_pipeline`` returns the per-micro-batch outputs (logits [b, S, V_local],
or hidden states [b, S, H] with ``hidden_states=True``); elsewhere an empty list. ``loss_fn(output,
micro_batch_index)`` returns a scalar; the schedule backpropagates it (gradients land in ``.grad``, or
``main_grad`` under megatron DDP).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_spo.collectives import all_reduce_
from megatron_spo.models.builders import _unwrap, default_position_ids, output_hidden_states
from megatron_spo.models.packing import Packed


def run_pipeline(
    model_chunks,
    input_ids: Tensor,
    *,
    micro_batch_size: int | None = None,
    loss_fn: Callable[[Tensor, int], Tensor] | None = None,
    hidden_states: bool = False,
    position_ids: Tensor | None = None,
    lengths: Tensor | None = None,
) -> list[Tensor]:
    """One global batch [B, S] through the schedule as B / micro_batch_size micro-batches.

    lengths [B]: run each micro-batch packed (models/packing.py: its rows' first lengths[i] tokens back to back,
    every stream padded to one width); the outputs come back in the padded [b, S, ...] layout, 0 past each length."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = input_ids.shape
    mbs = micro_batch_size or b
    if b % mbs:
        raise ValueError(f"run_pipeline: batch size {b} is not divisible by micro_batch_size {mbs}")
    if position_ids is None:
        position_ids = default_position_ids(input_ids)
    micro = [(input_ids[i : i + mbs], position_ids[i : i + mbs]) for i in range(0, b, mbs)]
    packs = None
    if lengths is not None:
        width = max(int(lengths[i : i + mbs].sum()) for i in range(0, b, mbs))
        packs = [Packed.of(input_ids[i : i + mbs], lengths[i : i + mbs], width=width) for i in range(0, b, mbs)]
        micro = [(p.input_ids, p.position_ids, p) for p in packs]
    outputs: list[Tensor] = []
    step = {"i": 0}

    def forward_step(data_iterator, model):
        ids, pos, *pack = next(data_iterator)
        index = step["i"]
        output = model(ids, pos, None, **({"packed_seq_params": pack[0].params()} if pack else {}))
        if pack and _unwrap(model).post_process:
            output = pack[0].unpack(output[0])  # [1, T, ...] -> [b, S, ...]

        def loss_func(output_tensor):
            outputs.append(output_tensor.detach())
            if loss_fn is None:
                return output_tensor.sum() * 0.0, {}
            return loss_fn(output_tensor, index), {}

        return output, loss_func

    def counting_iterator():
        for item in micro:
            yield item
            step["i"] += 1

    chunks = list(model_chunks)
    # With virtual stages each chunk reads its own iterator; micro-batches are then indexed by the
    # order in which the last chunk computes losses (see _indexed).
    data = [iter(micro) for _ in chunks] if len(chunks) > 1 else counting_iterator()
    forward_backward = get_forward_backward_func()
    ctx = output_hidden_states(chunks) if hidden_states else _null()
    with ctx:
        forward_backward(
            forward_step_func=_indexed(forward_step, step, len(chunks) > 1),
            data_iterator=data,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro),
            seq_length=packs[0].num_tokens if packs else s,
            micro_batch_size=1 if packs else mbs,
            forward_only=loss_fn is None,
        )
    return outputs


def _indexed(forward_step, step, virtual: bool):
    if not virtual:
        return forward_step

    def wrapped(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)

        def counted(output_tensor):
            result = loss_func(output_tensor)
            step["i"] += 1
            return result

        return output, counted

    return wrapped


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@torch.no_grad()
def gather_logits_to_rank0(
    model_chunks, input_ids: Tensor, vocab_size: int, micro_batch_size: int | None = None,
    lengths: Tensor | None = None,
):
    """Full-vocab logits [B, S, vocab_size] (padding dropped) on global rank 0; None elsewhere.

    Every rank must call it with the same input_ids. lengths: run packed (see run_pipeline).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for chunk in model_chunks:
        chunk.eval()
    outs = run_pipeline(model_chunks, input_ids, micro_batch_size=micro_batch_size, lengths=lengths)
    b, s = input_ids.shape
    result = torch.zeros(b, s, vocab_size, dtype=torch.float32)
    if outs and ps.get_data_parallel_rank() == 0:
        local = torch.cat(outs, dim=0).float()
        tp = ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
            local = torch.cat(shards, dim=-1)
        if ps.get_tensor_model_parallel_rank() == 0:
            result = local[..., :vocab_size].contiguous()
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_reduce_(result)  # exactly one rank holds non-zero logits
    return result if (not dist.is_initialized() or dist.get_rank() == 0) else None
