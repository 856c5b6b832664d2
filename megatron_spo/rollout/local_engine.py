"""The local generation engine: a HF causal LM (transformers) with SGLang's sampling and scheduling rules.

``LocalEngine`` holds the model: sampling with SGLang's semantics, batches decoded one token per step, weight
loading. ``Scheduler`` owns it on one thread and plays the part of SGLang's scheduler (sglang 0.5.23,
managers/scheduler.py and scheduler_components/weight_updater.py): it decodes batches step by step and,
between two steps, carries out control operations with SGLang's rules:

- pause ``retract``: running requests go back to the waiting queue with their output so far (their KV is
  recomputed under the weights in force when they resume); ``in_place``: the batch stays where it is (a
  cache flush then fails: requests still run); ``abort`` is handled by the HTTP front (engine_server.py);
- a weight update from the distributed group runs only inside a session opened by begin_weight_update and
  closed by end_weight_update (disk updates need none);
- an update with flush_cache fails, after loading the weights, when requests are running (or waiting while
  not paused);
- a weight version change is recorded in every live request that already has output, so each response
  says which version produced which of its tokens (meta_info.weight_versions);
- ``sampling_seed`` acts only with deterministic inference on, and then every sample of a request shares it
  (unseeded requests use seed 42): n samples of one seeded request are identical, as on SGLang;
- with LoRA enabled (``lora=``), a request samples from the adapter it names (``lora_path``; engine_lora.py); a
  batch holds the requests of one adapter, the next waiting adapter's requests form the next batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import glob
import inspect
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_spo.rollout.protocol import (
    TOP_K_ALL,
    InitWeightsUpdateGroupRequest,
    ProtocolError,
    SamplingParams,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)

log = logging.getLogger("megatron_spo.engine")

RETURN_ORIGINAL_LOGPROB = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes")
DETERMINISTIC_DEFAULT_SEED = 42  # SGLang's seed for unseeded rows under --enable-deterministic-inference

# SGLang's messages (scheduler_components/weight_updater.py), so a client sees the same text from either engine
NO_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
SESSION_CLOSED = "no weight-update session is open; call begin_weight_update() first"
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")


@dataclass
class Req:
    """One sequence to generate: one sample of a /generate request (SGLang's Req)."""

    prompt: list[int]
    params: SamplingParams
    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    version_events: list[tuple[str, int]] = field(default_factory=list)  # (version replaced, output tokens then)
    retractions: int = 0
    lora: str | None = None  # the adapter it samples from (None: the base model)
    routes: list[torch.Tensor] | None = None  # return_routed_experts: int32 [positions, layers, top_k] per forward
    spans: list[dict[str, Any]] | None = None  # weight_version_spans, taken when it finished
    error: BaseException | None = None
    on_finish: Callable[[Req], None] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish is not None or self.error is not None

    def weight_version_spans(self, current: str) -> list[dict[str, Any]]:
        """[{version, start, end}] over the output tokens (SGLang's compute_weight_version_spans)."""
        spans: list[dict[str, Any]] = []
        total = len(self.output_ids)
        for version, end in [*self.version_events, (current, total)]:
            end = min(end, total)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and version == spans[-1]["version"]:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return spans


def _is_moe(config) -> bool:
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def expert_target(params: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The view of a fused expert tensor (transformers 5: ``mlp.experts.gate_up_proj`` [E, 2F, H], gate rows first
    as its forward chunks them; ``mlp.experts.down_proj`` [E, H, F]) that an HF per-expert name fills: gate_proj
    [F, H] -> gate_up_proj[e, :F], up_proj -> gate_up_proj[e, F:], down_proj [H, F] -> down_proj[e]; None if the
    name is not one of them."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    fused = params.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if fused is None or fused.ndim != 3 or e >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused[e]
    half = fused.shape[1] // 2
    return fused[e, :half] if proj == "gate_proj" else fused[e, half:]


class RouteCapture:
    """The experts each MoE router chose in the last forward (SGLang's RoutedExpertsCapturer): a hook on every
    ``model.layers.{i}.mlp.gate`` (transformers' top-k routers return (logits, weights, indices))."""

    def __init__(self, model):
        self.gates = [m for name, m in model.named_modules()
                      if name.endswith(".mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")]
        if not self.gates:
            raise ValueError("--enable-return-routed-experts: the model has no mixture-of-experts routers")
        self.top_k = self.gates[0].top_k
        self.last: list[torch.Tensor | None] = [None] * len(self.gates)
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(lambda _m, _a, out, i=i: self.last.__setitem__(i, out[2]))

    def take(self, batch: int, positions: int) -> torch.Tensor:
        """The last forward's routes int32 [batch, positions, layers, top_k] (its input was [batch, positions])."""
        routes = torch.stack([t.reshape(batch, positions, self.top_k) for t in self.last], dim=2)
        self.last = [None] * len(self.gates)
        return routes.to(device="cpu", dtype=torch.int32)


def _preflight_load(model_dir: str, dtype: str, device: str) -> None:
    """The whole model in ``dtype`` (plus the process baseline) must fit in this machine's memory (CPU engines;
    a GPU's memory is SGLang's business): refuse in one line instead of meeting the OOM killer."""
    if not device.startswith("cpu"):
        return
    from megatron_spo.memory import BASELINE_BYTES, model_bytes, preflight
    from megatron_spo.models.hf_checkpoint import HFCheckpointError, read_hf_config

    try:
        cfg = read_hf_config(model_dir)
    except HFCheckpointError:  # a family the registry does not know: transformers may still load it
        return
    preflight(f"engine load of {model_dir}", BASELINE_BYTES + model_bytes(cfg, dtype),
              hint="serve it in bfloat16 (--dtype) or on a node with more memory")


class LocalEngine:
    """A HF causal LM on CPU (or one GPU) with SGLang's sampling semantics. Not thread-safe: one thread (the
    Scheduler's, or a test's) uses it.

    ``tp_size`` > 1 stands in for a tensor-parallel SGLang engine in the weight-update group: the engine joins
    the group as ranks rank_offset .. rank_offset + tp_size - 1 and every rank receives each broadcast, so a
    sender that counts the group wrong fails here as it would against a real TP engine."""

    def __init__(self, model_dir: str, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 tp_size: int = 1, deterministic: bool = False, lora: dict | None = None,
                 return_routed_experts: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM

        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.model_path = os.path.abspath(model_dir)
        self.device = torch.device(device)
        _preflight_load(self.model_path, dtype, device)
        kwargs = {}
        if _is_moe(AutoConfig.from_pretrained(self.model_path)):  # its grouped_mm refuses odd shapes on CPU
            kwargs["experts_implementation"] = "eager"
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype), **kwargs)
        self.model.to(self.device).eval()
        # --enable-return-routed-experts: every MoE router's top-k of each forward, for requests that ask
        self.routes = RouteCapture(self.model) if return_routed_experts else None
        # transformers >= 5.24 names the KV cache argument `cache` (`past_key_values` is deprecated there)
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self.tokenizer = _load_tokenizer(self.model_path)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_context_length = int(getattr(cfg, "max_position_embeddings", 4096))
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self.pad_id = self.eos_ids[0] if self.eos_ids else 0
        self.tp_size, self.deterministic = tp_size, deterministic
        self.rng = torch.Generator().manual_seed(seed)
        self.update_groups: dict[str, list] = {}  # group name -> one process group per TP rank
        self.lora = None  # engine_lora.EngineLora with --enable-lora: {"max_rank": R, "target_modules": [...]}
        if lora is not None:
            from megatron_spo.rollout.engine_lora import EngineLora

            self.lora = EngineLora(self.model, **lora)

    # ---------------------------------------------------------------------------------------------
    # generation
    # ---------------------------------------------------------------------------------------------
    def check(self, req: Req) -> None:
        """The server's admission checks (HTTP 400 on failure)."""
        if len(req.prompt) + req.params.max_new_tokens > self.max_context_length:
            raise ProtocolError(f"prompt of {len(req.prompt)} tokens + max_new_tokens {req.params.max_new_tokens} "
                                f"exceeds the context length {self.max_context_length}")
        bad = [t for t in req.prompt if t >= self.vocab_size]
        if bad:
            raise ProtocolError(f"input id {bad[0]} is outside the vocabulary of size {self.vocab_size}")

    def generate(self, reqs: list[Req]) -> list[Req]:
        """Decode ``reqs`` to the end in one batch (no scheduler): the same steps the Scheduler runs."""
        for req in reqs:
            self.check(req)
        batch = Batch(self, reqs)
        while not batch.done:
            batch.step()
        return reqs

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def generator(self, req: Req) -> torch.Generator:
        """Deterministic inference: a generator keyed by (seed, position), so a sample does not depend on its
        batch company or on being retracted; otherwise the engine's shared generator (seeds ignored)."""
        if not self.deterministic:
            return self.rng
        seed = DETERMINISTIC_DEFAULT_SEED if req.params.sampling_seed is None else req.params.sampling_seed
        position = len(req.prompt) + len(req.output_ids)
        return torch.Generator().manual_seed((seed * 1_000_003 + position) % (1 << 63))

    def stop_ids(self, params: SamplingParams) -> set[int]:
        stop = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop.update(self.eos_ids)
        return stop

    # ---------------------------------------------------------------------------------------------
    # weights
    # ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_named_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the model. All names and shapes are checked before the first
        copy, so a bad update leaves the old weights intact. Per-expert names (every push's and SGLang's) land
        in transformers' fused experts (expert_target)."""
        params = self.model.state_dict(keep_vars=True)  # has both names of tied weights (lm_head / embed)
        targets = []
        for name, tensor in named:
            target = params.get(name)
            if target is None:
                target = expert_target(params, name)
            if target is None:
                raise ValueError(f"unknown weight name '{name}'")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight '{name}': shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
            targets.append(target)
        for target, (_, tensor) in zip(targets, named):
            target.copy_(tensor.to(target.dtype))

    def load_from_disk(self, model_path: str) -> None:
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in '{model_path}'")
        named: list[tuple[str, torch.Tensor]] = []
        for path in files:
            named.extend(load_file(path).items())
        self.load_named_tensors(named)

    def init_weights_update_group(self, req: InitWeightsUpdateGroupRequest) -> None:
        """Join the sender's group as ranks rank_offset + tp_rank (concurrently: the rendezvous needs all)."""
        from megatron_spo.rollout.weight_sync import init_custom_process_group

        if req.group_name in self.update_groups:
            raise ValueError(f"group '{req.group_name}' already exists")

        def join(tp_rank: int):
            return init_custom_process_group(backend=req.backend, master_address=req.master_address,
                                             master_port=req.master_port, rank=req.rank_offset + tp_rank,
                                             world_size=req.world_size, group_name=req.group_name)

        self.update_groups[req.group_name] = _on_tp_ranks(self.tp_size, join)

    def receive_broadcast(self, req: UpdateWeightsFromDistributedRequest) -> list[tuple[str, torch.Tensor]]:
        """Every TP rank receives the round; rank 0's copy is loaded (the others hold the same bytes)."""
        from megatron_spo.rollout.weight_sync import receive_broadcast

        groups = self.update_groups.get(req.group_name)
        if groups is None:
            raise ValueError(f"Group {req.group_name} not in {list(self.update_groups)}. "
                             "Please call `init_weights_update_group` first.")
        received = _on_tp_ranks(self.tp_size, lambda r: receive_broadcast(
            groups[r], req.names, req.dtypes, req.shapes, req.load_format, self.device))
        return received[0]

    def destroy_weights_update_group(self, group_name: str) -> None:
        from megatron_spo.rollout.weight_sync import destroy_custom_process_group

        groups = self.update_groups.pop(group_name, None)
        if groups is None:
            raise ValueError("The group to be destroyed does not exist.")
        for group in groups:
            destroy_custom_process_group(group)


@contextlib.contextmanager
def _nothing():
    yield


def _on_tp_ranks(tp_size: int, fn: Callable[[int], Any]) -> list:
    if tp_size == 1:
        return [fn(0)]
    with concurrent.futures.ThreadPoolExecutor(tp_size) as pool:
        return list(pool.map(fn, range(tp_size)))


class Batch:
    """Requests decoded together: one left-padded prefill of prompt + output so far (a retracted request
    resumes), then one token per ``step``. The forward pass runs at the start of a step, so a step after a
    weight update samples from the new weights."""

    def __init__(self, engine: LocalEngine, reqs: list[Req]):
        from transformers import DynamicCache

        self.engine, self.reqs = engine, reqs
        self.lora = reqs[0].lora  # the scheduler batches the requests of one adapter
        if any(r.lora != self.lora for r in reqs):
            raise ValueError("a batch holds the requests of one LoRA adapter")
        self.active = [not r.finished for r in reqs]
        for i, r in enumerate(reqs):
            if self.active[i] and len(r.output_ids) >= r.params.max_new_tokens:
                self._finish(i, {"type": "length", "length": r.params.max_new_tokens})
        contexts = [r.prompt + r.output_ids for r in reqs]
        self.new_positions = [len(c) for c in contexts]  # what the next forward feeds of each row (prefill)
        for r in reqs:
            if r.routes is not None:  # a resumed request's prefill routes its whole context again
                r.routes = []
        width = max(len(c) for c in contexts)
        ids = torch.full((len(reqs), width), engine.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c)
            mask[i, width - len(c):] = 1
        self.mask = mask.to(engine.device)
        self.next_ids = ids.to(engine.device)
        self.next_positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = {engine._cache_kwarg: DynamicCache()}  # filled in place by every forward call
        self.stop_sets = [engine.stop_ids(r.params) for r in reqs]
        greedy = [r.params.is_greedy for r in reqs]
        self.temperature = torch.tensor([[1.0 if g else r.params.temperature] for g, r in zip(greedy, reqs)])
        self.top_p = torch.tensor([[r.params.top_p] for r in reqs])
        self.top_k = torch.tensor([[TOP_K_ALL if r.params.top_k == -1 else r.params.top_k] for r in reqs])
        self.min_p = torch.tensor([[r.params.min_p] for r in reqs])
        self.greedy = torch.tensor(greedy)
        self.finished_now: list[Req] = []

    @property
    def done(self) -> bool:
        return not any(self.active)

    def unfinished(self) -> list[Req]:
        return [r for r, a in zip(self.reqs, self.active) if a]

    def _finish(self, i: int, reason: dict[str, Any]) -> None:
        self.reqs[i].finish = reason
        self.active[i] = False
        self.finished_now.append(self.reqs[i])

    def finish(self, req: Req, reason: dict[str, Any]) -> None:
        """End one request now (an abort); its row is still fed but nothing more is sampled for it."""
        self._finish(self.reqs.index(req), reason)

    @torch.no_grad()
    def step(self) -> list[Req]:
        """Sample one token for every active request; returns the requests that finished (this step or by a
        ``finish`` since the last step)."""
        engine = self.engine
        with engine.lora.active(self.lora) if engine.lora is not None else _nothing():
            out = engine.model(input_ids=self.next_ids, attention_mask=self.mask, position_ids=self.next_positions,
                               use_cache=True, **self.cache)
        if engine.routes is not None:
            routes = engine.routes.take(*self.next_ids.shape)
            for i, (req, n) in enumerate(zip(self.reqs, self.new_positions)):
                if self.active[i] and req.routes is not None:  # the row's real (left-padded) positions
                    req.routes.append(routes[i, routes.shape[1] - n:])
            self.new_positions = [1] * len(self.reqs)
        logits = out.logits[:, -1, :].float().cpu()  # sampling on CPU: per-row CPU generators
        generators = [engine.generator(r) for r in self.reqs]
        tokens, logprobs = _sample(logits, self.temperature, self.top_p, self.top_k, self.min_p, self.greedy,
                                   generators)
        for i, (req, tok, lp) in enumerate(zip(self.reqs, tokens.tolist(), logprobs.tolist())):
            if not self.active[i]:
                continue
            req.output_ids.append(tok)
            req.logprobs.append(lp)
            if tok in self.stop_sets[i]:
                self._finish(i, {"type": "stop", "matched": tok})
            elif len(req.output_ids) >= req.params.max_new_tokens:
                self._finish(i, {"type": "length", "length": req.params.max_new_tokens})
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.reqs), 1))], dim=1)
        self.next_positions = self.next_positions[:, -1:] + 1
        self.next_ids = tokens[:, None].to(engine.device)
        finished, self.finished_now = self.finished_now, []
        return finished


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


