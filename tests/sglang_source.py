"""SGLang's own code, loaded from the installed ``sglang`` package on a CPU-only machine.

Tests use this to run SGLang's real parsers, validators and control logic on the messages this
project sends, instead of re-implementations that could drift from the server. ``sglang`` is
installed here with ``pip install --no-deps`` (source only): a plain ``import sglang`` runs
``sglang/__init__.py``, which pulls CUDA kernels, the frontend language and model-config code, so it
fails on CPU. This module therefore never imports the ``sglang`` package itself.

API (every object handed out is SGLang's own, loaded from its file)
-------------------------------------------------------------------
* :func:`sglang_available`, :func:`sglang_root`: is the source installed / where (tests skip without).
* :func:`sglang_imports`: context in which SGLang modules are importable by name (isolation below).
* :func:`load_module`, :func:`stubbed_modules`, :func:`compile_definitions`: the machinery;
  :func:`extend_module_lists`: more decisions for a process of its own (tests/sglang_models.py).
* :func:`generate_contract_error` (+ :func:`api_types`): the /generate JSON contract check.
* ``SamplingParams`` (module attribute), :func:`sampling_params_module`,
  :func:`validate_sampling_params`: the tokenizer manager's construct/normalize/verify sequence.
* :func:`io_struct`, :func:`parse_http_body`, :class:`HttpBodyRejected`: request structs and the
  FastAPI body parse the server runs.
* :func:`scheduler_weight_updater_module`, :func:`model_runner_weight_updater_module`,
  :func:`tp_worker_methods`, :func:`init_custom_process_group`, :func:`runtime_context`: the weight
  update path below the HTTP server.
* :func:`tokenizer_manager_methods`, :func:`make_tokenizer_manager_shell`: the tokenizer manager's
  pause/continue/weight-update control logic on a fake ``self``.
* :func:`parse_sglang_server_argv`, :func:`parse_router_argv`: the two launchers' argv parsing.

How it works
------------
A ``sys.meta_path`` finder (``_SGLangFinder``) answers every ``sglang`` / ``sglang.*`` import while a
:func:`sglang_imports` block is active. Stand-ins first; otherwise the most specific pattern of
``STUBBED_MODULES`` / ``REAL_MODULES`` that matches the name decides (an exact name beats a subtree):

1. ``STANDIN_MODULES``: a module built from *selected definitions* of the real file (extracted with
   ``ast`` and compiled with the real file name, so tracebacks point into SGLang), where importing the
   whole file is hopeless but a placeholder would change behaviour.
2. ``STUBBED_MODULES``: an empty package-like module whose every attribute is a placeholder class
   (calling it raises). Only for modules that cannot be imported on CPU or are irrelevant here; the
   reason for each is written next to it.
3. ``REAL_MODULES``: the real ``.py`` file from the installed package directory (found with
   ``importlib.util.find_spec("sglang")``, which locates the package without importing it). Package
   directories become packages: their ``__init__.py`` runs, except for ``HOLLOW_PACKAGES`` (and
   directories without one, i.e. namespace packages), which get the real ``__path__`` and no code.
4. Anything else becomes a stub too, recorded in :func:`stubbed_modules` with reason ``"unlisted"``;
   ``tests/test_sglang_source.py`` fails if that ever happens, so every stub is a documented choice.

Isolation (why the modules never leak into other tests)
--------------------------------------------------------
SGLang's code imports itself by absolute name (``from sglang.srt.utils import ...``), so it has to be
loaded under its real module names; a private prefix would need source rewriting. Instead every load
and every call that may import lazily runs inside :func:`sglang_imports`, which

* takes the ``sglang`` / ``sglang.*`` entries out of ``sys.modules`` (there are none normally),
* puts this process's cache of loaded SGLang modules in, and installs the finder first on
  ``sys.meta_path``,
* on exit moves every ``sglang*`` entry back into the cache, removes the finder, and puts back exactly
  the entries it took out.

So outside the block ``sys.modules`` holds no ``sglang*`` key that was not there before, whatever
pytest does between tests, and the loaded modules survive in the per-process cache (module-scoped
fixtures pay the ~2 s load once). Third-party modules that SGLang imports (torch, zmq, fastapi, ...)
stay imported: they are the real packages, and unloading torch is not possible anyway. The objects
handed out (classes, functions) keep working outside the block because their globals were bound at
load time; wrap a call in ``with sglang_imports():`` only where SGLang code imports lazily inside a
function (e.g. ``ServerArgs`` attribute re-exports; :func:`parse_sglang_server_argv` does this
itself; so do WeightUpdater.load_weights_* (``sglang.kernels.ops.gemm.bf16_fp32``) and
``get_context().override_server_args()``). Objects of SGLang classes pickle by module name, so pickle
them (e.g. through a multiprocessing queue) only inside a block. The one process-wide side effect of
SGLang's import-time code, ``setattr(triton, "next_power_of_2", ...)`` in srt/utils/common.py, is also
confined to the blocks (``_PATCHED_ATTRIBUTES``).

Third-party packages the loaded code needs: torch, numpy, msgspec, pydantic, fastapi (+starlette),
pyzmq, psutil, orjson, pybase64, requests, pillow, packaging, triton, ipython, tqdm (``sglang/utils.py``
imports IPython.display and tqdm), and httpx for :func:`parse_http_body` (starlette's TestClient).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dis
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import python_ast

__all__ = [
    "HOLLOW_PACKAGES",
    "REAL_MODULES",
    "STANDIN_MODULES",
    "STUBBED_MODULES",
    "HttpBodyRejected",
    "SGLangNotInstalled",
    "api_types",
    "compile_definitions",
    "extend_module_lists",
    "generate_contract_error",
    "init_custom_process_group",
    "io_struct",
    "load_module",
    "make_tokenizer_manager_shell",
    "model_runner_weight_updater_module",
    "parse_http_body",
    "parse_router_argv",
    "parse_sglang_server_argv",
    "runtime_context",
    "sampling_params_module",
    "scheduler_weight_updater_module",
    "sglang_available",
    "sglang_imports",
    "sglang_root",
    "stubbed_modules",
    "tp_worker_methods",
    "tokenizer_manager_methods",
    "validate_sampling_params",
]

# ---------------------------------------------------------------------------------------------------
# The one place that says what is real and what is not.
# Patterns: "a.b" is that module; "a.b.*" is a.b and everything below it. The most specific matching
# pattern decides (an exact name beats a subtree, a deeper subtree a shallower one; on a tie the stub
# wins), so a real subtree can have a stubbed leaf and a stubbed subtree a real leaf. Stand-ins first.
# ---------------------------------------------------------------------------------------------------

REAL_MODULES: tuple[str, ...] = (
    # --- what tests call (items 1-8 of the brief) ---
    "sglang.api.v1.api_types",  # the /generate JSON contract (msgspec only)
    "sglang.srt.entrypoints.api_contract",  # generate_contract_error
    "sglang.srt.sampling.*",  # SamplingParams (+ watermarking config it validates), sampling_mask
    "sglang.srt.managers.io_struct",  # request/response structs
    "sglang.srt.managers.communicator",  # FanOutCommunicator.merge_results used by the control mixin
    "sglang.srt.managers.tokenizer_control_mixin",  # begin/end/update_weights_* control logic
    "sglang.srt.managers.load_snapshot",  # imported by tokenizer_control_mixin (zmq/mmap helpers)
    "sglang.srt.managers.embed_types",  # io_struct field types
    "sglang.srt.managers.kv_hints",  # io_struct field types
    "sglang.srt.managers.scheduler_components",  # package of ...
    "sglang.srt.managers.scheduler_components.weight_updater",  # SchedulerWeightUpdaterManager
    "sglang.srt.model_executor",  # namespace package of ...
    "sglang.srt.model_executor.model_runner_components",  # package of ...
    "sglang.srt.model_executor.model_runner_components.weight_updater",  # model-runner WeightUpdater
    "sglang.srt.weight_sync.tensor_bucket",  # FlattenedTensorBucket
    "sglang.srt.server_args",  # ServerArgs, prepare_server_args
    "sglang.srt.utils.*",  # common.py (init_custom_process_group, ...), network, aio_rwlock, msgspec_utils
    "sglang.srt.multimodal.modality",  # Modality enum (io_struct field type)
    # --- what those import, all loadable on CPU ---
    "sglang",  # hollow: see HOLLOW_PACKAGES
    "sglang.api",
    "sglang.api.v1",
    "sglang.srt",
    "sglang.srt.entrypoints",
    "sglang.srt.managers",
    "sglang.srt.weight_sync",
    "sglang.utils",  # TypeBasedDispatcher (tokenizer_control_mixin)
    "sglang.srt.environ",  # envs registry read by almost everything
    "sglang.srt.constants",
    "sglang.srt.runtime_context",  # get_parallel()/get_model() bags read by the control code
    "sglang.srt.arg_groups.*",  # ServerArgs field declarations, CLI registration, overrides
    "sglang.srt.platforms.*",  # current_platform (resolves to the CPU platform here)
    "sglang.srt.plugins.*",
    "sglang.srt.hardware_backend",
    "sglang.srt.hardware_backend.mlx",
    "sglang.srt.hardware_backend.mlx.runtime",  # use_mlx() (server_args)
    "sglang.srt.hardware_backend.mps",
    "sglang.srt.hardware_backend.mps.runtime",  # MPS validation hooks (server_args)
    "sglang.srt.observability",
    "sglang.srt.observability.func_timer",
    "sglang.srt.observability.utils",
    "sglang.srt.lora",
    "sglang.srt.lora.lora_registry",  # LoRARef: a placeholder breaks msgspec Union[str, LoRARef]
    "sglang.srt.beam_search.*",  # BeamSearchSequence (io_struct)
    "sglang.srt.multimodal",
    "sglang.srt.multimodal.mm_utils",  # has_valid_data (GenerateReqInput.normalize)
    "sglang.srt.multimodal.transport.*",  # cuda_ipc transport types named by io_struct/msgpack utils
    "sglang.srt.distributed",  # package __init__ re-exports parallel_state (CPU-importable)
    "sglang.srt.distributed.communication_op",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.distributed.utils",
    "sglang.srt.distributed.device_communicators",
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine",  # server_args choices
    "sglang.srt.compilation",
    "sglang.srt.compilation.compilation_config",
    "sglang.srt.model_executor.cuda_graph_config",  # server_args field types
    "sglang.srt.model_executor.runner_backend_utils.*",  # piecewise-graph context (imported, unused)
    "sglang.srt.speculative",
    "sglang.srt.speculative.decoupled_spec_io",  # server_args
    "sglang.srt.speculative.spec_info",  # SpeculativeAlgorithm (config bags, resolution)
    "sglang.srt.speculative.spec_registry",  # imported by spec_info
    "sglang.kernels.*",  # the kernel registry imported by utils/custom_op.py; no kernel runs
    "sglang.srt.parser",
    "sglang.srt.parser.reasoning_parser_names",  # --reasoning-parser choices (lazy, add_cli_args)
    "sglang.srt.function_call",
    "sglang.srt.function_call.parser_names",  # --tool-call-parser choices (lazy, add_cli_args)
    "sglang.srt.connector.*",  # ConnectorType (server_args resolution hooks)
    "sglang.srt.configs",  # hollow: see HOLLOW_PACKAGES
    "sglang.srt.configs.load_config",  # LoadConfig (model-runner weight_updater)
    "sglang.srt.configs.modelopt_config",  # imported by load_config
    "sglang.srt.configs.shared_experts",  # a derived config leaf computed when config bags are published
)

STUBBED_MODULES: dict[str, str] = {
    "sglang.srt.configs.*": (
        "model configs: the package __init__ imports every model's config, some need torchvision "
        "(not installable here: it pulls another torch). model_config.py/hybrid_arch.py are imported "
        "by ServerArgs resolution hooks and only called on a real model path; the few light leaves "
        "that are used are listed in REAL_MODULES."
    ),
    "sglang.srt.model_loader.*": (
        "model loading (DefaultModelLoader, get_model_loader, weight_utils): pulls sglang.srt.layers "
        "(CUDA/tvm_ffi kernels). The model-runner WeightUpdater uses it only in update_weights_from_disk, "
        "begin_weight_update/end_weight_update (restore/post-process a real model's weights) and "
        "update_weights_from_tensor(load_format='direct'); init/destroy_weights_update_group, "
        "receive_weights_from_distributed and load_weights_from_distributed do not touch it."
    ),
    "sglang.srt.disaggregation.*": (
        "PD disaggregation: disaggregation/utils.py imports model configs and the distributed "
        "communicators (tvm_ffi). Only DisaggregationMode is named, in the memory-release branches "
        "of SchedulerWeightUpdaterManager, which tests do not run."
    ),
    "sglang.srt.utils.weight_checker": (
        "checksum utility: imports managers/mm_utils -> forward_batch_info -> the model executor. "
        "Only overall_checksum is named, by SchedulerWeightUpdaterManager.check_weights (not run)."
    ),
}

STANDIN_MODULES: dict[str, str] = {
    "sglang.srt.managers.schedule_batch": (
        "The scheduler's batch module imports the memory pools, attention backends and "
        "CUDA graph runners. io_struct needs five of its names; a placeholder would change how "
        "pydantic/msgspec parse GenerateReqInput.return_hidden_states and sampling_logprobs_mode. "
        "The stand-in holds the real definitions of ReturnHiddenStatesMode, SamplingLogprobsMode and "
        "get_return_hidden_states_mode (compiled from schedule_batch.py), CaptureHiddenMode "
        "(compiled from model_executor/forward_batch_info.py), the real Modality, and a placeholder "
        "for MultimodalProcessorOutput (typed field of the internal Tokenized* requests only)."
    ),
}

HOLLOW_PACKAGES: dict[str, str] = {
    "sglang": (
        "sglang/__init__.py imports the frontend language, HF patches and the Engine; the package "
        "gets its real __path__ so submodules resolve, and no code runs."
    ),
    "sglang.srt.configs": "its __init__ imports every model's config (torchvision, ...); see STUBBED_MODULES.",
}


SGLANG_NOT_INSTALLED = ("sglang's source is not installed (tools/bootstrap.sh test installs it: "
                        "pip install --no-deps sglang==0.5.23)")  # the tests' skip reason


class SGLangNotInstalled(ImportError):
    """``sglang`` is not installed (tests should skip)."""


class HttpBodyRejected(ValueError):
    """The SGLang HTTP server would refuse this JSON body with a 4xx status."""

    def __init__(self, status_code: int, detail: Any):
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


# ---------------------------------------------------------------------------------------------------
# Locating the installed package without importing it.
# ---------------------------------------------------------------------------------------------------


@functools.cache
def sglang_root() -> str | None:
    """The installed ``sglang`` package directory, or None; found without importing ``sglang``."""
    spec = importlib.util.find_spec("sglang")  # a top-level name: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def sglang_available() -> bool:
    """Whether the sglang source is installed (tests skip otherwise)."""
    return sglang_root() is not None


def _require_root() -> str:
    root = sglang_root()
    if root is None:
        raise SGLangNotInstalled(SGLANG_NOT_INSTALLED)
    return root


def _source_path(module_name: str) -> str:
    """The real file of ``module_name`` (a .py module or a package's __init__.py)."""
    base = os.path.join(_require_root(), *module_name.split(".")[1:])
    return base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__init__.py")


def _specificity(pattern: str) -> tuple[int, int]:
    """Exact names beat subtrees; a deeper subtree beats a shallower one."""
    return (0, len(pattern)) if pattern.endswith(".*") else (1, len(pattern))


def _matches(name: str, patterns) -> str | None:
    """The most specific pattern in ``patterns`` matching module ``name``, or None."""
    hits = [
        p for p in patterns if name == p or (p.endswith(".*") and (name == p[:-2] or name.startswith(p[:-1])))
    ]
    return max(hits, key=_specificity) if hits else None


def _is_sglang_name(name: str) -> bool:
    return name == "sglang" or name.startswith("sglang.")


# ---------------------------------------------------------------------------------------------------
# Stubs.
# ---------------------------------------------------------------------------------------------------


def _stub_message(name: str) -> str:
    return f"{name} is a stub: its module is not loaded on CPU by tests/sglang_source.py (see STUBBED_MODULES)"


class _PlaceholderMeta(type):
    """Makes any use of a placeholder beyond naming it fail with a message that says it is a stub."""

    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(_stub_message(f"{cls._sglang_stub_name}.{name}"))

    def __iter__(cls):
        raise TypeError(_stub_message(cls._sglang_stub_name))

    def __len__(cls):
        raise TypeError(_stub_message(cls._sglang_stub_name))


class _Placeholder(metaclass=_PlaceholderMeta):
    """A name taken from a stubbed SGLang module. Usable in annotations, isinstance, subclassing;
    calling it, iterating it or reading its attributes raises, so an accidental use is loud."""

    _sglang_stub_name = "?"

    def __init__(self, *args, **kwargs):
        raise RuntimeError(_stub_message(self._sglang_stub_name))


class _StubModule(types.ModuleType):
    """Package-like empty module: every attribute is a placeholder class made on first access."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        qualname = f"{self.__name__}.{name}"
        placeholder = type(name, (_Placeholder,), {"__module__": self.__name__, "_sglang_stub_name": qualname})
        setattr(self, name, placeholder)
        return placeholder


_STUBBED: dict[str, str] = {}  # module name -> reason (the matching STUBBED_MODULES pattern or "unlisted")


def stubbed_modules() -> dict[str, str]:
    """Every SGLang module this process was given as a stub, with the reason (pattern or 'unlisted')."""
    return dict(_STUBBED)


class _StubLoader(importlib.abc.Loader):
    def __init__(self, reason: str):
        self.reason = reason

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []  # package-like: any submodule import reaches the finder again
        module.__all__ = []
        module.__sglang_stub__ = self.reason
        _STUBBED[module.__name__] = self.reason


class _HollowPackageLoader(importlib.abc.Loader):
    """A real package directory whose ``__init__.py`` is not run (or that has none)."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


class _StandinLoader(importlib.abc.Loader):
    def __init__(self, builder: Callable[[types.ModuleType], None]):
        self.builder = builder

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.builder(module)


# ---------------------------------------------------------------------------------------------------
# Compiling selected definitions of a real file (ast), for stand-ins and the TokenizerManager methods.
# ---------------------------------------------------------------------------------------------------


def _global_names(code: types.CodeType) -> set[str]:
    names = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names.add(ins.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def compile_definitions(
    path: str,
    names: list[str],
    namespace: dict[str, Any],
    *,
    class_name: str | None = None,
) -> dict[str, Any]:
    """Compile the top-level definitions ``names`` of the real file ``path`` (or, with ``class_name``,
    those methods of that class) into ``namespace`` and return them.

    The nodes are taken verbatim from ``ast.parse`` of the file and compiled with the file's own name
    and line numbers (and its ``from __future__ import annotations``, if any), so the result is
    SGLang's code. Raises if a name is missing or if the compiled code reads a global that neither
    ``namespace`` nor builtins provides (so a stand-in cannot silently miss a dependency).
    """
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = python_ast.parse(source, filename=path)
    body = tree.body
    if class_name is not None:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == class_name]
        if not classes:
            raise LookupError(f"class {class_name} not found in {path}")
        body = classes[0].body

    def defined(node) -> set[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        if isinstance(node, ast.Assign):
            return {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return {node.target.id}
        return set()

    picked = [node for node in body if defined(node) & set(names)]
    missing = set(names) - set().union(*(defined(n) for n in picked))
    if missing:
        raise LookupError(f"{sorted(missing)} not defined in {path}" + (f" class {class_name}" if class_name else ""))
    flags = 0
    if any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    ):
        flags |= importlib.import_module("__future__").annotations.compiler_flag
    code = compile(ast.Module(body=picked, type_ignores=[]), path, "exec", flags=flags, dont_inherit=True)
    unresolved = {n for n in _global_names(code) if n not in namespace and not hasattr(builtins, n)}
    unresolved -= set(names)
    if unresolved:
        raise NameError(f"definitions {names} of {path} read globals not provided: {sorted(unresolved)}")
    exec(code, namespace)
    compiled = {n: namespace[n] for n in names}
    if class_name is not None:
        for fn in compiled.values():
            if isinstance(fn, types.FunctionType):
                fn.__qualname__ = f"{class_name}.{fn.__name__}"
    return compiled


def _build_schedule_batch_standin(module: types.ModuleType) -> None:
    """See STANDIN_MODULES['sglang.srt.managers.schedule_batch']."""
    import enum
    import typing
    from functools import total_ordering

    ns = module.__dict__
    ns.update(
        {
            "Union": typing.Union,
            "Literal": typing.Literal,
            "Optional": typing.Optional,
            "IntEnum": enum.IntEnum,
            "total_ordering": total_ordering,
            "Modality": importlib.import_module("sglang.srt.multimodal.modality").Modality,
        }
    )
    compile_definitions(_source_path("sglang.srt.model_executor.forward_batch_info"), ["CaptureHiddenMode"], ns)
    compile_definitions(
        _source_path("sglang.srt.managers.schedule_batch"),
        ["ReturnHiddenStatesMode", "SamplingLogprobsMode", "get_return_hidden_states_mode"],
        ns,
    )
    ns["MultimodalProcessorOutput"] = type(
        "MultimodalProcessorOutput",
        (_Placeholder,),
        {"__module__": module.__name__, "_sglang_stub_name": f"{module.__name__}.MultimodalProcessorOutput"},
    )
    module.__sglang_standin__ = STANDIN_MODULES[module.__name__]
    # Every other attribute: a placeholder, as for stubs.
    module.__class__ = _StubModule


_STANDIN_BUILDERS: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.managers.schedule_batch": _build_schedule_batch_standin,
}


# ---------------------------------------------------------------------------------------------------
# The finder and the isolation context.
# ---------------------------------------------------------------------------------------------------


class _SGLangFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not _is_sglang_name(fullname):
            return None
        if fullname in _STANDIN_BUILDERS:
            return importlib.machinery.ModuleSpec(
                fullname, _StandinLoader(_STANDIN_BUILDERS[fullname]), origin=_source_path(fullname)
            )
        stub = _matches(fullname, STUBBED_MODULES)
        real = _matches(fullname, REAL_MODULES)
        if real is not None and (stub is None or _specificity(real) > _specificity(stub)):
            spec = self._real_spec(fullname)
            if spec is not None:
                return spec
        reason = stub or "unlisted"
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(reason), is_package=True)

    @staticmethod
    def _real_spec(fullname: str):
        base = os.path.join(_require_root(), *fullname.split(".")[1:])
        if os.path.isdir(base):
            init = os.path.join(base, "__init__.py")
            if fullname in HOLLOW_PACKAGES or not os.path.isfile(init):
                spec = importlib.machinery.ModuleSpec(fullname, _HollowPackageLoader(), is_package=True)
                spec.submodule_search_locations = [base]
                return spec
            return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[base])
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(fullname, base + ".py")
        return None


