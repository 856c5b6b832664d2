"""The local engine's HTTP front, speaking the SGLang HTTP subset the project uses with SGLang's rules.

    megatron-spo serve --model HF_DIR --port 30000 [--tp-size N] [--enable-deterministic-inference]

Endpoints: /generate, /health, /health_generate, /model_info, /server_info (and the deprecated
/get_model_info, /get_server_info), /get_weight_version, /flush_cache, /abort_request, /pause_generation,
/continue_generation, /begin_weight_update, /end_weight_update, /update_weights_from_disk,
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group,
/update_weight_version, and with --enable-lora /load_lora_adapter (a PEFT directory), /load_lora_adapter_from_tensors
and /unload_lora_adapter
(engine_lora.py; /generate's lora_path picks an adapter). Request and response shapes are SGLang's (protocol.py).

What the front enforces, as SGLang's tokenizer manager does (sglang 0.5.23, managers/tokenizer_manager.py and
tokenizer_control_mixin.py): every /generate waits while the engine is paused and then holds a reader lock
until it returns; a weight update on an engine that is not paused takes the writer lock (it waits for every
request in flight, and new ones queue behind it), and on a paused engine runs at once; /pause_generation
``abort`` aborts every request and returns when none is left in flight, ``retract`` and ``in_place`` hand the
pause to the scheduler (local_engine.py); request ids of n > 1 samples are fresh per sample; a request id
already in flight is refused.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import sys
import time
import uuid
from typing import Any

import torch

from megatron_spo.rollout.local_engine import LocalEngine, Req, Scheduler
from megatron_spo.rollout.protocol import (
    PAUSE_MODES,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    ProtocolError,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    parse_body,
)
from megatron_spo.rollout.rwlock import RWLock

log = logging.getLogger("megatron_spo.engine")


def default_health_timeout() -> float:
    """SGLang's HEALTH_CHECK_TIMEOUT: SGLANG_HEALTH_CHECK_TIMEOUT seconds, default 20."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))


