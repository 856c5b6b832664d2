"""What SGLang's own model code does with a weight push: which HF names ``load_weights`` writes, into which
parameter (and shard), which it skips or rejects, and which parameters nothing reached.

The trainer pushes (HF name, full tensor) pairs (megatron_spo/models/hf_map.py ``iter_hf_tensors``); the
engine hands them to its model class's ``load_weights`` (SGLang's model-runner WeightUpdater:
``self.get_model().load_weights(named_tensors)``), which maps names through its ``stacked_params_mapping``
and looks them up in ``dict(self.named_parameters())``. Names it does not know are often skipped silently
(``continue``) or with one log line, so a push can leave a tensor stale without any error. This module
answers, with SGLang's own code, what happens to each name.

API
---
* :func:`sglang_weight_load_report` ``(architecture, hf_config, named_tensors, *, weight_loader_v2=False)
  -> Report``: ``architecture`` is one of :data:`ARCHITECTURES` (``LlamaForCausalLM``,
  ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``,
  ``Qwen2MoeForCausalLM``); ``hf_config`` a transformers config or its ``to_dict()``; ``named_tensors`` the
  pushed (HF name, tensor) pairs, NaN-free.
* :class:`Report`: ``loaded`` (HF name -> (SGLang parameter, shard id or None): its first write),
  ``writes`` (every weight-loader call, in order), ``skipped`` (names that wrote nothing and raised
  nothing), ``rejected`` (name -> the exception load_weights raised on it: the engine's
  update_weights_from_distributed answers success=false, the weights "partially updated"), ``warnings``
  (name -> SGLang WARNING+ log lines while it was processed), ``params`` (SGLang parameter -> shape),
  ``untouched_params`` (no element written), ``partial_params`` (written in part, e.g. a qkv_proj
  without its v shard), ``unattributed_params`` (changed, but by no recorded loader call; should be
  empty), ``load_weights_file`` (the SGLang file whose load_weights ran), ``stubbed_modules``;
  ``silently_skipped`` (skipped with no SGLang log line) and ``problems(exempt_params)`` (one line per
  defect: what a test asserts empty).
* :func:`shutdown_worker`: stop the worker process (also at exit).

How (approach: SGLang's REAL model class, built on CPU)
-------------------------------------------------------
A worker process (multiprocessing "spawn", one per test process, started on first use, ~5 s) runs as
SGLang's CPU engine runs (``SGLANG_USE_CPU_ENGINE=1``, set before any SGLang module is loaded) and
loads SGLang's modules through tests/sglang_source.py with the extra decisions below
(:data:`MODEL_REAL_MODULES`, :data:`MODEL_STUBBED_MODULES`, :data:`MODEL_STANDIN_MODULES`, applied with
``sglang_source.extend_module_lists``). It needs a process of its own because a module has one
identity per process: this profile makes ``sglang.srt.layers`` and ``model_loader/weight_utils.py`` real,
which tests/sglang_source.py's default lists stub for the model-runner WeightUpdater in the test
process, and the CPU-engine switch is read at import time by many modules (``_is_cpu = is_cpu()``).

For each report the worker

1. rebuilds the HF config (``transformers.AutoConfig.for_model(**dict)``: SGLang receives the
   transformers config object) and takes the class from the model file's ``EntryClass`` (what
   SGLang's ModelRegistry does);
2. builds it at TP=1, PP=1 in a model-owned runtime context: SGLang's own ``create_context(
   ServerArgs(model_path="dummy"), role="scheduler", ranks=SpawnRanks(world_rank=0))`` +
   ``use_context`` (ranks derived by SGLang); the process groups, which SGLang builds with
   torch.distributed in ``initialize_model_parallel``, are single-rank stand-ins
   (``world_size=1, rank_in_group=0, is_first_rank=is_last_rank=True``; anything else read from them
   raises): at TP=1 construction and loading communicate nothing, so no torch.distributed group is
   initialised. Parameters are float32 (the engine builds in the checkpoint dtype; loading is the
   same code);
3. fills every parameter with NaN, wraps each parameter's ``weight_loader`` (and gives the ones without
   one, the RMSNorm weights, a wrapper of weight_utils.default_weight_loader, which is what their
   ``getattr(param, "weight_loader", default_weight_loader)`` resolves to) so every call is recorded
   with the pushed tensor it received (the HF name is found by tensor identity);
4. calls the model's real ``load_weights`` once with all names (as the engine does). If it raises, the
   name it was processing is recorded as rejected and load_weights is called again with the names
   after it. SGLang's log records (logger ``sglang``) are attributed to the name being processed;
5. reads back which parameters are still (all / partly) NaN (vocabulary padding rows, which SGLang's
   embedding loader zero-fills, do not count as unwritten).

What it found (SGLang 0.5.23; pinned by tests/test_sglang_models.py, whose docstring lists the facts):
every name of a transformers Llama/Mistral/Qwen2/Qwen3 state_dict reaches a parameter and every
parameter is reached, provided a tied model's ``lm_head.weight`` is not relied on: SGLang's tied LM
head is the embedding, and a pushed ``lm_head.weight`` is skipped (Llama/Mistral silently, Qwen2/Qwen3
with a warning). Unknown names are skipped with a warning, except that Qwen3 raises on an unknown name
containing q_proj/k_proj/v_proj/gate_proj/up_proj.

Nothing of the model's construction or loading is re-implemented here; the stubs cover forward-time and
GPU-only imports (attention kernels, KV pools, CUDA communicators, quantization methods), each with its
reason below, and ``stubbed_modules`` lets the tests check that no undocumented stub was made.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import logging
import multiprocessing as mp
import os
import threading
import traceback
import types
from typing import Any

import sglang_source as sgl

__all__ = [
    "ARCHITECTURES",
    "MODEL_REAL_MODULES",
    "MODEL_STANDIN_MODULES",
    "MODEL_STUBBED_MODULES",
    "Report",
    "SGLangModelWorkerError",
    "sglang_available",
    "sglang_weight_load_report",
    "shutdown_worker",
]

sglang_available = sgl.sglang_available

# Architecture name (HF config ``architectures[0]``) -> the SGLang file whose EntryClass serves it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "sglang.srt.models.llama",
    "MistralForCausalLM": "sglang.srt.models.mistral",
    "Qwen2ForCausalLM": "sglang.srt.models.qwen2",
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3",
    "Qwen3MoeForCausalLM": "sglang.srt.models.qwen3_moe",
    "Qwen2MoeForCausalLM": "sglang.srt.models.qwen2_moe",
}

# ---------------------------------------------------------------------------------------------------
# The worker's module decisions, on top of tests/sglang_source.py's lists (same precedence rules).
# ---------------------------------------------------------------------------------------------------

MODEL_REAL_MODULES: tuple[str, ...] = (
    "sglang.srt.models",  # namespace package (no __init__.py) of ...
    "sglang.srt.models.llama",  # LlamaForCausalLM (+ LlamaModel, layers, load_weights)
    "sglang.srt.models.mistral",  # MistralForCausalLM (a LlamaForCausalLM subclass)
    "sglang.srt.models.qwen2",  # Qwen2ForCausalLM
    "sglang.srt.models.qwen3",  # Qwen3ForCausalLM
    "sglang.srt.models.qwen3_moe",  # Qwen3MoeForCausalLM
    "sglang.srt.models.qwen2_moe",  # Qwen2MoeForCausalLM, Qwen2MoeModel (Qwen3MoeModel builds on it)
    "sglang.srt.eplb.expert_location",  # FusedMoE.weight_loader: physical expert ids (None: identity)
    "sglang.srt.models.utils",  # apply_qk_norm (qwen3), AutoWeightsLoader (the v2 loader)
    "sglang.srt.layers.*",  # linear (QKV/merged/row parallel + weight loaders), embeddings, RMSNorm, rope, ...
    "sglang.srt.layers.quantization",  # package __init__: the method registry (methods stubbed below)
    "sglang.srt.layers.quantization.base_config",  # QuantizationConfig / method base classes
    "sglang.srt.layers.quantization.unquant",  # UnquantizedLinearMethod.create_weights: makes the parameters
    "sglang.srt.layers.quantization.fp8_activation",  # DenseSiluAndMulQuant, built by LlamaMLP/Qwen2MLP
    "sglang.srt.model_loader.weight_utils",  # default_weight_loader, maybe_remap_kv_scale_name
    "sglang.srt.model_loader.auto_loader",  # the weight-loader-v2 path (SGLANG_ENABLE_WEIGHT_LOADER_V2)
    "sglang.srt.model_executor.forward_batch_info",  # ForwardBatch/CaptureHiddenMode (class-level defaults)
    "sglang.srt.distributed.device_communicators.triton_symm_mem_ag",  # LogitsProcessor() sizes from it
)

MODEL_STUBBED_MODULES: dict[str, str] = {
    "sglang.srt.layers.quantization.*": (
        "quantization methods (fp8, awq, gptq, gguf, compressed-tensors, ...): named in the registry the "
        "package __init__ builds and by forward-time fusions (fp8_utils); an unquantized model "
        "(quant_config=None) uses only base_config/unquant/fp8_activation, which are real. Some need "
        "packages not installed here (gguf, compressed_tensors)."
    ),
    "sglang.srt.models.llava": (
        "the vision model base of Mistral3ForConditionalGeneration (imported by mistral.py); "
        "MistralForCausalLM does not use it."
    ),
    "sglang.srt.batch_invariant_ops": "batch-invariant kernels named by layernorm.py's forward.",
    "sglang.srt.distributed.device_communicators.*": (
        "CUDA all-reduce/all-gather communicators (tvm_ffi kernels, NCCL allocator) named by "
        "dp_attention.py and flashinfer_comm_fusion.py; used in forward, not at TP=1 construction."
    ),
    "sglang.srt.distributed.naive_distributed": "CPU-offload collectives named by utils/offloader.py (unused).",
    "sglang.srt.elastic_ep.*": "elastic expert-parallel topology, named by dp_attention.py (no EP here).",
    "sglang.srt.hardware_backend.npu.*": "Ascend NPU MoE methods, named by quantization/unquant.py.",
    "sglang.srt.kv_canary.*": "KV-cache canary debugging, named by forward_batch_info.py.",
    "sglang.srt.managers.auxiliary_output": "a forward output struct named by logits_processor.py.",
    "sglang.srt.mem_cache.*": "KV-cache pools, named by models/utils.py and layers (forward only).",
    "sglang.srt.model_executor.*": (
        "the model runner, CUDA-graph runners, forward context and pools, named by attention/logits "
        "layers for forward; forward_batch_info (and sglang_source's real leaves) stay real."
    ),
    "sglang.srt.eplb.*": (
        "expert-parallel load balancing: the expert-distribution recorder and location dispatch, named by the MoE "
        "layers for forward. Its expert_location leaf is real (FusedMoE.weight_loader asks it for physical "
        "expert ids; none configured: identity)."
    ),
    "sglang.srt.batch_overlap.*": "single / two-batch overlap schedulers named by qwen2_moe.py (forward, off).",
    "sglang.srt.state_capturer.*": (
        "routed-experts / indexer top-k capturers named by the MoE top-k layer (forward; return_routed_experts). "
        "tests/test_moe.py compiles its meta_info decoder from the real file."
    ),
}


def _build_hf_transformers_utils_standin(module: types.ModuleType) -> None:
    """See MODEL_STANDIN_MODULES['sglang.srt.utils.hf_transformers_utils']."""
    path = os.path.join(sgl.sglang_root(), "srt", "utils", "hf_transformers", "common.py")
    sgl.compile_definitions(path, ["get_rope_config"], module.__dict__)
    module.__sglang_standin__ = MODEL_STANDIN_MODULES[module.__name__]


MODEL_STANDIN_MODULES: dict[str, str] = {
    "sglang.srt.utils.hf_transformers_utils": (
        "a shim re-exporting sglang.srt.utils.hf_transformers, whose common.py builds a registry from "
        "every model config class at import (the configs need torchvision/sentencepiece; stubbed). "
        "qwen2.py imports only get_rope_config from it: the stand-in holds that real function "
        "(compiled from srt/utils/hf_transformers/common.py) and nothing else, so any other import "
        "from it fails loudly."
    ),
}

_STANDIN_BUILDERS = {"sglang.srt.utils.hf_transformers_utils": _build_hf_transformers_utils_standin}


# ---------------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    """What SGLang's ``load_weights`` did with each pushed name (see the module docstring)."""

    architecture: str
    loaded: dict[str, tuple[str, Any]]  # HF name -> (SGLang parameter, shard id or None), its first write
    writes: list[tuple[str, str, Any]]  # every weight-loader call: (HF name, parameter, shard id)
    skipped: list[str]  # wrote nothing, raised nothing
    rejected: dict[str, str]  # name -> "ExceptionType: message"
    warnings: dict[str, list[str]]  # name -> SGLang WARNING+ log messages while it was processed
    params: dict[str, tuple[int, ...]]  # SGLang's named_parameters(): name -> shape
    untouched_params: list[str]  # still all NaN
    partial_params: list[str]  # some elements still NaN
    unattributed_params: list[str]  # changed, but no recorded loader call wrote them
    load_weights_file: str  # the SGLang file (relative to the package) defining the load_weights that ran
    stubbed_modules: dict[str, str]  # the worker's stubbed SGLang modules -> reason

    @property
    def written_params(self) -> set[str]:
        return {param for _, param, _ in self.writes}

    @property
    def silently_skipped(self) -> list[str]:
        """Skipped names SGLang logged nothing about."""
        return [name for name in self.skipped if not self.warnings.get(name)]

    def problems(self, exempt_params: dict[str, str] | None = None) -> list[str]:
        """Everything that makes this push incomplete, one line each (empty: every pushed name was written
        into a parameter and every parameter was fully written). ``exempt_params``: parameter -> why it
        needs no push (SGLang computes it), left out of the parameter checks."""
        exempt = exempt_params or {}
        lines = [f"rejected {name}: {error}" for name, error in self.rejected.items()]
        lines += [f"skipped {name}" + (f" (SGLang logged: {'; '.join(self.warnings[name])})"
                                       if self.warnings.get(name) else " silently") for name in self.skipped]
        lines += [f"untouched parameter {p}" for p in self.untouched_params if p not in exempt]
        lines += [f"partly written parameter {p}" for p in self.partial_params if p not in exempt]
        lines += [f"parameter {p} changed by no recorded weight loader" for p in self.unattributed_params]
        return lines


