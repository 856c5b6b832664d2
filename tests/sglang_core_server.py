"""An engine whose weight-update control path is SGLang 0.5.23's own code, run on CPU (a test fixture):

    python tests/sglang_core_server.py --model MODEL_DIR --port PORT

Every control call our WeightBroadcaster makes goes through SGLang's code (tests/sglang_source.py loads it):
- the body: ``parse_http_body`` (FastAPI + SGLang's msgspec schema, srt/managers/io_struct.py);
- the tokenizer manager: pause_generation / continue_generation / update_weights_from_disk
  (srt/managers/tokenizer_manager.py) and begin/end_weight_update, update_weights_from_distributed,
  init/destroy_weights_update_group (srt/managers/tokenizer_control_mixin.py), with SGLang's RWLock
  (srt/utils/aio_rwlock.py) and pause condition;
- the scheduler: SchedulerWeightUpdaterManager (srt/managers/scheduler_components/weight_updater.py), the
  TP worker's plumbing (srt/managers/tp_worker.py) and the model runner's WeightUpdater
  (srt/model_executor/model_runner_components/weight_updater.py) on device "cpu": a real gloo group made
  by SGLang's init_custom_process_group (srt/utils/common.py), buckets received into SGLang's
  FlattenedTensorBucket (srt/weight_sync/tensor_bucket.py).
Stand-ins, for what needs a GPU: the model is the HF checkpoint's tensors in a dict (``load_weights`` copies
by name, refusing unknown names and shapes); the runner's begin/end (quantised-weight repacking) record
that they ran; the scheduler's queue is a count of requests. /generate holds SGLang's pause condition and
reader lock like TokenizerManager.generate_request, for ``hold_s`` seconds, unless aborted. GET
/debug/state reports the tensors' SHA-256, the weight version and every event.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
import sglang_source as sgl  # noqa: E402


class Model(torch.nn.Module):
    """The GPU model's stand-in: HF-named tensors; load_weights as SGLang models do (name -> copy)."""

    def __init__(self, model_dir: str):
        super().__init__()
        from safetensors.torch import load_file

        self.tensors = {}
        for name in sorted(os.listdir(model_dir)):
            if name.endswith(".safetensors"):
                self.tensors.update(load_file(os.path.join(model_dir, name)))
        self.loads = 0

    def load_weights(self, named):
        named = list(named)
        for name, tensor in named:
            if name not in self.tensors or self.tensors[name].shape != tensor.shape:
                raise ValueError(f"cannot load '{name}' {tuple(tensor.shape)}")
        for name, tensor in named:
            self.tensors[name].copy_(tensor)
        self.loads += 1


class Scheduler:
    """The scheduler's queue and the calls SGLang's managers make on it."""

    def __init__(self, events: list):
        self.events, self.running, self.paused = events, 0, None

    def record_weight_version_change(self, new_version):
        self.events.append(("version", new_version))

    def is_fully_idle(self, **kw):
        return self.running == 0 or self.paused == "retract"  # retracted requests wait; flush may go

    def flush_cache(self, empty_cache=True):
        ok = self.is_fully_idle()
        self.events.append(("flush", ok))
        return ok


def build(model_dir: str):
    io = sgl.io_struct()
    events: list = []
    model = Model(model_dir)
    scheduler = Scheduler(events)
    manager = sgl.scheduler_weight_update_stack(model=model, events=events, scheduler=scheduler,
                                                is_fully_idle=scheduler.is_fully_idle, flush_cache=scheduler.flush_cache)

    def communicator(method):
        async def call(obj):  # the scheduler process runs it; receiving blocks, so off the event loop
            return [await asyncio.to_thread(method, obj)]

        return call

    aborts: list[asyncio.Event] = []

    async def dispatch(obj):
        if isinstance(obj, io.PauseGenerationReqInput):
            scheduler.paused = obj.mode
        elif isinstance(obj, io.ContinueGenerationReqInput):
            scheduler.paused = None
        events.append((type(obj).__name__, getattr(obj, "mode", None)))

    def abort_request(rid="", abort_all=False):
        events.append(("abort", abort_all))
        for event in aborts:
            event.set()

    shell = sgl.make_tokenizer_manager_shell(
        begin_weight_update_communicator=communicator(manager.begin_weight_update),
        end_weight_update_communicator=communicator(manager.end_weight_update),
        update_weights_from_distributed_communicator=communicator(manager.update_weights_from_distributed),
        init_weights_update_group_communicator=communicator(manager.init_weights_update_group),
        destroy_weights_update_group_communicator=communicator(manager.destroy_weights_update_group),
        _async_dispatch_to_scheduler=dispatch, abort_request=abort_request)
    return io, shell, model, scheduler, events, aborts