_LOCK = threading.RLock()
_CACHE: dict[str, types.ModuleType] = {}  # every sglang* module this process loaded (real, stub, stand-in)
_DEPTH = 0


@contextlib.contextmanager
def sglang_imports() -> Iterator[None]:
    """Make this process's SGLang modules importable by their real names for the block; see the module
    docstring. Re-entrant. On exit ``sys.modules`` has exactly the ``sglang*`` entries it had before."""
    global _DEPTH
    _require_root()
    with _LOCK:
        if _DEPTH:
            _DEPTH += 1
            try:
                yield
            finally:
                _DEPTH -= 1
            return
        patched = _apply_sglang_patches()
        saved = {k: v for k, v in sys.modules.items() if _is_sglang_name(k)}
        for k in saved:
            del sys.modules[k]
        sys.modules.update(_CACHE)
        finder = _SGLangFinder()
        sys.meta_path.insert(0, finder)
        _DEPTH = 1
        try:
            yield
        finally:
            _DEPTH = 0
            sys.meta_path.remove(finder)
            for k in [k for k in sys.modules if _is_sglang_name(k)]:
                _CACHE[k] = sys.modules.pop(k)
            sys.modules.update(saved)
            _undo_sglang_patches(patched)


# Attributes of third-party modules that SGLang's import-time code replaces. They carry SGLang's value
# inside sglang_imports() blocks only: sglang/srt/utils/common.py does
# ``setattr(triton, "next_power_of_2", next_power_of_2)``, replacing triton's constexpr function with a
# plain Python one, which would break triton kernels elsewhere in the test process.
_PATCHED_ATTRIBUTES: tuple[tuple[str, str], ...] = (("triton", "next_power_of_2"),)
_SGLANG_PATCH_VALUES: dict[tuple[str, str], Any] = {}
_MISSING = object()


