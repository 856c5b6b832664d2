"""A local generation engine on transformers, speaking the SGLang HTTP subset the project uses.

    megatron-spo serve --model HF_DIR --port 30000

Endpoints: /generate, /health, /health_generate, /get_model_info (/model_info), /get_server_info
(/server_info), /get_weight_version, /flush_cache, /update_weights_from_disk, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group, /update_weight_version. Request and
response shapes are SGLang's (see protocol.py). It is a real engine at small scale: batched sampling with
a KV cache, per-row temperature/top-p/top-k/min-p/seed, stop tokens, n samples per prompt.

All model work (generation and weight loads) runs on one worker thread, so a weight update never
interleaves with a batch; requests that arrive while a batch runs are batched together next.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import glob
import inspect
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_spo.rollout.protocol import (
    TOP_K_ALL,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    ProtocolError,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    parse_body,
)

log = logging.getLogger("megatron_spo.engine")

RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")


@dataclass
class SampleRow:
    """One sequence to generate: a prompt, its sampling params, and its response id."""

    prompt: list[int]
    params: SamplingParams
    rid: str
    sample_index: int = 0


@dataclass
class SampleResult:
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] = field(default_factory=dict)


class LocalEngine:
    """A HF causal LM on CPU (or one GPU) with SGLang's sampling semantics. Thread-compatible, not
    thread-safe: call from one thread."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0):
        from transformers import AutoModelForCausalLM

        self.model_path = os.path.abspath(model_dir)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        # transformers >= 5.24 names the KV cache argument `cache` (`past_key_values` is deprecated there)
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self.tokenizer = _load_tokenizer(self.model_path)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_context_length = int(getattr(cfg, "max_position_embeddings", 4096))
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.pad_id = self.eos_ids[0] if self.eos_ids else 0
        self.weight_version = "default"  # SGLang's initial weight_version
        self.rng = torch.Generator().manual_seed(seed)
        self.update_groups: dict[str, Any] = {}

    # ---------------------------------------------------------------------------------------------
    # generation
    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, rows: list[SampleRow]) -> list[SampleResult]:
        """Generate every row in one left-padded batch with a KV cache."""
        if not rows:
            return []
        for row in rows:
            if len(row.prompt) + row.params.max_new_tokens > self.max_context_length:
                raise ProtocolError(
                    f"prompt of {len(row.prompt)} tokens + max_new_tokens {row.params.max_new_tokens} exceeds "
                    f"the context length {self.max_context_length}"
                )
            bad = [t for t in row.prompt if t >= self.vocab_size]
            if bad:
                raise ProtocolError(f"input id {bad[0]} is outside the vocabulary of size {self.vocab_size}")
        batch = len(rows)
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row.prompt):] = torch.tensor(row.prompt)
            mask[i, width - len(row.prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        results = [SampleResult() for _ in rows]
        active = [r.params.max_new_tokens > 0 for r in rows]
        for i in range(batch):
            if not active[i]:
                results[i].finish = {"type": "length", "length": 0}
        if not any(active):
            return results
        generators = [self._generator(r) for r in rows]
        stop_sets = [self._stop_ids(r.params) for r in rows]
        temperature, top_p, top_k, min_p, greedy = self._sampling_tensors(rows)

        from transformers import DynamicCache

        cache = {self._cache_kwarg: DynamicCache()}  # filled in place by every forward call
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
        for _ in range(max(r.params.max_new_tokens for r in rows)):
            logits = out.logits[:, -1, :].float().cpu()  # sampling on CPU: per-row CPU generators
            tokens, logprobs = _sample(logits, temperature, top_p, top_k, min_p, greedy, generators)
            token_list, logprob_list = tokens.tolist(), logprobs.tolist()
            for i, row in enumerate(rows):
                if not active[i]:
                    continue
                tok = token_list[i]
                results[i].output_ids.append(tok)
                results[i].logprobs.append(logprob_list[i])
                if tok in stop_sets[i]:
                    results[i].finish = {"type": "stop", "matched": tok}
                    active[i] = False
                elif len(results[i].output_ids) >= row.params.max_new_tokens:
                    results[i].finish = {"type": "length", "length": row.params.max_new_tokens}
                    active[i] = False
            if not any(active):
                break
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=tokens[:, None].to(self.device), attention_mask=mask, position_ids=positions,
                             use_cache=True, **cache)
        return results

    def _generator(self, row: SampleRow) -> torch.Generator:
        if row.params.sampling_seed is None:
            return self.rng
        return torch.Generator().manual_seed((row.params.sampling_seed * 1_000_003 + row.sample_index) % (1 << 63))

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        stop = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop.update(self.eos_ids)
        return stop

    def _sampling_tensors(self, rows: list[SampleRow]):
        temperature = torch.tensor([[1.0 if r.params.is_greedy else r.params.temperature] for r in rows])
        top_p = torch.tensor([[r.params.top_p] for r in rows])
        top_k = torch.tensor([[TOP_K_ALL if r.params.top_k == -1 else r.params.top_k] for r in rows])
        min_p = torch.tensor([[r.params.min_p] for r in rows])
        greedy = torch.tensor([r.params.is_greedy for r in rows])
        return temperature, top_p, top_k, min_p, greedy

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------------------------------------
    # weights
    # ---------------------------------------------------------------------------------------------
    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the model. All names and shapes are checked before the first
        copy, so a bad update leaves the old weights intact."""
        params = self.model.state_dict(keep_vars=True)  # has both names of tied weights (lm_head / embed)
        for name, tensor in named:
            if name not in params:
                raise ValueError(f"unknown weight name '{name}'")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise ValueError(f"weight '{name}': shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in named:
                params[name].copy_(tensor.to(params[name].dtype))

    def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest) -> None:
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(req.model_path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in '{req.model_path}'")
        named: list[tuple[str, torch.Tensor]] = []
        for path in files:
            named.extend(load_file(path).items())
        self.load_named_tensors(named)
        if req.weight_version is not None:
            self.weight_version = req.weight_version

    def init_weights_update_group(self, req: InitWeightsUpdateGroupRequest) -> None:
        from megatron_spo.rollout.weight_sync import init_custom_process_group

        if req.group_name in self.update_groups:
            raise ValueError(f"group '{req.group_name}' already exists")
        self.update_groups[req.group_name] = init_custom_process_group(
            backend=req.backend, master_address=req.master_address, master_port=req.master_port,
            rank=req.rank_offset, world_size=req.world_size, group_name=req.group_name,
        )

    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributedRequest) -> None:
        from megatron_spo.rollout.weight_sync import receive_broadcast

        group = self.update_groups.get(req.group_name)
        if group is None:
            raise ValueError(f"group '{req.group_name}' not initialised: call /init_weights_update_group first")
        named = receive_broadcast(group, req.names, req.dtypes, req.shapes, req.load_format, self.device)
        self.load_named_tensors(named)
        if req.weight_version is not None:
            self.weight_version = req.weight_version

    def destroy_weights_update_group(self, group_name: str) -> None:
        group = self.update_groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"group '{group_name}' does not exist")
        torch.distributed.destroy_process_group(group)


def _sample(logits, temperature, top_p, top_k, min_p, greedy, generators):
    """SGLang's sampler on a [B, V] batch -> (tokens [B], log-probs [B]) with per-row settings.

    Log-probs are log softmax(logits / T) of the sampled token (raw log softmax for greedy rows or with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1), before top-p/top-k/min-p truncation, as SGLang reports them."""
    raw = torch.log_softmax(logits, dim=-1)
    scaled = torch.log_softmax(logits / temperature, dim=-1)
    probs_sorted, order = scaled.exp().sort(dim=-1, descending=True)
    rank = torch.arange(probs_sorted.shape[-1]).expand_as(probs_sorted)
    drop = rank >= top_k
    drop |= (probs_sorted.cumsum(-1) - probs_sorted) > top_p
    drop |= probs_sorted < min_p * probs_sorted[:, :1]
    probs_sorted = probs_sorted.masked_fill(drop, 0.0)
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    for i, gen in enumerate(generators):
        if greedy[i]:
            tokens[i] = logits[i].argmax()
        else:
            tokens[i] = order[i, torch.multinomial(probs_sorted[i], 1, generator=gen)[0]]
    report = torch.where(greedy[:, None], raw, raw if RETURN_ORIGINAL_LOGPROB else scaled)
    return tokens, report.gather(1, tokens[:, None])[:, 0]


def _load_tokenizer(model_dir: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as err:
        log.warning("no tokenizer in %s (%s): responses will have empty text", model_dir, err)
        return None


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        for tok in eos if isinstance(eos, list) else [eos]:
            if tok is not None and tok not in ids:
                ids.append(int(tok))
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


# -------------------------------------------------------------------------------------------------
# HTTP server
# -------------------------------------------------------------------------------------------------
class EngineServer:
    """aiohttp front: batches concurrent /generate calls onto the engine's worker thread."""

    def __init__(self, engine: LocalEngine, *, host: str, port: int, max_batch_size: int = 64,
                 served_model_name: str | None = None):
        self.engine = engine
        self.host, self.port = host, port
        self.max_batch_size = max_batch_size
        self.served_model_name = served_model_name or engine.model_path
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.pending: asyncio.Queue | None = None
        self.batcher: asyncio.Task | None = None

    async def on_startup(self, app) -> None:
        self.pending = asyncio.Queue()
        self.batcher = asyncio.create_task(self._batch_loop())

    async def on_cleanup(self, app) -> None:
        if self.batcher is not None:
            self.batcher.cancel()
        self.worker.shutdown(wait=False, cancel_futures=True)

    def build_app(self):
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        app.on_startup.append(self.on_startup)
        app.on_cleanup.append(self.on_cleanup)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/generate", self.generate)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/update_weight_version", self.update_weight_version)
        return app

    async def run_on_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    # --- info ------------------------------------------------------------------------------------
    async def health(self, request):
        from aiohttp import web

        return web.Response(status=200)

    async def model_info(self, request):
        from aiohttp import web

        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.engine.model_path, "tokenizer_path": self.engine.model_path,
            "served_model_name": self.served_model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
            "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
        })

    async def server_info(self, request):
        from aiohttp import web

        return web.json_response({
            "model_path": self.engine.model_path, "tokenizer_path": self.engine.model_path,
            "served_model_name": self.served_model_name, "max_context_length": self.engine.max_context_length,
            "version": "megatron-spo-local", "host": self.host, "port": self.port, "tp_size": 1, "dp_size": 1,
            "weight_version": self.engine.weight_version, "internal_states": [],
        })

    async def get_weight_version(self, request):
        from aiohttp import web

        return web.json_response({"weight_version": self.engine.weight_version})

    async def flush_cache(self, request):
        from aiohttp import web

        return web.Response(text="Cache flushed.\n", status=200)  # no cross-request prefix cache here

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
        num = len(req.prompts) * n
        if isinstance(req.rid, list):
            rids = [f"{rid}_{i}" if n > 1 else rid for rid in req.rid for i in range(n)]
        elif isinstance(req.rid, str):
            rids = [req.rid] if num == 1 else [f"{req.rid}_{i}" for i in range(num)]
        else:
            rids = [uuid.uuid4().hex for _ in range(num)]
        rows = [SampleRow(prompt, params, rids[p * n + i], i) for p, prompt in enumerate(req.prompts) for i in range(n)]
        future = asyncio.get_running_loop().create_future()
        await self.pending.put((rows, future))
        try:
            results, version = await future
        except ProtocolError as err:
            return _error(400, str(err))
        except Exception as err:
            log.exception("generate failed")
            return _error(500, f"generation failed: {type(err).__name__}: {err}")
        latency = time.perf_counter() - start
        items = []
        for row, res in zip(rows, results):
            meta: dict[str, Any] = {
                "id": row.rid, "finish_reason": res.finish, "prompt_tokens": len(row.prompt),
                "completion_tokens": len(res.output_ids), "cached_tokens": 0, "weight_version": version,
                "e2e_latency": latency,
            }
            if req.return_logprob:
                meta["output_token_logprobs"] = [[_json_float(lp), tok, None] for lp, tok in
                                                 zip(res.logprobs, res.output_ids)]
            items.append({"text": self.engine.decode(res.output_ids, params.skip_special_tokens),
                          "output_ids": res.output_ids, "meta_info": meta})
        return web.json_response(items if (req.is_batch or n > 1) else items[0])

    async def _batch_loop(self) -> None:
        while True:
            batch = [await self.pending.get()]
            rows = len(batch[0][0])
            while not self.pending.empty() and rows < self.max_batch_size:
                item = self.pending.get_nowait()
                batch.append(item)
                rows += len(item[0])
            all_rows = [row for rows_i, _ in batch for row in rows_i]
            try:
                results, version = await self.run_on_worker(self._generate_with_version, all_rows)
            except Exception as err:  # a bad request must not poison the others: retry them one by one
                if len(batch) == 1:
                    if not batch[0][1].done():
                        batch[0][1].set_exception(err)
                    continue
                for rows_i, fut in batch:
                    try:
                        res = await self.run_on_worker(self._generate_with_version, rows_i)
                        if not fut.done():
                            fut.set_result(res)
                    except Exception as one_err:
                        if not fut.done():
                            fut.set_exception(one_err)
                continue
            offset = 0
            for rows_i, fut in batch:
                if not fut.done():
                    fut.set_result((results[offset:offset + len(rows_i)], version))
                offset += len(rows_i)

    def _generate_with_version(self, rows: list[SampleRow]):
        return self.engine.generate(rows), self.engine.weight_version

    # --- weights ---------------------------------------------------------------------------------
    async def _weight_op(self, request, cls, endpoint: str, op):
        from aiohttp import web

        try:
            req = parse_body(cls, await request.json(), endpoint)
        except (ProtocolError, ValueError) as err:
            return _error(400, str(err))
        try:
            await self.run_on_worker(op, req)
        except Exception as err:
            log.error("%s failed: %s", endpoint, err)
            return web.json_response({"success": False, "message": f"{endpoint} failed: {err}"}, status=400)
        log.info("%s ok: weight_version=%s", endpoint, self.engine.weight_version)
        return web.json_response({"success": True, "message": f"{endpoint} succeeded",
                                  "num_paused_requests": 0, "weight_version": self.engine.weight_version})

    async def update_weights_from_disk(self, request):
        return await self._weight_op(request, UpdateWeightsFromDiskRequest, "/update_weights_from_disk",
                                     self.engine.update_weights_from_disk)

    async def init_weights_update_group(self, request):
        return await self._weight_op(request, InitWeightsUpdateGroupRequest, "/init_weights_update_group",
                                     self.engine.init_weights_update_group)

    async def update_weights_from_distributed(self, request):
        return await self._weight_op(request, UpdateWeightsFromDistributedRequest,
                                     "/update_weights_from_distributed", self.engine.update_weights_from_distributed)

    async def destroy_weights_update_group(self, request):
        from aiohttp import web

        body = await request.json()
        try:
            await self.run_on_worker(self.engine.destroy_weights_update_group,
                                     body.get("group_name", "weight_update_group"))
        except ValueError as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response({"success": True, "message": "destroyed"})

    async def update_weight_version(self, request):
        from aiohttp import web

        body = await request.json()
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return _error(400, "/update_weight_version: new_version must be a string")
        self.engine.weight_version = version
        return web.json_response({"success": True, "message": "ok", "new_version": version})


def _json_float(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None  # SGLang sends -inf / NaN as null


def _error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class _DropGrpcProbes(logging.Filter):
    """sglang-router probes workers over gRPC (an HTTP/2 preface) when HTTP health fails: not our error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "PRI/Upgrade" in str(record.exc_info[1]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory (config + safetensors + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling RNG for unseeded requests")
    parser.add_argument("--max-batch-size", type=int, default=64, help="sequences per forward batch")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s engine:%(port)s %(levelname)s %(message)s"
                        .replace("%(port)s", str(args.port)))
    logging.getLogger("aiohttp.server").addFilter(_DropGrpcProbes())
    if not os.path.isdir(args.model):
        parser.error(f"--model '{args.model}' is not a directory")
    if args.threads:
        torch.set_num_threads(args.threads)
    from aiohttp import web

    engine = LocalEngine(args.model, dtype=args.dtype, device=args.device, seed=args.seed)
    server = EngineServer(engine, host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                          served_model_name=args.served_model_name)
    log.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    web.run_app(server.build_app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0