async def serve(model_dir: str, port: int) -> None:
    from aiohttp import web

    io, shell, model, scheduler, events, aborts = build(model_dir)
    version = {"value": "default"}

    def reply(success, message, status_ok=200):
        return web.json_response({"success": success, "message": message}, status=status_ok if success else 400)

    async def body_of(request, cls):
        raw = await request.read()
        return sgl.parse_http_body(cls, (await request.json()) if raw else {})

    def route(cls, method_name, keep_version=False):
        async def handler(request):
            try:
                obj = await body_of(request, cls)
            except sgl.HttpBodyRejected as err:
                return web.json_response({"detail": str(err)}, status=err.status_code)
            success, message = await getattr(shell, method_name)(obj)
            if success and keep_version and obj.weight_version is not None:
                version["value"] = obj.weight_version
            return reply(success, message)

        return handler

    async def pause(request):
        obj = await body_of(request, io.PauseGenerationReqInput)
        await shell.pause_generation(obj)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(request):
        obj = await body_of(request, io.ContinueGenerationReqInput)
        await shell.continue_generation(obj)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort(request):
        obj = await body_of(request, io.AbortReq)
        shell.abort_request(rid=obj.rid, abort_all=obj.abort_all)
        return web.Response(status=200)

    async def generate(request):  # TokenizerManager.generate_request's locking, then "decoding" for hold_s
        hold = float((await request.json()).get("hold_s", 1.0))
        async with shell.is_pause_cond:
            await shell.is_pause_cond.wait_for(lambda: not shell.is_pause)
        aborted = asyncio.Event()
        aborts.append(aborted)
        async with shell.model_update_lock.reader_lock:
            scheduler.running += 1
            try:
                await asyncio.wait_for(aborted.wait(), hold)
            except asyncio.TimeoutError:
                pass
            finally:
                scheduler.running -= 1
                aborts.remove(aborted)
        finish = {"type": "abort"} if aborted.is_set() else {"type": "length"}
        return web.json_response({"meta_info": {"finish_reason": finish, "weight_version": version["value"]}})

    async def server_info(request):
        return web.json_response({"tp_size": 1, "dp_size": 1, "version": "sglang-0.5.23-core-on-cpu"})

    async def model_info(request):
        return web.json_response({"weight_version": version["value"]})

    async def state(request):
        digests = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                   for n, t in model.tensors.items()}
        return web.json_response({"weights": digests, "weight_version": version["value"], "paused": shell.is_pause,
                                  "events": [list(map(str, e)) for e in events], "loads": model.loads})

    app = web.Application(client_max_size=1 << 30)
    r = app.router
    r.add_get("/health", lambda request: web.Response(status=200))
    r.add_get("/server_info", server_info)
    r.add_get("/model_info", model_info)
    r.add_get("/debug/state", state)
    r.add_post("/generate", generate)
    r.add_post("/pause_generation", pause)
    r.add_post("/continue_generation", cont)
    r.add_post("/abort_request", abort)
    r.add_post("/begin_weight_update", route(io.BeginWeightUpdateReqInput, "begin_weight_update"))
    r.add_post("/end_weight_update", route(io.EndWeightUpdateReqInput, "end_weight_update"))
    r.add_post("/init_weights_update_group", route(io.InitWeightsUpdateGroupReqInput, "init_weights_update_group"))
    r.add_post("/destroy_weights_update_group",
               route(io.DestroyWeightsUpdateGroupReqInput, "destroy_weights_update_group"))
    r.add_post("/update_weights_from_distributed",
               route(io.UpdateWeightsFromDistributedReqInput, "update_weights_from_distributed", keep_version=True))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"sglang core serving on {port}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    # SGLang's weight updater asserts a default group (its TP group); one rank here
    torch.distributed.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), world_size=1, rank=0)
    rc = sgl.runtime_context()
    with sgl.sglang_imports(), rc.get_context().override_server_args(), rc.get_parallel().override(
            tp_group=types.SimpleNamespace(cpu_group=None, world_size=1)):
        asyncio.run(serve(args.model, args.port))


if __name__ == "__main__":
    main()