def _apply_sglang_patches() -> dict[tuple[str, str], Any]:
    """Remember the current values (importing the module if needed) and put SGLang's values back."""
    originals = {}
    for module_name, attr in _PATCHED_ATTRIBUTES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        originals[(module_name, attr)] = module.__dict__.get(attr, _MISSING)
        if (module_name, attr) in _SGLANG_PATCH_VALUES:
            setattr(module, attr, _SGLANG_PATCH_VALUES[(module_name, attr)])
    return originals


def _undo_sglang_patches(originals: dict[tuple[str, str], Any]) -> None:
    for (module_name, attr), original in originals.items():
        module = sys.modules[module_name]
        current = module.__dict__.get(attr, _MISSING)
        if current is not original:
            _SGLANG_PATCH_VALUES[(module_name, attr)] = current
            if original is _MISSING:
                delattr(module, attr)
            else:
                setattr(module, attr, original)


def extend_module_lists(
    *,
    real: tuple[str, ...] = (),
    stubbed: dict[str, str] | None = None,
    standins: dict[str, tuple[str, Callable[[types.ModuleType], None]]] | None = None,
) -> None:
    """Add decisions to ``REAL_MODULES`` / ``STUBBED_MODULES`` / ``STANDIN_MODULES`` (name -> (reason,
    builder)) for THIS process, before it has loaded any SGLang module.

    A module has one identity per process (this module's cache), so a different set of decisions needs a
    process of its own: tests/sglang_models.py's worker builds SGLang's real model classes, which needs
    ``sglang.srt.layers`` and ``model_loader/weight_utils.py`` real, while the model-runner WeightUpdater
    loaded here in the test process sees weight_utils as a stub. Same precedence rules as the lists
    above; every added stub carries its reason. Raises RuntimeError once an SGLang module is loaded."""
    global REAL_MODULES
    with _LOCK:
        if _CACHE or _DEPTH:
            raise RuntimeError("extend_module_lists: SGLang modules are already loaded in this process")
        REAL_MODULES = REAL_MODULES + tuple(real)
        STUBBED_MODULES.update(stubbed or {})
        for name, (reason, builder) in (standins or {}).items():
            STANDIN_MODULES[name] = reason
            _STANDIN_BUILDERS[name] = builder