class SGLangModelWorkerError(RuntimeError):
    """The worker process failed (its traceback is the message)."""


def sglang_weight_load_report(
    architecture: str,
    hf_config: Any,
    named_tensors: list[tuple[str, Any]],
    *,
    weight_loader_v2: bool = False,
) -> Report:
    """Build SGLang's ``architecture`` for ``hf_config`` (a transformers config or its dict) on CPU and run
    its real ``load_weights`` on ``named_tensors``; see :class:`Report`. ``weight_loader_v2`` runs it
    under ``SGLANG_ENABLE_WEIGHT_LOADER_V2=1`` (SGLang's AutoWeightsLoader path; default off, as on the
    engines). Raises SGLangNotInstalled without sglang, ValueError for an unknown architecture or a
    tensor holding NaN (NaN marks the unwritten elements)."""
    import torch

    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURES)}")
    config = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    tensors = []
    for name, tensor in named_tensors:
        tensor = torch.as_tensor(tensor).detach().cpu()
        if tensor.is_floating_point() and torch.isnan(tensor).any():
            raise ValueError(f"{name} holds NaN: the report marks unwritten parameter elements with NaN")
        tensors.append((name, tensor))
    buffer = io.BytesIO()
    torch.save({"architecture": architecture, "config": config, "tensors": tensors,
                "weight_loader_v2": weight_loader_v2}, buffer)
    status, payload = _Worker.get().call(buffer.getvalue())
    if status != "ok":
        raise SGLangModelWorkerError(payload)
    return Report(**payload)