class EngineServer:
    """aiohttp front of one LocalEngine, whose Scheduler thread does all model work."""

    def __init__(self, engine: LocalEngine, *, host: str, port: int, max_batch_size: int = 64,
                 served_model_name: str | None = None, health_timeout_s: float | None = None):
        self.engine = engine
        self.health_timeout_s = default_health_timeout() if health_timeout_s is None else health_timeout_s
        self.host, self.port = host, port
        self.served_model_name = served_model_name or engine.model_path
        self.scheduler = Scheduler(engine, max_batch_size=max_batch_size)
        self.is_pause = False
        self.pause_cond: asyncio.Condition | None = None
        self.model_update_lock: RWLock | None = None
        self.live_rids: set[str] = set()
        self.unloading: set[str] = set()  # adapters being unloaded: new requests can no longer select them
        self.lora_lock: asyncio.Lock | None = None
        self.lora_paths: dict[str, str] = {}  # adapters loaded by path (/load_lora_adapter): name -> path
        self.startup_time = time.time()

    async def on_startup(self, app) -> None:
        self.pause_cond = asyncio.Condition()
        self.model_update_lock = RWLock()
        self.lora_lock = asyncio.Lock()
        self.scheduler.start()

    async def on_cleanup(self, app) -> None:
        self.scheduler.stop()

    def build_app(self):
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_model_info", self.deprecated(self.model_info, "/get_model_info", "/model_info"))
        r.add_get("/get_server_info", self.deprecated(self.server_info, "/get_server_info", "/server_info"))
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        return app

    async def on_scheduler(self, fn, *args):
        """Run fn on the scheduler thread between two decode steps."""
        return await asyncio.wrap_future(self.scheduler.call(fn, *args))

    def deprecated(self, handler, old: str, new: str):
        async def wrapped(request):
            log.warning("Endpoint '%s' is deprecated and will be removed in a future version. Please use '%s' "
                        "instead.", old, new)
            return await handler(request)

        return wrapped

    # --- info ------------------------------------------------------------------------------------
    async def health(self, request):
        """SGLang's /health (and /health_generate) runs a one-token generation: while generation is paused it
        waits, and answers 503 once it has waited health_timeout_s (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s) with
        no output; an engine that is not paused answers at once."""
        from aiohttp import web

        async with self.pause_cond:
            try:
                await asyncio.wait_for(self.pause_cond.wait_for(lambda: not self.is_pause), self.health_timeout_s)
            except TimeoutError:
                log.error("Health check failed: generation paused for the last %g seconds", self.health_timeout_s)
                return web.Response(status=503)
        return web.Response(status=200)

    async def model_info(self, request):
        from aiohttp import web

        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.engine.model_path, "tokenizer_path": self.engine.model_path,
            "served_model_name": self.served_model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.scheduler.weight_version,
            "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
        })

    async def server_info(self, request):
        from aiohttp import web

        s, lora = self.scheduler, self.engine.lora
        return web.json_response({
            "model_path": self.engine.model_path, "tokenizer_path": self.engine.model_path,
            "served_model_name": self.served_model_name, "max_context_length": self.engine.max_context_length,
            "dtype": str(next(self.engine.model.parameters()).dtype).removeprefix("torch."),  # SGLang's server arg
            "version": "megatron-spo-local", "host": self.host, "port": self.port, "tp_size": self.engine.tp_size,
            "dp_size": 1, "enable_deterministic_inference": self.engine.deterministic,
            "enable_lora": lora is not None, "max_lora_rank": None if lora is None else lora.max_rank,
            "lora_target_modules": None if lora is None else list(lora.target_modules),
            "startup_time": self.startup_time,
            "internal_states": [{"weight_version": s.weight_version, "paused": s.paused or self.is_pause,
                                 "weight_update_session_open": s.session_open, **dict(s.stats)}],
        })

    async def get_weight_version(self, request):
        from aiohttp import web

        return web.json_response({"weight_version": self.scheduler.weight_version})

    async def flush_cache(self, request):
        from aiohttp import web

        if await self.on_scheduler(self.scheduler.flush_cache):
            return web.Response(text="Cache flushed.\n", status=200)
        return web.Response(text="Cache not flushed: requests are running or queued.\n", status=400)

    # --- generate --------------------------------------------------------------------------------
    async def generate(self, request):
        from aiohttp import web

        start = time.perf_counter()
        try:
            req = GenerateRequest.from_json(await request.json())
        except ProtocolError as err:
            return _error(400, str(err))
        except ValueError as err:
            return _error(400, f"invalid JSON body: {err}")
        params, n = req.sampling_params, req.sampling_params.n
        routed = req.return_routed_experts and self.engine.routes is not None  # SGLang: nothing without the flag
        reqs = [Req(prompt, params, rid, lora=req.lora_path, routes=[] if routed else None) for prompt, rid in zip(
            [p for p in req.prompts for _ in range(n)], _sample_rids(req.rid, len(req.prompts), n))]
        try:
            for r in reqs:
                self.engine.check(r)
                if routed:
                    _check_routed_experts_start(req.routed_experts_start_len, len(r.prompt))
            self._check_lora(req.lora_path)
        except (ProtocolError, ValueError) as err:
            return _error(400, str(err))
        duplicate = next((r.rid for r in reqs if r.rid in self.live_rids), None)
        if duplicate is not None or len({r.rid for r in reqs}) < len(reqs):
            return _error(400, f"Duplicate request ID detected: {duplicate or reqs[0].rid}")
        self.live_rids.update(r.rid for r in reqs)
        try:
            async with self.pause_cond:
                await self.pause_cond.wait_for(lambda: not self.is_pause)
            async with self.model_update_lock.reader():
                await self._run(reqs)
        except asyncio.CancelledError:  # the client went away: stop its requests, as SGLang does
            self.scheduler.call(self.scheduler.abort, "", False, reqs)
            raise
        finally:
            self.live_rids.difference_update(r.rid for r in reqs)
        failed = next((r.error for r in reqs if r.error is not None), None)
        if failed is not None:
            return _error(500, f"generation failed: {type(failed).__name__}: {failed}")
        latency = time.perf_counter() - start
        items = []
        for r in reqs:
            spans = r.spans
            meta: dict[str, Any] = {
                "id": r.rid, "finish_reason": r.finish, "prompt_tokens": len(r.prompt),
                "weight_version": spans[-1]["version"], "weight_versions": spans,
                "num_retractions": r.retractions, "completion_tokens": len(r.output_ids), "cached_tokens": 0,
                "e2e_latency": latency,
            }
            if req.return_logprob:
                meta["output_token_logprobs"] = [[_json_float(lp), tok, None] for lp, tok in
                                                 zip(r.logprobs, r.output_ids)]
            if r.routes:  # SGLang's detokenizer: base64 of int32 [positions, layers, top_k]
                routes = torch.cat(r.routes)[req.routed_experts_start_len:].contiguous()
                meta["routed_experts"] = base64.b64encode(routes.numpy().tobytes()).decode("utf-8")
            items.append({"text": self.engine.decode(r.output_ids, params.skip_special_tokens),
                          "output_ids": r.output_ids, "meta_info": meta})
        return web.json_response(items if (req.is_batch or n > 1) else items[0])

    def _check_lora(self, name: str | None) -> None:
        """SGLang's tokenizer manager: an adapter must be loaded (and not being unloaded) to be selected."""
        if name is None:
            return
        if self.engine.lora is None:
            raise ValueError(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                             "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                             "endpoint.")
        if name in self.unloading:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {[a for a in self.engine.lora.adapters if a not in self.unloading]}.")
        self.engine.lora.check_request(name)

    async def _run(self, reqs: list[Req]) -> None:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in reqs]
        for r, fut in zip(reqs, futures):
            r.on_finish = lambda _r, fut=fut: loop.call_soon_threadsafe(_resolve, fut)
        self.scheduler.submit(reqs)
        await asyncio.gather(*futures)

    async def abort_request(self, request):
        from aiohttp import web

        body = await _json(request)
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        await self.on_scheduler(self.scheduler.abort, rid, abort_all)
        return web.Response(status=200)

    # --- pause / continue ------------------------------------------------------------------------
    async def pause_generation(self, request):
        from aiohttp import web

        mode = (await _json(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(400, f"/pause_generation: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        async with self.pause_cond:
            self.is_pause = True
            if mode != "abort":
                await self.on_scheduler(self.scheduler.pause, mode)
            else:  # SGLang: abort everything until no /generate holds the lock any more
                while True:
                    await self.on_scheduler(self.scheduler.abort, "", True)
                    if not await self.model_update_lock.is_locked():
                        break
                    await asyncio.sleep(0.02)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request):
        from aiohttp import web

        async with self.pause_cond:
            self.is_pause = False
            await self.on_scheduler(self.scheduler.resume)
            self.pause_cond.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # --- weights ---------------------------------------------------------------------------------
    async def _exclusive(self, fn, *args):
        """SGLang's locking of an update: on a paused engine at once (holding the pause condition so nobody
        unpauses meanwhile), otherwise under the writer lock."""
        async with self.pause_cond:
            paused = self.is_pause
            if paused:
                return await self.on_scheduler(fn, *args)
        async with self.model_update_lock.writer():
            return await self.on_scheduler(fn, *args)

    async def _update(self, request, cls, endpoint: str, fn):
        from aiohttp import web

        try:
            body = parse_body(cls, await _json(request), endpoint)
        except ProtocolError as err:
            return _error(400, str(err))
        if getattr(body, "abort_all_requests", False):
            await self.on_scheduler(self.scheduler.abort, "", True)
        success, message = await self._exclusive(fn, body)
        version = getattr(body, "weight_version", None)
        if success and version is not None:
            message += f" Weight version updated to {version}."
        (log.info if success else log.error)("%s: %s", endpoint, message)
        content = {"success": success, "message": message}
        if endpoint == "/update_weights_from_disk":
            content["num_paused_requests"] = 0
        return web.json_response(content, status=200 if success else 400)

    async def update_weights_from_disk(self, request):
        return await self._update(request, UpdateWeightsFromDiskRequest, "/update_weights_from_disk",
                                  self.scheduler.update_weights_from_disk)

    async def update_weights_from_distributed(self, request):
        return await self._update(request, UpdateWeightsFromDistributedRequest, "/update_weights_from_distributed",
                                  self.scheduler.update_weights_from_distributed)

    async def begin_weight_update(self, request):
        from aiohttp import web

        success, message = await self._exclusive(self.scheduler.begin_weight_update)
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def end_weight_update(self, request):
        from aiohttp import web

        success, message = await self._exclusive(self.scheduler.end_weight_update)
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def init_weights_update_group(self, request):
        from aiohttp import web

        try:
            body = parse_body(InitWeightsUpdateGroupRequest, await _json(request), "/init_weights_update_group")
            await self.on_scheduler(self.engine.init_weights_update_group, body)
        except Exception as err:
            message = f"Failed to initialize custom process group: {err}."
            log.error(message)
            return web.json_response({"success": False, "message": message}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request):
        from aiohttp import web

        name = (await _json(request)).get("group_name", "weight_update_group")
        try:
            await self.on_scheduler(self.engine.destroy_weights_update_group, name)
        except ValueError as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_weight_version(self, request):
        from aiohttp import web

        body = await _json(request)
        version = body.get("new_version")
        if not isinstance(version, str):
            return _error(400, "/update_weight_version: new_version must be a string")
        if body.get("abort_all_requests", True):
            await self.on_scheduler(self.scheduler.abort, "", True)
        await self.on_scheduler(self.scheduler.update_weight_version, version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})


    # --- LoRA adapters ---------------------------------------------------------------------------
    def _lora_reply(self, success: bool, error: str = ""):
        from aiohttp import web

        loaded = {} if self.engine.lora is None else {n: self.lora_paths.get(n, "__tensor__")
                                                      for n in self.engine.lora.adapters}
        (log.info if success else log.error)("lora adapters: %s", error or f"loaded {sorted(loaded)}")
        return web.json_response({"success": success, "error_message": error, "loaded_adapters": loaded},
                                 status=200 if success else 400)

    async def load_lora_adapter_from_tensors(self, request):
        """SGLang's: each TP rank reads its own payload (index tp_rank) and slices the full adapter; here rank 0's is
        loaded after checking every rank has one. Loaded between two decode steps, no pause."""
        from megatron_spo.rollout.adapter_push import deserialize_adapter

        try:
            body = parse_body(LoadLoraAdapterFromTensorsRequest, await _json(request),
                              "/load_lora_adapter_from_tensors")
        except ProtocolError as err:
            return self._lora_reply(False, str(err))
        if self.engine.lora is None:
            return self._lora_reply(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        payloads = body.serialized_named_tensors
        if not isinstance(payloads, list) or len(payloads) < self.engine.tp_size:
            return self._lora_reply(False, f"serialized_named_tensors holds {len(payloads or [])} payloads, one per TP "
                                    f"rank is needed (tp_size {self.engine.tp_size})")
        async with self.lora_lock:
            try:
                tensors = await asyncio.to_thread(deserialize_adapter, payloads[0], body.load_format)
                await self.on_scheduler(self.engine.lora.load, body.lora_name, body.config_dict, tensors)
            except Exception as err:  # a refused adapter leaves the loaded ones as they were
                return self._lora_reply(False, str(err))
        return self._lora_reply(True)

    async def load_lora_adapter(self, request):
        """SGLang's /load_lora_adapter from an HF PEFT directory (LoRAConfig reads its adapter_config.json, each TP
        rank its *.safetensors); the directory's digest manifest, when it has one, is checked first. Loaded between
        two decode steps, no pause."""
        from megatron_spo.rollout.engine_lora import read_peft_dir

        try:
            body = parse_body(LoadLoraAdapterRequest, await _json(request), "/load_lora_adapter")
        except ProtocolError as err:
            return self._lora_reply(False, str(err))
        if self.engine.lora is None:
            return self._lora_reply(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        async with self.lora_lock:
            try:
                config, tensors = await asyncio.to_thread(read_peft_dir, body.lora_path)
                await self.on_scheduler(self.engine.lora.load, body.lora_name, config, tensors)
            except Exception as err:  # a refused adapter leaves the loaded ones as they were
                return self._lora_reply(False, str(err))
            self.lora_paths[body.lora_name] = body.lora_path
        return self._lora_reply(True)

    async def unload_lora_adapter(self, request):
        """New requests can no longer select it at once; it goes when the requests using it have finished."""
        try:
            body = parse_body(UnloadLoraAdapterRequest, await _json(request), "/unload_lora_adapter")
        except ProtocolError as err:
            return self._lora_reply(False, str(err))
        lora = self.engine.lora
        if lora is None:
            return self._lora_reply(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        name = body.lora_name
        async with self.lora_lock:
            if name not in lora.adapters or name in self.unloading:
                return self._lora_reply(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                        f"{[a for a in lora.adapters if a not in self.unloading]}")
            self.unloading.add(name)
            try:
                while any(r.lora == name for r in await self.on_scheduler(self.scheduler.live_reqs)):
                    await asyncio.sleep(0.02)
                await self.on_scheduler(lora.unload, name)
                self.lora_paths.pop(name, None)
            finally:
                self.unloading.discard(name)
        return self._lora_reply(True)


def _check_routed_experts_start(start: int, prompt_tokens: int) -> None:
    """SGLang's scheduler (handle_generate_request) refuses these, in its words."""
    if start < 0:
        raise ProtocolError(f"recv_req.routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                            "routed_experts_start_len.")
    if start > prompt_tokens:
        raise ProtocolError(f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                            f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller routed_experts_start_len.")


def _sample_rids(rid: str | list[str] | None, num_prompts: int, n: int) -> list[str]:
    """One id per sample, prompt-major, as SGLang assigns them: the given rid for one prompt and n = 1,
    rid_i for a batch of one string rid, the listed rids for n = 1, and fresh ids for every sample of n > 1
    (SGLang regenerates them; the request's rid is not echoed)."""
    if n > 1:
        return [uuid.uuid4().hex for _ in range(num_prompts * n)]
    if isinstance(rid, list):
        return list(rid)
    if isinstance(rid, str):
        return [rid] if num_prompts == 1 else [f"{rid}_{i}" for i in range(num_prompts)]
    return [uuid.uuid4().hex for _ in range(num_prompts)]


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def _json(request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {}


def _json_float(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None  # SGLang sends -inf / NaN as null


def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class _DropGrpcProbes(logging.Filter):
    """sglang-router probes workers over gRPC (an HTTP/2 preface) when HTTP health fails: not our error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "PRI/Upgrade" in str(record.exc_info[1]))


def build_parser() -> argparse.ArgumentParser:
    """megatron-spo serve's flags (SGLang's names where SGLang has the flag)."""
    parser = argparse.ArgumentParser(prog="megatron-spo serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory (config + safetensors + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling RNG for unseeded requests")
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences per forward batch")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--tp-size", type=int, default=1,
                        help="ranks this engine takes in a weight-update group (stands in for SGLang's TP size)")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="sampling_seed takes effect (SGLang's flag; the n samples of a request share it)")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters loaded at run time (SGLang's flag; needs the two below)")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank it takes")
    parser.add_argument("--lora-target-modules", nargs="*", default=None,
                        help="HF module names adapters may target (q_proj k_proj v_proj o_proj gate_proj up_proj "
                             "down_proj, or all)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="requests may ask return_routed_experts (a mixture-of-experts model's routing, SGLang's)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--health-timeout", type=float, default=None,
                        help="seconds /health waits while generation is paused before it answers 503, as SGLang's "
                             "one-token health generation does (default: SGLANG_HEALTH_CHECK_TIMEOUT or 20)")
    parser.add_argument("--log-level", default="info")
    return parser


def main(argv: list[str]) -> int:
    import torch

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s engine:%(port)s %(levelname)s %(message)s"
                        .replace("%(port)s", str(args.port)))
    logging.getLogger("aiohttp.server").addFilter(_DropGrpcProbes())
    if not os.path.isdir(args.model):
        parser.error(f"--model '{args.model}' is not a directory")
    if args.tp_size < 1:
        parser.error(f"--tp-size must be >= 1, got {args.tp_size}")
    lora = None
    if args.enable_lora:
        if not args.max_lora_rank or not args.lora_target_modules:
            parser.error("--enable-lora needs --max-lora-rank and --lora-target-modules (there are no --lora-paths "
                         "to infer them from)")
        lora = {"max_rank": args.max_lora_rank, "target_modules": args.lora_target_modules}
    elif args.max_lora_rank or args.lora_target_modules:
        parser.error("--max-lora-rank / --lora-target-modules need --enable-lora")
    if args.threads:
        torch.set_num_threads(args.threads)
    from aiohttp import web

    from megatron_spo.memory import MemoryPreflightError

    try:
        engine = LocalEngine(args.model, dtype=args.dtype, device=args.device, seed=args.seed, tp_size=args.tp_size,
                             deterministic=args.enable_deterministic_inference, lora=lora,
                             return_routed_experts=args.enable_return_routed_experts)
    except (MemoryPreflightError, ValueError) as err:  # ValueError: a LoRA flag the engine cannot serve
        print(f"megatron-spo serve: error: {err}", file=sys.stderr)
        return 2
    server = EngineServer(engine, host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                          served_model_name=args.served_model_name, health_timeout_s=args.health_timeout)
    log.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    web.run_app(server.build_app(), host=args.host, port=args.port, print=None, access_log=None,
                handler_cancellation=True)  # a client that disconnects cancels its /generate
    return 0