def load_module(name: str) -> types.ModuleType:
    """Import the SGLang module ``name`` (real, stand-in or stub per the lists above), cached per process."""
    with sglang_imports():
        return importlib.import_module(name)


# ---------------------------------------------------------------------------------------------------
# 1. /generate contract.
# ---------------------------------------------------------------------------------------------------


def api_types() -> types.ModuleType:
    """``sglang/api/v1/api_types.py`` (GenerateRequest, JsonContractError)."""
    return load_module("sglang.api.v1.api_types")


def generate_contract_error(body: Any) -> str | None:
    """SGLang's ``generate_contract_error`` (srt/entrypoints/api_contract.py): the schema's error text
    for a parsed ``/generate`` JSON body, or None. The server answers 400 ``{"error": text}``."""
    return load_module("sglang.srt.entrypoints.api_contract").generate_contract_error(body)


# ---------------------------------------------------------------------------------------------------
# 2. Sampling parameters.
# ---------------------------------------------------------------------------------------------------


def sampling_params_module() -> types.ModuleType:
    """``sglang/srt/sampling/sampling_params.py``."""
    return load_module("sglang.srt.sampling.sampling_params")


def __getattr__(name: str):
    # ``SamplingParams`` as a module attribute, loaded on first use (keeps ``import sglang_source`` cheap).
    if name == "SamplingParams":
        return sampling_params_module().SamplingParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def validate_sampling_params(sampling_params: dict | None, *, vocab_size: int, tokenizer: Any = None):
    """Build and check ``sampling_params`` exactly as the tokenizer manager does for each request
    (srt/managers/tokenizer_manager.py ``_create_tokenized_object``)::

        sampling_params = SamplingParams(**sampling_kwargs)
        sampling_params.normalize(self.tokenizer)
        sampling_params.verify(self.model_config.vocab_size)

    ``self.tokenizer`` is the HF tokenizer (``get_tokenizer(...)``), or None when the server runs with
    ``--skip-tokenizer-init``; normalize() only calls ``tokenizer.encode(stop_str,
    add_special_tokens=False)`` for stop strings. With ``tokenizer=None`` (the default here) stop
    strings, stop_regex and min_new_tokens > 0 are refused (as by a --skip-tokenizer-init server).
    (``preferred_sampling_params`` merging and the watermark check that follow are not applied.)
    Returns the normalized SamplingParams; raises SGLang's TypeError/ValueError otherwise.
    """
    sp = sampling_params_module().SamplingParams(**(sampling_params or {}))
    sp.normalize(tokenizer)
    sp.verify(vocab_size)
    return sp


