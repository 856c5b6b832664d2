"""tests/sglang_source.py loads SGLang's own code on CPU: each test runs one loaded piece on real input and
checks SGLang's answer, and that the piece is SGLang's file (not a stand-in). The SGLang file each test
exercises is named in its docstring (paths relative to the installed ``sglang`` package)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import traceback
import types
from datetime import timedelta

import pytest
import sglang_source as sgl

if not sgl.sglang_available():
    pytest.skip(sgl.SGLANG_NOT_INSTALLED, allow_module_level=True)

ROOT = sgl.sglang_root()


def _sglang_keys() -> set[str]:
    return {k for k in sys.modules if k == "sglang" or k.startswith("sglang.")}


def _is_sglang_code(fn, rel_path: str) -> bool:
    """``fn`` was compiled from the installed SGLang file ``rel_path``."""
    fn = getattr(fn, "__func__", fn)
    return os.path.samefile(fn.__code__.co_filename, os.path.join(ROOT, rel_path))


@pytest.fixture(scope="module")
def io():
    return sgl.io_struct()


@pytest.fixture
def published_config():
    """SGLang's own test helper publishes a dummy-model ServerArgs (srt/runtime_context.py
    ``override_server_args``), so ``get_parallel().dp_size`` / ``get_model().weight_cache_mode`` read
    SGLang's defaults; restored afterwards, as are the sglang modules in sys.modules."""
    rc = sgl.runtime_context()
    with sgl.sglang_imports(), rc.get_context().override_server_args():
        yield rc


# --- isolation --------------------------------------------------------------------------------------


def test_loading_leaves_sys_modules_without_sglang():
    """Loading every piece (srt/managers/io_struct.py, server_args.py, ...) and calling into it leaves
    no sglang module in sys.modules; every stub is a documented one (STUBBED_MODULES), none 'unlisted'."""
    before = _sglang_keys()
    sgl.io_struct()
    sgl.scheduler_weight_updater_module()
    sgl.model_runner_weight_updater_module()
    sgl.tokenizer_manager_methods()
    sgl.tp_worker_methods()
    sgl.parse_sglang_server_argv(["--model-path", "x"])
    sgl.parse_http_body(sgl.io_struct().AbortReq, {"abort_all": True})
    assert _sglang_keys() == before
    with sgl.sglang_imports():
        assert "sglang.srt.managers.io_struct" in sys.modules
        assert sys.modules["sglang.srt.managers.io_struct"] is sgl.io_struct()  # cached, not reloaded
    assert _sglang_keys() == before
    stubs = sgl.stubbed_modules()
    assert "unlisted" not in stubs.values(), stubs
    assert set(stubs.values()) <= set(sgl.STUBBED_MODULES)
    assert "sglang.srt.managers.io_struct" not in stubs and "sglang.srt.server_args" not in stubs


def test_triton_patch_confined_to_sglang_blocks():
    """srt/utils/common.py replaces triton.next_power_of_2 at import; outside sglang_imports() triton's own
    function is back."""
    triton = pytest.importorskip("triton")
    common = sgl.load_module("sglang.srt.utils.common")
    assert triton.next_power_of_2 is not common.next_power_of_2
    with sgl.sglang_imports():
        assert triton.next_power_of_2 is common.next_power_of_2
    assert triton.next_power_of_2 is not common.next_power_of_2


def test_stub_placeholders_fail_loudly():
    """A name from a stubbed module (srt/model_loader/loader.py) is a placeholder that refuses use."""
    loader = sgl.load_module("sglang.srt.model_loader.loader")
    assert loader.__sglang_stub__ == "sglang.srt.model_loader.*"
    with pytest.raises(RuntimeError, match="is a stub"):
        loader.DefaultModelLoader()
    with pytest.raises(AttributeError, match="is a stub"):
        loader.DefaultModelLoader.restore_weights_before_loading  # noqa: B018


# --- 1. /generate contract --------------------------------------------------------------------------