# ---------------------------------------------------------------------------------------------------
# The worker process (parent side).
# ---------------------------------------------------------------------------------------------------


class _Worker:
    _instance: _Worker | None = None
    _lock = threading.Lock()
    START_TIMEOUT_S = 180.0
    CALL_TIMEOUT_S = 120.0

    @classmethod
    def get(cls) -> _Worker:
        if not sgl.sglang_available():
            raise sgl.SGLangNotInstalled(sgl.SGLANG_NOT_INSTALLED)
        with cls._lock:
            if cls._instance is None or not cls._instance.process.is_alive():
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="sglang-models")
        self.process.start()
        child.close()
        self.call_lock = threading.Lock()
        if not self.conn.poll(self.START_TIMEOUT_S):
            self.stop()
            raise SGLangModelWorkerError(f"the SGLang model worker did not start in {self.START_TIMEOUT_S} s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            status, payload = "died", f"the SGLang model worker died at start (exit code {self.process.exitcode})"
        if status != "ready":
            self.stop()
            raise SGLangModelWorkerError(payload)

    def call(self, request: bytes) -> tuple[str, Any]:
        with self.call_lock:
            try:
                self.conn.send_bytes(request)
                if not self.conn.poll(self.CALL_TIMEOUT_S):
                    self.stop()
                    raise SGLangModelWorkerError(f"the SGLang model worker gave no answer in {self.CALL_TIMEOUT_S} s")
                return self.conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError) as e:
                raise SGLangModelWorkerError(f"the SGLang model worker died (exit code {self.process.exitcode})") from e

    def stop(self) -> None:
        try:
            self.conn.send_bytes(b"")
        except (OSError, ValueError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        self.conn.close()


def shutdown_worker() -> None:
    """Stop the worker process, if one was started (the next report starts a fresh one)."""
    with _Worker._lock:
        if _Worker._instance is not None:
            _Worker._instance.stop()
            _Worker._instance = None


atexit.register(shutdown_worker)


# ---------------------------------------------------------------------------------------------------
# The worker process (child side).
# ---------------------------------------------------------------------------------------------------


def _worker_main(conn) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # before any SGLang module is loaded: SGLang's CPU engine
    try:
        sgl.extend_module_lists(
            real=MODEL_REAL_MODULES,
            stubbed=MODEL_STUBBED_MODULES,
            standins={name: (MODEL_STANDIN_MODULES[name], _STANDIN_BUILDERS[name]) for name in MODEL_STANDIN_MODULES},
        )
        state = _WorkerState()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv_bytes()
        except EOFError:
            return
        if not request:
            return
        try:
            conn.send(("ok", state.report(request)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


_V2_SWITCH = "SGLANG_ENABLE_WEIGHT_LOADER_V2"  # sglang/srt/environ.py, read by load_weights on each call


@contextlib.contextmanager
def _environ(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


class _SingleRankGroup(types.SimpleNamespace):
    """Stand-in for a GroupCoordinator of one rank (what TP=1/PP=1 construction and loading read)."""


_GROUP_NAMES = ("world_group", "tp_group", "pp_group", "moe_ep_group", "moe_dp_group", "moe_tp_group",
                "attn_tp_group", "attn_cp_group", "shared_experts_tp_group", "dcp_group")


class _WorkerState:
    def __init__(self):
        import torch

        self.torch = torch
        self.rc = sgl.runtime_context()
        self.weight_utils = sgl.load_module("sglang.srt.model_loader.weight_utils")
        for module_name in ARCHITECTURES.values():
            sgl.load_module(module_name)
        with sgl.sglang_imports():
            server_args = sgl.load_module("sglang.srt.server_args").ServerArgs(model_path="dummy")
            self.context = self.rc.create_context(server_args, role="scheduler",
                                                  ranks=self.rc.SpawnRanks(world_rank=0))
        self.groups = {
            name: _SingleRankGroup(name=name, world_size=1, rank_in_group=0, ranks=[0], is_first_rank=True,
                                   is_last_rank=True)
            for name in _GROUP_NAMES
        }

    def model_class(self, architecture: str):
        module = sgl.load_module(ARCHITECTURES[architecture])
        entries = module.EntryClass if isinstance(module.EntryClass, list) else [module.EntryClass]
        matches = [cls for cls in entries if cls.__name__ == architecture]
        if not matches:
            raise LookupError(f"{architecture} is not in {module.__name__}.EntryClass")
        return matches[0]

    def report(self, request: bytes) -> dict:
        import transformers

        torch = self.torch
        req = torch.load(io.BytesIO(request), weights_only=False)
        architecture = req["architecture"]
        config = transformers.AutoConfig.for_model(**req["config"])
        tensors = [(name, tensor.clone()) for name, tensor in req["tensors"]]  # distinct storage each
        name_of = {id(t): name for name, t in tensors}
        cls = self.model_class(architecture)
        rc = self.rc

        writes: list[tuple[str, str, Any]] = []
        rejected: dict[str, str] = {}
        warnings: dict[str, list[str]] = {}
        current = {"name": None, "index": 0}

        class Collect(logging.Handler):
            def emit(self, record):
                if record.levelno >= logging.WARNING:
                    warnings.setdefault(current["name"] or "", []).append(record.getMessage())

        handler = Collect()
        sglang_logger = logging.getLogger("sglang")
        with sgl.sglang_imports(), rc.use_context(self.context), self.context.parallel.override(**self.groups), \
                _environ(_V2_SWITCH, "1" if req["weight_loader_v2"] else "0"):
            model = cls(config)
            params = dict(model.named_parameters())
            with torch.no_grad():
                for param in params.values():
                    param.data.fill_(float("nan"))
            for param_name, param in params.items():
                loader = getattr(param, "weight_loader", self.weight_utils.default_weight_loader)

                def recording(p, loaded_weight, *args, _loader=loader, _param=param_name, **kwargs):
                    hf_name = name_of.get(id(loaded_weight), current["name"])
                    shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
                    writes.append((hf_name, _param, shard))
                    return _loader(p, loaded_weight, *args, **kwargs)

                param.weight_loader = recording

            remaining = tensors
            sglang_logger.addHandler(handler)
            try:
                while remaining:
                    def feed(items=remaining):
                        for i, (name, tensor) in enumerate(items):
                            current["name"], current["index"] = name, i + 1
                            yield name, tensor

                    current["name"], current["index"] = None, 0
                    try:
                        model.load_weights(feed())
                    except Exception as e:  # the engine reports this push as failed
                        if current["name"] is None:
                            raise
                        rejected[current["name"]] = f"{type(e).__name__}: {e}"
                        remaining = remaining[current["index"]:]
                        continue
                    break
            finally:
                sglang_logger.removeHandler(handler)

        untouched, partial = [], []
        for param_name, param in params.items():
            nan = torch.isnan(param.data)
            if bool(nan.all()):
                untouched.append(param_name)
            elif bool(nan.any()):
                partial.append(param_name)
        written = {param for _, param, _ in writes}
        loaded: dict[str, tuple[str, Any]] = {}
        for hf_name, param, shard in writes:
            loaded.setdefault(hf_name, (param, shard))
        fn = getattr(cls.load_weights, "__func__", cls.load_weights)
        return {
            "architecture": architecture,
            "loaded": loaded,
            "writes": writes,
            "skipped": [name for name, _ in tensors if name not in loaded and name not in rejected],
            "rejected": rejected,
            "warnings": warnings,
            "params": {name: tuple(p.shape) for name, p in params.items()},
            "untouched_params": untouched,
            "partial_params": partial,
            "unattributed_params": [p for p in params if p not in written and p not in untouched],
            "load_weights_file": os.path.relpath(fn.__code__.co_filename, sgl.sglang_root()),
            "stubbed_modules": sgl.stubbed_modules(),
        }
