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


class _NoStream:
    """The (absent) CUDA stream: waiting on or recording into it does nothing, as every op already ran in order."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None):
        return event

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

    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _APPLIED = True
    return True