# ---------------------------------------------------------------------------------------------------
# 3. io_struct and the HTTP body parse.
# ---------------------------------------------------------------------------------------------------


def io_struct() -> types.ModuleType:
    """``sglang/srt/managers/io_struct.py`` (GenerateReqInput, UpdateWeightFromDiskReqInput, ...)."""
    return load_module("sglang.srt.managers.io_struct")


@functools.cache
def _http_client(cls: type, plain_annotation: bool):
    """A one-route FastAPI app declaring ``obj`` the way sglang/srt/entrypoints/http_server.py does,
    with SGLang's own pydantic core schema (BaseReq.__get_pydantic_core_schema__ ->
    utils/msgspec_utils.py msgspec_struct_pydantic_core_schema), driven through starlette's
    TestClient."""
    from typing import Annotated

    from fastapi import Body, FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    received: dict[str, Any] = {}
    if plain_annotation:  # e.g. ``async def generate_request(obj: GenerateReqInput, request: Request)``

        async def endpoint(obj: cls):  # type: ignore[valid-type]
            received["obj"] = obj
            return {}

    else:  # ``obj: Annotated[Cls, Body()]``, every other native endpoint

        async def endpoint(obj: Annotated[cls, Body()]):  # type: ignore[valid-type]
            received["obj"] = obj
            return {}

    endpoint.__annotations__ = {"obj": cls if plain_annotation else Annotated[cls, Body()]}
    app.post("/endpoint")(endpoint)
    return TestClient(app, raise_server_exceptions=True), received