def test_generate_contract_error():
    """srt/entrypoints/api_contract.py + api/v1/api_types.py: a misspelt sampling key is refused with
    the schema's text; a valid body passes."""
    assert _is_sglang_code(sgl.load_module("sglang.srt.entrypoints.api_contract").generate_contract_error,
                           "srt/entrypoints/api_contract.py")
    err = sgl.generate_contract_error({"input_ids": [1], "sampling_params": {"temprature": 1}})
    assert err is not None and "unknown field `temprature`" in err and "`temperature`" in err
    assert sgl.generate_contract_error({"input_ids": [1, 2], "sampling_params": {"temperature": 1.0}}) is None
    assert sgl.generate_contract_error({"input_ids": "not a list"}) is not None


# --- 2. SamplingParams ------------------------------------------------------------------------------


def test_sampling_params_verify_and_normalize():
    """srt/sampling/sampling_params.py: SamplingParams(**d), normalize(tokenizer), verify(vocab_size)."""
    sp_cls = sgl.SamplingParams
    assert sp_cls.__module__ == "sglang.srt.sampling.sampling_params"
    assert _is_sglang_code(sp_cls.verify, "srt/sampling/sampling_params.py")
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        sp_cls(top_p=0).verify(32000)
    with pytest.raises(ValueError, match=r"logit_bias must has keys in \[0, 99\]"):
        sgl.validate_sampling_params({"logit_bias": {"100": 1.0}}, vocab_size=100)
    with pytest.raises(TypeError, match="temprature"):
        sp_cls(temprature=1.0)
    sp = sgl.validate_sampling_params({"temperature": 0, "max_new_tokens": 4}, vocab_size=100)
    assert (sp.top_k, sp.temperature, sp.is_normalized, sp.stop_strs) == (1, 1.0, True, [])  # greedy
    # No tokenizer (a --skip-tokenizer-init server): stop strings are refused; with one they are measured.
    with pytest.raises(ValueError, match="unavailable when skip_tokenizer_init=True"):
        sgl.validate_sampling_params({"stop": ["</s>"]}, vocab_size=100)

    class Tok:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return list(text)

    sp = sgl.validate_sampling_params({"stop": "abc"}, vocab_size=100, tokenizer=Tok())
    assert (sp.stop_strs, sp.stop_str_max_len, sp.stop) == (["abc"], 3, None)


# --- 3. io_struct and the HTTP body parse -----------------------------------------------------------


