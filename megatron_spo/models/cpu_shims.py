"""Every CPU workaround megatron-core 0.16.1 to 0.19.x needs, in one place, applied once and only without CUDA.

megatron-core assumes a GPU in a handful of spots (see docs/engineering-notes.md,
"megatron-core on CPU"). Each shim below names the spot it covers, and the version that brought it
when that is not 0.16.1. On a machine with a CUDA device ``apply_cpu_shims()`` does nothing.

    from megatron_spo.models.cpu_shims import apply_cpu_shims
    apply_cpu_shims()   # before building models or process groups; idempotent
"""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_MODE: TorchFunctionMode | None = None

# CPU tensor type names that megatron's optimizer / grad clipping compare against their CUDA names.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")`` onto the CPU.

    Covers the hard-coded CUDA sites: the token counter in pipeline schedules, optimizer setup and
    fully-parallel checkpoint loading with DP > 1; and ``pin_memory=True`` (no pinned allocator without an
    accelerator): RoPE under context parallelism (rope_utils.get_pos_emb_on_this_cp_rank) pins its index.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NoEvent:
    """An event of the (absent) CUDA stream: already complete."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True


class _NoStream:
    """The (absent) CUDA stream: waiting on or recording into it does nothing, as every op already ran in order."""

    def __init__(self, *args, **kwargs) -> None:  # torch.cuda.Stream(device=..., priority=...)
        pass

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None):
        return event if event is not None else _NoEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_NO_STREAM = _NoStream()


def cpu_shims_needed() -> bool:
    return not torch.cuda.is_available()


def apply_no_te_shims() -> None:
    """What megatron-core needs without transformer-engine, CPU or GPU; idempotent. 0.16.1: the MoE router's
    gating GEMM (moe_utils.RouterGatingLinearFunction) tests ``te_general_gemm is not None``, a name bound only
    when TE imports (NameError otherwise); None selects its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _shim_moe_split_sizes() -> None:
    """The MoE alltoall dispatcher's split sizes reach all_to_all_single as numpy arrays only when they were on a GPU
    (moe_utils.maybe_move_tensor_to_cpu converts CUDA tensors, token_dispatcher imports it by name): on the CPU they
    stay tensors, which torch.distributed refuses as split sizes. Convert CPU tensors the same way."""
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError:
        return
    original = getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None)
    if original is None or getattr(original, "_cpu_shim", False):
        return

    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    move._cpu_shim = True
    token_dispatcher.maybe_move_tensor_to_cpu = move


def _shim_uneven_collectives() -> None:
    """gloo's all_gather and reduce_scatter of tensor lists refuse tensors of unequal sizes, which megatron's MoE
    alltoall dispatcher passes under TP > 1 (tensor_parallel/mappings.py ``_gather_along_first_dim`` /
    ``_reduce_scatter_along_first_dim`` with split sizes: each TP rank's own token count). Pad every tensor to the
    largest along dim 0, run the equal-size collective, keep each tensor's own rows: the same result."""
    import torch.distributed as dist

    if getattr(dist.all_gather, "_cpu_shim", False):
        return
    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    def padded(t: torch.Tensor, rows: int) -> torch.Tensor:
        return t if t.shape[0] == rows else torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])

    @functools.wraps(all_gather)
    def uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or all(t.shape == tensor.shape for t in tensor_list):
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        out = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
        all_gather(out, padded(tensor, rows).contiguous(), group=group)
        for t, o in zip(tensor_list, out):
            t.copy_(o[: t.shape[0]])
        return None

    @functools.wraps(reduce_scatter)
    def uneven_reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or all(t.shape == output.shape for t in input_list):
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in input_list)
        out = output.new_empty((rows, *output.shape[1:]))
        reduce_scatter(out, [padded(t, rows).contiguous() for t in input_list], op=op, group=group)
        output.copy_(out[: output.shape[0]])
        return None

    uneven_all_gather._cpu_shim = True
    dist.all_gather, dist.reduce_scatter = uneven_all_gather, uneven_reduce_scatter


def apply_cpu_shims() -> bool:
    """Install the shims when no CUDA device is present. Returns True when shims are active."""
    global _APPLIED, _MODE
    if _APPLIED:
        return True
    if not cpu_shims_needed():
        return False

    # RoPE inv_freq, the global memory buffer and p2p shape exchange pass current_device() as a device.
    torch.cuda.current_device = lambda: "cpu"
    # p2p communication and async checkpoint writing synchronise the (absent) stream.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # 0.19: the DDP grad sync (param_and_grad_buffer.py, start_grad_sync) takes torch.cuda.current_stream()
    # unconditionally, to wait for CUDA-graph wgrad events on it. (torch.cuda.stream(s) is already a no-op
    # without CUDA.)
    torch.cuda.current_stream = lambda device=None: _NO_STREAM
    # the MoE alltoall dispatcher makes a side stream for its device-to-host copies of the split sizes and waits on
    # its event (token_dispatcher.py, MoEAlltoAllTokenDispatcher): on the CPU they are plain copies, in order
    # (a class, not a function: transformers annotates ``torch.cuda.Stream | None`` when its generation utils import)
    torch.cuda.Stream = _NoStream
    # Activation recompute and the RNG tracker save/restore "CUDA" RNG state: use the CPU generator.
    get_state = functools.wraps(torch.cuda.get_rng_state)(lambda device="cuda": torch.get_rng_state())
    set_state = functools.wraps(torch.cuda.set_rng_state)(lambda new_state, device="cuda": None)
    torch.cuda.get_rng_state = get_state
    torch.cuda.random.get_rng_state = get_state
    torch.cuda.set_rng_state = set_state
    torch.cuda.random.set_rng_state = set_state
    import megatron.core.tensor_parallel.random as mp_random

    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None

    # Optimizer setup and grad clipping assert param.type() == 'torch.cuda.FloatTensor'.
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type

    _shim_moe_split_sizes()
    _shim_uneven_collectives()

    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _APPLIED = True
    return True