# sglang/srt/entrypoints/http_server.py declares these without Body() (FastAPI still reads the body).
_PLAIN_ANNOTATION_ROUTES = {"GenerateReqInput", "EmbeddingReqInput"}


def parse_http_body(cls: type, body: Any) -> Any:
    """Parse the JSON ``body`` into ``cls`` exactly as SGLang's FastAPI server does: a real FastAPI
    route with the same parameter declaration receives ``body`` as JSON, so FastAPI runs pydantic on
    SGLang's own core schema, whose validator then calls ``cls(**fields)`` (msgspec __post_init__
    included). Returns the struct; raises :class:`HttpBodyRejected` (status, FastAPI's error list) for
    a body the server refuses with 4xx (SGLang's handler turns FastAPI's 422 into 400).

    The real path (FastAPI 0.165 here): ``await request.json()``, then
    ``TypeAdapter(Annotated[cls, Body()]).validate_python(body, from_attributes=True)`` (lax mode) on
    the schema ``json_or_python_schema(python=union[is_instance(cls), typed_dict(fields,
    extra_behavior="ignore") -> cls(**fields)])``: unknown keys are dropped, missing required fields
    and wrong types are refused, lax coercions apply ("29500" -> 29500). ``body=None`` sends no body,
    which a required ``Body()`` refuses ("Field required"). Not every route takes a body: /flush_cache
    reads only a ``timeout`` query parameter, so FlushCacheReqInput is never parsed from HTTP. For
    GenerateReqInput the route's next step runs too: ``generate_request`` answers 400 with
    :func:`generate_contract_error`'s text (e.g. a misspelt sampling_params key) before serving.
    """
    with sglang_imports():  # schema building may import lazily
        client, received = _http_client(cls, cls.__name__ in _PLAIN_ANNOTATION_ROUTES)
        received.clear()
        response = client.post("/endpoint", json=body)
    if response.status_code >= 400:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise HttpBodyRejected(400 if response.status_code == 422 else response.status_code, detail)
    if cls.__name__ == "GenerateReqInput":  # /generate then checks the body against the API contract
        contract_error = generate_contract_error(body)
        if contract_error is not None:
            raise HttpBodyRejected(400, contract_error)
    return received["obj"]


# ---------------------------------------------------------------------------------------------------
# 4-6. Weight updaters, tensor bucket, RWLock, process groups.
# ---------------------------------------------------------------------------------------------------


def scheduler_weight_updater_module() -> types.ModuleType:
    """``sglang/srt/managers/scheduler_components/weight_updater.py`` (SchedulerWeightUpdaterManager)."""
    return load_module("sglang.srt.managers.scheduler_components.weight_updater")


def model_runner_weight_updater_module() -> types.ModuleType:
    """``sglang/srt/model_executor/model_runner_components/weight_updater.py`` (WeightUpdater)."""
    return load_module("sglang.srt.model_executor.model_runner_components.weight_updater")