def test_parse_http_body(io):
    """srt/managers/io_struct.py + srt/utils/msgspec_utils.py through FastAPI: required keys, types,
    unknown keys, defaults."""
    assert io.UpdateWeightsFromDistributedReqInput.__module__ == "sglang.srt.managers.io_struct"
    with pytest.raises(sgl.HttpBodyRejected) as rejected:
        sgl.parse_http_body(io.UpdateWeightsFromDistributedReqInput, {"dtypes": ["float32"], "shapes": [[2]]})
    assert rejected.value.status_code == 400
    assert any(e["type"] == "missing" and e["loc"][-1] == "names" for e in rejected.value.detail)
    with pytest.raises(sgl.HttpBodyRejected, match="int_parsing"):
        sgl.parse_http_body(io.UpdateWeightsFromDistributedReqInput,
                            {"names": ["w"], "dtypes": ["float32"], "shapes": [["two"]]})
    with pytest.raises(sgl.HttpBodyRejected, match="literal_error"):
        sgl.parse_http_body(io.PauseGenerationReqInput, {"mode": "stop"})
    req = sgl.parse_http_body(io.UpdateWeightsFromDistributedReqInput,
                              {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "no_such_key": 1})
    assert isinstance(req, io.UpdateWeightsFromDistributedReqInput)  # unknown keys are ignored
    assert (req.names, req.shapes, req.group_name, req.flush_cache, req.load_format) == (
        ["w"], [[2, 3]], "weight_update_group", True, None)
    init = sgl.parse_http_body(io.InitWeightsUpdateGroupReqInput, {
        "master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1, "world_size": 2})
    assert (init.master_port, init.backend) == (29500, "nccl")  # lax: "29500" -> 29500; nccl by default
    assert sgl.parse_http_body(io.PauseGenerationReqInput, {}).mode == "abort"
    with pytest.raises(sgl.HttpBodyRejected, match="Field required"):  # no body at all: send {} instead
        sgl.parse_http_body(io.ContinueGenerationReqInput, None)
    gen = sgl.parse_http_body(io.GenerateReqInput, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
    assert isinstance(gen, io.GenerateReqInput) and gen.input_ids == [1, 2]
    with pytest.raises(sgl.HttpBodyRejected):
        sgl.parse_http_body(io.GenerateReqInput, {"input_ids": "1 2"})
    with pytest.raises(sgl.HttpBodyRejected, match="unknown field `max_tokens`"):  # the /generate contract
        sgl.parse_http_body(io.GenerateReqInput, {"input_ids": [1], "sampling_params": {"max_tokens": 3}})


# --- 4-6. Weight updaters, tensor bucket, RWLock ----------------------------------------------------


def test_flattened_tensor_bucket_round_trip():
    """srt/weight_sync/tensor_bucket.py: two dtypes flatten into one uint8 tensor and come back."""
    import torch

    tb = sgl.load_module("sglang.srt.weight_sync.tensor_bucket")
    assert _is_sglang_code(tb.FlattenedTensorBucket.reconstruct_tensors, "srt/weight_sync/tensor_bucket.py")
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.0, 3.25, 0.0], dtype=torch.bfloat16)
    bucket = tb.FlattenedTensorBucket(named_tensors=[("a", a), ("b", b)])
    assert bucket.get_flattened_tensor().dtype == torch.uint8 and bucket.get_flattened_tensor().numel() == 24 + 8
    out = tb.FlattenedTensorBucket(flattened_tensor=bucket.get_flattened_tensor().clone(),
                                   metadata=bucket.get_metadata()).reconstruct_tensors()
    assert [n for n, _ in out] == ["a", "b"]
    assert torch.equal(out[0][1], a) and torch.equal(out[1][1], b) and out[1][1].dtype == torch.bfloat16
    # The receive side (FlattenedTensorBucket.empty) refuses a layout whose offsets are not dtype-aligned.
    with pytest.raises(ValueError, match="Unaligned received tensor"):
        tb.FlattenedTensorBucket.empty(["b", "a"], ["bfloat16", "float32"], [[3], [2]], "cpu")


def test_rwlock_writer_waits_for_readers():
    """srt/utils/aio_rwlock.py: a writer waits for a reader; is_locked reports both."""
    lock_cls = sgl.load_module("sglang.srt.utils.aio_rwlock").RWLock

    async def scenario():
        lock = lock_cls()
        assert not await lock.is_locked()
        await lock.acquire_reader()
        writer = asyncio.create_task(lock.acquire_writer())
        await asyncio.sleep(0.02)
        assert not writer.done() and await lock.is_locked()
        await lock.release_reader()
        await asyncio.wait_for(writer, 1)
        assert lock._writer_active
        await lock.release_writer()
        assert not await lock.is_locked()

    asyncio.run(scenario())


def test_scheduler_manager_refuses_update_outside_session(io, published_config):
    """srt/managers/scheduler_components/weight_updater.py: update_weights_from_distributed before
    begin_weight_update is refused without touching the model runner."""
    mod = sgl.scheduler_weight_updater_module()
    assert _is_sglang_code(mod.SchedulerWeightUpdaterManager.update_weights_from_distributed,
                           "srt/managers/scheduler_components/weight_updater.py")
    with published_config.get_parallel().override(tp_group=types.SimpleNamespace(cpu_group=None, world_size=1)):
        manager = mod.SchedulerWeightUpdaterManager(
            tp_worker=None, draft_worker=None, memory_saver_adapter=None, flush_cache=lambda **_: True,
            is_fully_idle=lambda **_: True)
        out = manager.update_weights_from_distributed(
            io.UpdateWeightsFromDistributedReqInput(names=["w"], dtypes=["float32"], shapes=[[1]]))
    assert isinstance(out, io.UpdateWeightsFromDistributedReqOutput) and out.success is False
    assert "must run between begin_weight_update() and end_weight_update()" in out.message
    with pytest.raises(ValueError, match="invalid selector"):
        manager._select_runners("drafts")


def test_init_custom_process_group_is_common_py():
    """srt/utils/common.py defines init_custom_process_group (re-exported by sglang.srt.utils); the
    model-runner WeightUpdater and NetworkAddress (srt/utils/network.py) use the real ones."""
    common = sgl.load_module("sglang.srt.utils.common")
    wu = sgl.model_runner_weight_updater_module()
    assert _is_sglang_code(common.init_custom_process_group, "srt/utils/common.py")
    assert wu.init_custom_process_group is common.init_custom_process_group
    assert wu.NetworkAddress("127.0.0.1", 29500).to_tcp() == "tcp://127.0.0.1:29500"
    assert wu.NetworkAddress("::1", 29500).to_tcp() == "tcp://[::1]:29500"


def _trainer(port: int, results) -> None:
    """Rank 0 of the update group: SGLang's own init_custom_process_group, then broadcasts."""
    try:
        import torch

        pg = sgl.init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                           world_size=2, rank=0, group_name="g", timeout=timedelta(seconds=60))
        torch.distributed.broadcast(torch.arange(6, dtype=torch.float32).reshape(2, 3), src=0, group=pg)
        torch.distributed.broadcast(torch.tensor([7, 8, 9]), src=0, group=pg)
        tb = sgl.load_module("sglang.srt.weight_sync.tensor_bucket")
        bucket = tb.FlattenedTensorBucket(named_tensors=[
            ("c", torch.full((2,), 0.5, dtype=torch.float32)), ("d", torch.ones(3, dtype=torch.bfloat16))])
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        results.put(("trainer", "ok"))
    except BaseException:
        results.put(("trainer", traceback.format_exc()))