# -------------------------------------------------------------------------------------------------
# The scheduler: one thread owns the engine
# -------------------------------------------------------------------------------------------------
class Scheduler:
    """Runs requests on ``engine`` from one thread, SGLang's scheduler rules (module docstring).

    Thread-safe entry points: ``submit(reqs)`` (each req's on_finish is called on the scheduler thread) and
    ``call(fn, *args)`` -> concurrent Future (fn runs on the scheduler thread between two decode steps)."""

    def __init__(self, engine: LocalEngine, *, max_batch_size: int = 64):
        self.engine, self.max_batch_size = engine, max_batch_size
        self.weight_version = "default"  # SGLang's initial weight_version
        self.waiting: collections.deque[Req] = collections.deque()
        self.batch: Batch | None = None
        self.paused: str | None = None  # "retract" | "in_place" while paused
        self.session_open = False
        self.weights_partial = False  # a session loaded some weights and has not set a version yet
        # requests retracted and aborted by pauses; tokens sampled while a session had loaded only some buckets
        self.stats = collections.Counter(
            dict.fromkeys(("retracted", "aborted", "tokens_sampled_with_partial_weights"), 0))
        self._ops: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, reqs: list[Req]) -> None:
        with self._cond:
            self.waiting.extend(reqs)
            self._cond.notify_all()

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._ops.append((fn, args, future))
            self._cond.notify_all()
        return future

    # --- the loop --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._ops and (self.paused or (self.batch is None and not self.waiting)):
                    if self._stopped:
                        return
                    self._cond.wait()
                if self._stopped:
                    return
                ops = list(self._ops)
                self._ops.clear()
                if not ops and self.batch is None and not self.paused:
                    self.batch = self._admit()
            for fn, args, future in ops:
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # the caller gets it; the loop goes on
                    future.set_exception(err)
            if ops or self.paused or self.batch is None:
                continue
            try:
                finished = self.batch.step()
                if self.weights_partial:
                    self.stats["tokens_sampled_with_partial_weights"] += len(self.batch.unfinished()) + len(finished)
            except Exception as err:
                log.exception("decode step failed")
                finished = self.batch.unfinished()
                for req in finished:
                    req.error = err
                self.batch.active = [False] * len(self.batch.reqs)
            self._deliver(finished)
            if self.batch.done:
                self.batch = None

    def _admit(self) -> Batch | None:
        """Next batch from the waiting queue (called with the lock held)."""
        if not self.waiting:
            return None
        lora, reqs, others = self.waiting[0].lora, [], collections.deque()
        while self.waiting and len(reqs) < self.max_batch_size:  # the first waiting request's adapter, in order
            req = self.waiting.popleft()
            (reqs if req.lora == lora else others).append(req)
        self.waiting.extendleft(reversed(others))
        batch = Batch(self.engine, reqs)
        self._deliver(batch.finished_now)  # max_new_tokens 0, or a retracted request that had reached it
        batch.finished_now = []
        return None if batch.done else batch

    def _deliver(self, reqs: list[Req]) -> None:
        for req in reqs:
            req.spans = req.weight_version_spans(self.weight_version)  # now, not when the answer is written
            if req.on_finish is not None:
                req.on_finish(req)

    # --- control operations (run on the scheduler thread through call()) --------------------------
    def live_reqs(self) -> list[Req]:
        with self._cond:
            waiting = list(self.waiting)
        return (self.batch.unfinished() if self.batch is not None else []) + waiting

    def pause(self, mode: str) -> None:
        if mode not in ("retract", "in_place"):
            raise ValueError(f"scheduler pause mode must be retract or in_place, got {mode!r}")
        self.paused = mode
        if mode == "retract" and self.batch is not None:
            retracted = self.batch.unfinished()
            for req in retracted:
                req.retractions += 1
            self.stats["retracted"] += len(retracted)
            with self._cond:
                self.waiting.extendleft(reversed(retracted))  # first in line when generation continues
            self.batch = None

    def resume(self) -> None:
        self.paused = None

    def abort(self, rid: str = "", abort_all: bool = False, reqs: list[Req] | None = None) -> int:
        """Finish matching requests now with finish_reason abort (their output so far is returned): all, those
        whose rid starts with ``rid`` (SGLang matches a prefix), or the given ``reqs``."""
        def match(req: Req) -> bool:
            return abort_all or (bool(rid) and req.rid.startswith(rid)) or (reqs is not None and req in reqs)

        reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        with self._cond:
            dropped = [r for r in self.waiting if match(r)]
            self.waiting = collections.deque(r for r in self.waiting if not match(r))
        for req in dropped:
            req.finish = dict(reason)
        if self.batch is not None:
            for req in self.batch.unfinished():
                if match(req):
                    self.batch.finish(req, dict(reason))
            dropped += self.batch.finished_now
            self.batch.finished_now = []
            if self.batch.done:
                self.batch = None
        self.stats["aborted"] += len(dropped)
        self._deliver(dropped)
        return len(dropped)

    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        running = self.batch is not None and not self.batch.done
        with self._cond:
            waiting = bool(self.waiting)
        return not running and (ignore_waiting or not waiting)

    def flush_cache(self) -> bool:
        """SGLang's rule: refused while requests run (or wait, unless paused). No prefix cache to drop here."""
        return self.is_fully_idle(ignore_waiting=self.paused is not None)

    def record_weight_version(self, new_version: str | None) -> None:
        """SGLang's record_weight_version_change: live requests with output remember the version they had."""
        if new_version is None or new_version == self.weight_version:
            return
        for req in self.live_reqs():
            if req.output_ids:
                req.version_events.append((self.weight_version, len(req.output_ids)))
        self.weight_version = new_version

    def _after_update(self, flush: bool, version: str | None) -> tuple[bool, str]:
        self.record_weight_version(version)
        if flush and not self.flush_cache():
            return False, FLUSH_REFUSED
        return True, "Succeeded to update model weights."

    def begin_weight_update(self) -> tuple[bool, str]:
        if self.session_open:
            return False, SESSION_OPEN
        self.session_open = True
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        if not self.session_open:
            return False, SESSION_CLOSED
        self.session_open = self.weights_partial = False
        return True, "Success"

    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributedRequest) -> tuple[bool, str]:
        if not self.session_open:
            return False, NO_SESSION
        try:
            named = self.engine.receive_broadcast(req)
        except Exception as err:
            return False, f"Failed to receive weights: {err}"
        try:
            self.engine.load_named_tensors(named)
        except Exception as err:
            return False, (f"Failed to update parameter online: {err}. The full weights of the ModelRunner are "
                           "partially updated. Please discard the whole weights.")
        self.weights_partial = req.weight_version is None
        return self._after_update(req.flush_cache, req.weight_version)

    def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest) -> tuple[bool, str]:
        try:
            self.engine.load_from_disk(req.model_path)
        except Exception as err:  # the loader checks every name and shape first: the old weights stay
            return False, f"Failed to update weights: {err}.\nRolling back to original weights."
        return self._after_update(req.flush_cache, req.weight_version)

    def update_weight_version(self, version: str) -> None:
        self.record_weight_version(version)


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