def init_custom_process_group(**kwargs):
    """SGLang's ``init_custom_process_group`` (defined in srt/utils/common.py, re-exported by
    sglang.srt.utils), loaded with the real common.py."""
    return load_module("sglang.srt.utils.common").init_custom_process_group(**kwargs)


def tp_worker_methods() -> dict[str, Callable]:
    """The tensor-parallel worker's weight-update plumbing between SchedulerWeightUpdaterManager and the
    model-runner WeightUpdater, compiled with ``ast`` from ``sglang/srt/managers/tp_worker.py`` (the
    module itself imports the whole model runner): ``BaseTpWorker.init_weights_update_group`` and
    ``destroy_weights_update_group`` (unpack the request into WeightUpdater's arguments) and
    ``TpModelWorker.weight_update_runners`` (``[("target", self._model_runner)]``). The fake ``self``
    needs ``model_runner`` (with ``weight_updater``) and ``_model_runner``."""
    return dict(_tp_worker_methods())


@functools.cache
def _tp_worker_methods() -> dict[str, Callable]:
    path = _source_path("sglang.srt.managers.tp_worker")
    methods = compile_definitions(
        path, ["init_weights_update_group", "destroy_weights_update_group"], {}, class_name="BaseTpWorker"
    )
    methods.update(compile_definitions(path, ["weight_update_runners"], {}, class_name="TpModelWorker"))
    return methods


def scheduler_weight_update_stack(*, model: Any, events: list, scheduler: Any, is_fully_idle: Callable,
                                  flush_cache: Callable) -> Any:
    """SGLang's scheduler-side weight-update path on CPU, returned as its SchedulerWeightUpdaterManager:
    manager (scheduler_components/weight_updater.py) -> the TP worker's plumbing (:func:`tp_worker_methods`)
    -> the model runner's WeightUpdater (model_runner_components/weight_updater.py, device "cpu") ->
    ``model.load_weights``. The runner's begin/end (quantised-weight repacking in model_loader, stubbed here)
    are stand-ins that append ``("runner_begin",)`` / ``("runner_end", run_post_load)`` to ``events``.
    Build and call it inside :func:`sglang_imports` with the runtime context published (see the tests)."""
    weight_updater = model_runner_weight_updater_module().WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={}, get_model=lambda: model,
        update_model_fields=None, recapture_cuda_graph=None, get_model_runner=None)

    class RunnerWeights:
        def begin_weight_update(self):
            events.append(("runner_begin",))

        def end_weight_update(self, *, run_post_load):
            events.append(("runner_end", run_post_load))

        def load_weights_from_distributed(self, named_tensors):
            return weight_updater.load_weights_from_distributed(named_tensors)

    tp_worker = type("TpWorker", (), tp_worker_methods())()
    tp_worker.model_runner = types.SimpleNamespace(weight_updater=weight_updater)
    tp_worker._model_runner = types.SimpleNamespace(weight_updater=RunnerWeights())
    return scheduler_weight_updater_module().SchedulerWeightUpdaterManager(
        tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None, is_fully_idle=is_fully_idle,
        flush_cache=flush_cache, scheduler=scheduler)


def runtime_context() -> types.ModuleType:
    """``sglang/srt/runtime_context.py``: get_parallel()/get_model() read by the updaters and the mixin."""
    return load_module("sglang.srt.runtime_context")


# ---------------------------------------------------------------------------------------------------
# 7. TokenizerManager control methods.
# ---------------------------------------------------------------------------------------------------

_TOKENIZER_MANAGER_METHODS = [
    "pause_generation",
    "continue_generation",
    "update_weights_from_disk",
    "_wait_for_model_update_from_disk",
    "_update_model_path_info",
]
_CONTROL_MIXIN_METHODS = [
    "_weight_update_session_call",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_distributed",
    "init_weights_update_group",
    "destroy_weights_update_group",
    "update_weight_version",
    "_update_weight_version_if_provided",
    "flush_cache",
]


def tokenizer_manager_methods() -> dict[str, Callable]:
    """SGLang's own TokenizerManager control methods, as plain functions to bind to a fake ``self``.

    * ``tokenizer_control_mixin.py`` is loaded whole (real module; its imports of
      disaggregation/utils are stubbed): ``_weight_update_session_call``, ``begin_weight_update``,
      ``end_weight_update``, ``update_weights_from_distributed``, ``init_weights_update_group``,
      ``destroy_weights_update_group``, ``update_weight_version``,
      ``_update_weight_version_if_provided``, ``flush_cache`` are ``TokenizerControlMixin``'s functions.
    * ``tokenizer_manager.py`` cannot be imported (uvloop, model configs, multimodal processors, ...):
      ``pause_generation``, ``continue_generation``, ``update_weights_from_disk``,
      ``_wait_for_model_update_from_disk``, ``_update_model_path_info`` are compiled from its source
      with ``ast`` (class TokenizerManager), in a namespace holding what they read: asyncio,
      nullcontext, logger, fastapi, typing names, the io_struct classes.

    The fake ``self`` must provide (see :func:`make_tokenizer_manager_shell`): ``is_pause`` (bool),
    ``is_pause_cond`` (asyncio.Condition), ``model_update_lock`` (SGLang's RWLock),
    ``auto_create_handle_loop()``, ``abort_request(rid="", abort_all=False)``,
    ``async _async_dispatch_to_scheduler(obj)``, ``_dispatch_to_scheduler(obj)``, ``mm_processor``
    (None or with ``clear_preprocess_cache()``), ``config_value(name)`` (update_weights_from_disk reads
    "load_format" when the request has none), ``record_config_updates(source, **fields)`` (called by
    ``_update_weight_version_if_provided`` and ``_update_model_path_info``), ``elastic_worker_count``
    (update_weights_from_disk: the scheduler replies expected) and ``model_update_result`` (a Future the
    reply handler resolves), and one async callable ``<name>_communicator(obj) -> list[reply]`` per
    control call (``begin_weight_update_communicator``, ``end_weight_update_communicator``,
    ``update_weights_from_distributed_communicator``, ``init_weights_update_group_communicator``,
    ``destroy_weights_update_group_communicator``, ``update_weight_version_communicator``,
    ``flush_cache_communicator``); replies need ``.success`` and ``.message``. The mixin's
    init/destroy_weights_update_group and update_weights_from_distributed also assert
    ``get_parallel().dp_size == 1`` (SGLang's runtime_context, unpublished by default): run them under
    ``runtime_context().get_context().override_server_args()`` inside :func:`sglang_imports` (as the
    tests do) or ``runtime_context().get_parallel().override(dp_size=1)``.
    """
    return dict(_tokenizer_manager_methods())