def _inference(port: int, results) -> None:
    """One SGLang TP rank: HTTP bodies -> SchedulerWeightUpdaterManager -> tp_worker -> WeightUpdater
    (device cpu, backend gloo) -> model.load_weights."""
    try:
        import torch

        torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), world_size=1, rank=0)
        io = sgl.io_struct()
        rc = sgl.runtime_context()
        model = torch.nn.Linear(3, 2, bias=False)
        loaded = []
        model.load_weights = loaded.extend
        events = []
        scheduler = types.SimpleNamespace(record_weight_version_change=lambda new_version: events.append(new_version))
        body = {"names": ["a", "b"], "dtypes": ["float32", "int64"], "shapes": [[2, 3], [3]], "group_name": "g",
                "weight_version": "v1"}
        bucket_body = {"names": ["c", "d"], "dtypes": ["float32", "bfloat16"], "shapes": [[2], [3]],
                       "group_name": "g", "load_format": "flattened_bucket"}
        with sgl.sglang_imports(), rc.get_context().override_server_args(), rc.get_parallel().override(
                tp_group=types.SimpleNamespace(cpu_group=None, world_size=1)):
            manager = sgl.scheduler_weight_update_stack(
                model=model, events=events, scheduler=scheduler, is_fully_idle=lambda **_: True,
                flush_cache=lambda **kw: events.append(("flush", kw)) or True)
            replies = [
                manager.init_weights_update_group(sgl.parse_http_body(io.InitWeightsUpdateGroupReqInput, {
                    "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                    "group_name": "g", "backend": "gloo"})),
                manager.begin_weight_update(sgl.parse_http_body(io.BeginWeightUpdateReqInput, {})),
                manager.update_weights_from_distributed(sgl.parse_http_body(io.UpdateWeightsFromDistributedReqInput, body)),
                manager.update_weights_from_distributed(
                    sgl.parse_http_body(io.UpdateWeightsFromDistributedReqInput, bucket_body)),
                manager.end_weight_update(sgl.parse_http_body(io.EndWeightUpdateReqInput, {})),
                manager.destroy_weights_update_group(sgl.parse_http_body(io.DestroyWeightsUpdateGroupReqInput,
                                                                         {"group_name": "g"})),
            ]
        # Plain data only: SGLang objects pickle by module name, which is importable only inside sglang_imports().
        results.put(("inference", [(type(r).__name__, r.success, r.message) for r in replies], repr(events),
                     [(n, str(t.dtype), t.tolist()) for n, t in loaded]))
    except BaseException:
        results.put(("inference", traceback.format_exc()))


@pytest.mark.multiproc
def test_weight_update_over_gloo_on_cpu():
    """srt/managers/scheduler_components/weight_updater.py, srt/managers/tp_worker.py (methods),
    srt/model_executor/model_runner_components/weight_updater.py, srt/utils/common.py
    (init_custom_process_group), srt/weight_sync/tensor_bucket.py: a 2-rank gloo group on CPU, one
    plain and one flattened-bucket update, inside a begin/end session."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=fn, args=(port, results), daemon=True) for fn in (_trainer, _inference)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < len(procs):
            msg = results.get(timeout=180)
            got[msg[0]] = msg[1:]
            if len(msg) == 2 and msg[1] != "ok":  # a traceback: fail now, the other rank would wait
                pytest.fail(f"{msg[0]} rank failed:\n{msg[1]}")
    except queue.Empty:
        pytest.fail(f"weight-update ranks timed out; got {got}")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got["trainer"] == ("ok",)
    replies, events, loaded = got["inference"]
    assert [r[:2] for r in replies] == [
        ("InitWeightsUpdateGroupReqOutput", True), ("BeginWeightUpdateReqOutput", True),
        ("UpdateWeightsFromDistributedReqOutput", True), ("UpdateWeightsFromDistributedReqOutput", True),
        ("EndWeightUpdateReqOutput", True), ("DestroyWeightsUpdateGroupReqOutput", True)], replies
    assert loaded == [("a", "torch.float32", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]), ("b", "torch.int64", [7, 8, 9]),
                      ("c", "torch.float32", [0.5, 0.5]), ("d", "torch.bfloat16", [1.0, 1.0, 1.0])]
    # end_weight_update skips post_load_weights when a load ran; the version and the flush follow each load.
    assert events == repr([("runner_begin",), "v1", ("flush", {"empty_cache": False}), None,
                           ("flush", {"empty_cache": False}), ("runner_end", False)])


# --- 7. TokenizerManager control methods ------------------------------------------------------------


class _Reply:
    def __init__(self, success=True, message="ok"):
        self.success, self.message = success, message


def _communicator(log, name):
    async def call(obj):
        log.append((name, obj))
        return [_Reply()]

    return call


def test_tokenizer_manager_methods_are_sglang_code():
    """srt/managers/tokenizer_manager.py (ast-compiled) and srt/managers/tokenizer_control_mixin.py."""
    methods = sgl.tokenizer_manager_methods()
    for name in ("pause_generation", "continue_generation", "update_weights_from_disk"):
        assert _is_sglang_code(methods[name], "srt/managers/tokenizer_manager.py"), name
    for name in ("_weight_update_session_call", "begin_weight_update", "end_weight_update",
                 "update_weights_from_distributed"):
        assert _is_sglang_code(methods[name], "srt/managers/tokenizer_control_mixin.py"), name


def test_weight_update_session_waits_for_writer_lock_unless_paused(io, published_config):
    """srt/managers/tokenizer_control_mixin.py: begin/end_weight_update take the model-update writer lock
    (so wait for in-flight requests, which hold reader locks) unless generation is paused."""
    log = []
    shell = sgl.make_tokenizer_manager_shell(
        begin_weight_update_communicator=_communicator(log, "begin"),
        end_weight_update_communicator=_communicator(log, "end"))

    async def scenario():
        await shell.model_update_lock.acquire_reader()  # an in-flight generate request
        begin = asyncio.create_task(shell.begin_weight_update(io.BeginWeightUpdateReqInput()))
        await asyncio.sleep(0.05)
        assert not begin.done() and log == []
        await shell.model_update_lock.release_reader()
        assert await asyncio.wait_for(begin, 1) == (True, "ok")
        shell.is_pause = True  # paused: whoever paused holds the lock; the call goes straight through
        await shell.model_update_lock.acquire_reader()
        assert await asyncio.wait_for(shell.end_weight_update(io.EndWeightUpdateReqInput()), 1) == (True, "ok")

    asyncio.run(scenario())
    assert [name for name, _ in log] == ["begin", "end"]


def test_update_weights_from_distributed_control(io, published_config):
    """srt/managers/tokenizer_control_mixin.py update_weights_from_distributed: aborts when asked, forwards
    the request, records the weight version and says so in the message."""
    log, aborted = [], []
    shell = sgl.make_tokenizer_manager_shell(
        update_weights_from_distributed_communicator=_communicator(log, "update"),
        abort_request=lambda rid="", abort_all=False: aborted.append(abort_all))
    req = io.UpdateWeightsFromDistributedReqInput(names=["w"], dtypes=["float32"], shapes=[[1]],
                                                   weight_version="step-3", abort_all_requests=True)
    assert asyncio.run(shell.update_weights_from_distributed(req)) == (
        True, "ok Weight version updated to step-3.")
    assert aborted == [True] and log == [("update", req)]
    assert shell.config_updates == [("tokenizer.weight_version", {"weight_version": "step-3"})]


def test_pause_and_continue_generation(io):
    """srt/managers/tokenizer_manager.py pause_generation/continue_generation: 'retract' forwards to the
    scheduler; 'abort' aborts everything and waits until no request holds the model-update lock."""
    sent, aborted = [], []

    async def dispatch(obj):
        sent.append(obj)

    async def scenario():
        shell = sgl.make_tokenizer_manager_shell(_async_dispatch_to_scheduler=dispatch)
        await shell.pause_generation(io.PauseGenerationReqInput(mode="retract"))
        assert shell.is_pause and len(sent) == 1
        await shell.continue_generation(io.ContinueGenerationReqInput())
        assert not shell.is_pause and isinstance(sent[-1], io.ContinueGenerationReqInput)

        lock = shell.model_update_lock
        await lock.acquire_reader()  # an in-flight request; the abort finishes it
        shell.abort_request = lambda rid="", abort_all=False: aborted.append(abort_all) or asyncio.ensure_future(
            lock.release_reader())
        await asyncio.wait_for(shell.pause_generation(io.PauseGenerationReqInput(mode="abort")), 5)
        assert shell.is_pause and aborted and all(aborted) and len(sent) == 2  # abort mode sends nothing

    asyncio.run(scenario())


def test_update_weights_from_disk_control(io):
    """srt/managers/tokenizer_manager.py update_weights_from_disk + _wait_for_model_update_from_disk:
    fills load_format from the config, dispatches, and on success records the new model path."""
    sent = []
    shell = sgl.make_tokenizer_manager_shell(config_value={"load_format": "auto"}.__getitem__)

    def dispatch(obj):
        sent.append(obj)
        shell.model_update_result.set_result(
            io.UpdateWeightFromDiskReqOutput(success=True, message="Succeeded", num_paused_requests=0))

    shell._dispatch_to_scheduler = dispatch
    req = io.UpdateWeightFromDiskReqInput(model_path="/ckpt/step-7", weight_version="7")
    assert asyncio.run(shell.update_weights_from_disk(req)) == (True, "Succeeded Weight version updated to 7.", 0)
    assert sent == [req] and req.load_format == "auto"
    assert shell.model_path == shell.served_model_name == "/ckpt/step-7"
    assert ("tokenizer.update_weights", {"load_format": "auto"}) in shell.config_updates


# --- 8. Command lines -------------------------------------------------------------------------------


def test_sglang_server_argv(capsys):
    """srt/server_args.py prepare_server_args (what sglang/launch_server.py calls)."""
    args = sgl.parse_sglang_server_argv(["--model-path", "x", "--tp-size", "8", "--host", "0.0.0.0",
                                         "--port", "30000"])
    assert type(args).__module__ == "sglang.srt.server_args"
    assert (args.model_path, args.tp_size, args.host, args.port) == ("x", 8, "0.0.0.0", 30000)
    with pytest.raises(SystemExit) as bad:
        sgl.parse_sglang_server_argv(["--model-path", "x", "--no-such-flag"])
    assert bad.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sgl.parse_sglang_server_argv(["--model-path", "x", "--tp-size", "eight"])
    assert "invalid int value: 'eight'" in capsys.readouterr().err


def test_router_argv(capsys):
    """sglang_router/launch_router.py parse_router_args (sglang-router 0.3.2, installed)."""
    args = sgl.parse_router_argv(["--host", "127.0.0.1", "--port", "1", "--worker-urls", "http://a:1", "http://b:2"])
    assert (args.host, args.port, args.worker_urls) == ("127.0.0.1", 1, ["http://a:1", "http://b:2"])
    with pytest.raises(SystemExit) as bad:
        sgl.parse_router_argv(["--no-such-flag"])
    assert bad.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