@functools.cache
def _tokenizer_manager_methods() -> dict[str, Callable]:
    import asyncio
    import typing
    from contextlib import nullcontext

    import fastapi

    mixin = load_module("sglang.srt.managers.tokenizer_control_mixin").TokenizerControlMixin
    methods: dict[str, Callable] = {name: getattr(mixin, name) for name in _CONTROL_MIXIN_METHODS}
    io = io_struct()
    namespace: dict[str, Any] = {
        "__name__": "sglang.srt.managers.tokenizer_manager",
        "asyncio": asyncio,
        "nullcontext": nullcontext,
        "fastapi": fastapi,
        "logger": logging.getLogger("sglang.srt.managers.tokenizer_manager"),
        **{name: getattr(typing, name) for name in ("Any", "Dict", "List", "Optional", "Tuple", "Union")},
        **{name: obj for name, obj in vars(io).items() if isinstance(obj, type) and obj.__module__ == io.__name__},
    }
    methods.update(
        compile_definitions(
            _source_path("sglang.srt.managers.tokenizer_manager"),
            _TOKENIZER_MANAGER_METHODS,
            namespace,
            class_name="TokenizerManager",
        )
    )
    return methods


def make_tokenizer_manager_shell(**attrs: Any) -> Any:
    """An object carrying every function of :func:`tokenizer_manager_methods` as a method (so SGLang's
    code calling ``self.<other method>`` reaches SGLang's code) plus defaults for the state the methods
    use: ``is_pause=False``, ``is_pause_cond=asyncio.Condition()``, ``model_update_lock=RWLock()``
    (SGLang's), ``mm_processor=None``, ``elastic_worker_count=1``, ``auto_create_handle_loop`` no-op,
    ``record_config_updates`` recording into ``self.config_updates``. ``attrs`` (communicators,
    dispatchers, abort_request, config_value, ...) are set on top; anything missing raises
    AttributeError when SGLang's code reaches it."""
    import asyncio

    rwlock = load_module("sglang.srt.utils.aio_rwlock").RWLock
    shell_cls = type("TokenizerManagerShell", (), dict(tokenizer_manager_methods()))
    shell = shell_cls()
    shell.is_pause = False
    shell.is_pause_cond = asyncio.Condition()
    shell.model_update_lock = rwlock()
    shell.mm_processor = None
    shell.elastic_worker_count = 1
    shell.config_updates = []
    shell.auto_create_handle_loop = lambda: None
    shell.record_config_updates = lambda source, **fields: shell.config_updates.append((source, fields))
    for name, value in attrs.items():
        setattr(shell, name, value)
    return shell


# ---------------------------------------------------------------------------------------------------
# 8. Command lines.
# ---------------------------------------------------------------------------------------------------


def parse_sglang_server_argv(argv: list[str]) -> Any:
    """``python -m sglang.launch_server ARGV`` up to the point where the launcher starts the server:
    sglang/launch_server.py calls ``prepare_server_args(sys.argv[1:])`` (srt/server_args.py), which
    builds ``argparse.ArgumentParser(prog="sglang serve")``, ``ServerArgs.add_cli_args(parser)``,
    ``parser.parse_args(argv)`` (SystemExit(2) on an unknown or malformed flag), sets up logging and
    returns ``ServerArgs.from_cli_args(args)``. That is called here unchanged and its ServerArgs is
    returned. ``ServerArgs.__post_init__`` does nothing in this version; the validation/derivation
    pipeline runs later in ``run_server`` -> ``server_args.resolve_once()``, which reads the model's
    HF config and the device, and is NOT run here.

    Skipped, then: everything ``resolve_once()`` does (``arg_groups/pipeline.py``
    run_resolution_pipeline: model-path/HF-config handling, parallelism, memory, attention backend and
    platform defaults, cross-flag validation such as a port range). A dummy-model resolution does run on
    CPU (SGLang's own ``get_context().override_server_args()`` uses it; see the tests) but for a real
    model path it needs the model's config, whose modules are stubbed here.

    Note: prepare_server_args calls ``logging.basicConfig(level=..., force=True)`` as the launcher
    does; the root logger's handlers are set aside for the call (so basicConfig cannot close them, e.g.
    pytest's capture handlers) and put back with the level afterwards.
    """
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    root.handlers[:] = []
    try:
        with sglang_imports():
            return load_module("sglang.srt.server_args").prepare_server_args(list(argv))
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


def parse_router_argv(argv: list[str]) -> Any:
    """``python -m sglang_router.launch_router ARGV`` up to the start: sglang-router's own
    ``parse_router_args(argv)`` (sglang_router/launch_router.py; argparse, SystemExit(2) on an unknown
    or malformed flag) and the ``RouterArgs._validate_router_args()`` that ``launch_router`` runs before
    starting the Rust router. Returns the RouterArgs. sglang-router is a normal installed package."""
    from sglang_router.launch_router import parse_router_args

    router_args = parse_router_args(list(argv))
    router_args._validate_router_args()
    return router_args
