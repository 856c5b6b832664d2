"""The subset of SGLang's HTTP API the project speaks, as typed dataclasses.

Field names, defaults and JSON shapes follow sglang 0.5.23 (``sglang/api/v1/api_types.py`` for
/generate, ``sglang/srt/managers/io_struct.py`` for the weight-update bodies); tests check our bodies
against those definitions. Pure data: no HTTP, no torch.

Behaviour log-probs: SGLang (default settings) reports, for each sampled token, log softmax(logits / T)
of the temperature-scaled distribution before top-p/top-k/min-p truncation; with greedy decoding
(T = 0, i.e. top_k = 1) and with SGLANG_RETURN_ORIGINAL_LOGPROB=1 it reports the raw log softmax(logits).
The local engine reports the same quantities.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SAMPLING_EPS = 1e-6  # SGLang: a temperature below this means greedy (top_k = 1, temperature 1)
TOP_K_ALL = 1 << 30


class ProtocolError(ValueError):
    """A request or response that does not fit the protocol (an HTTP 400 on the server side)."""


@dataclass
class SamplingParams:
    """The sampling keys the project sends (all are SGLang SamplingParams fields)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        return {k: v for k, v in body.items() if v is not None}

    @classmethod
    def from_json(cls, body: Any) -> SamplingParams:
        """Parse and range-check a sampling_params dict; unknown keys are refused (as SGLang does)."""
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ProtocolError(f"sampling_params must be an object, got {type(body).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(body) - known - set(_DEFAULT_ONLY_SAMPLING_KEYS))
        if unknown:
            raise ProtocolError(f"sampling_params: unsupported field(s) {unknown}")
        for key, default in _DEFAULT_ONLY_SAMPLING_KEYS.items():
            if body.get(key) not in (None, default):
                raise ProtocolError(f"sampling_params.{key}={body[key]!r} is not supported by the local engine "
                                    f"(only the default {default!r})")
        kwargs = {k: v for k, v in body.items() if k in known and v is not None}
        params = cls(**kwargs)
        params.verify()
        return params

    def verify(self) -> None:
        """SGLang's range checks (sampling_params.py: SamplingParams.verify)."""
        checks = [
            ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "an integer >= 0"),
            ("temperature", _is_num(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
             "a non-negative finite number"),
            ("top_p", _is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", _is_int(self.top_k) and (self.top_k >= 1 or self.top_k == -1), "-1 (disable) or >= 1"),
            ("min_p", _is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("n", _is_int(self.n) and self.n >= 1, "an integer >= 1"),
            ("stop_token_ids", self.stop_token_ids is None or (isinstance(self.stop_token_ids, list) and all(
                _is_int(t) for t in self.stop_token_ids)), "a list of integers"),
            ("sampling_seed", self.sampling_seed is None or _is_int(self.sampling_seed), "an integer"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a boolean"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "a boolean"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ProtocolError(f"sampling_params.{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


# SGLang keys the local engine does not implement: accepted at their SGLang default (the router may fill
# them in), refused otherwise, so a request never silently means something else.
_DEFAULT_ONLY_SAMPLING_KEYS: dict[str, Any] = {
    "stop": [], "stop_regex": [], "min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "logit_bias": {}, "choice": [], "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "custom_params": None, "beam_width": None, "watermark": None,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None,
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class GenerateRequest:
    """POST /generate. ``input_ids`` is one prompt (list[int]) or a batch (list[list[int]])."""

    input_ids: list[int] | list[list[int]]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    rid: str | list[str] | None = None
    lora_path: str | None = None  # the name of a loaded LoRA adapter; None: the base model
    # routing replay: the experts every MoE router chose for each position in [routed_experts_start_len, prompt +
    # output - 1), in meta_info["routed_experts"] (engines started with --enable-return-routed-experts)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0

    @property
    def is_batch(self) -> bool:
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def prompts(self) -> list[list[int]]:
        return self.input_ids if self.is_batch else [self.input_ids]  # type: ignore[return-value]

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": self.input_ids,
            "sampling_params": self.sampling_params.to_json(),
            "return_logprob": self.return_logprob,
        }
        if self.rid is not None:
            body["rid"] = self.rid
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        if self.return_routed_experts:
            body["return_routed_experts"] = True
            if self.routed_experts_start_len:
                body["routed_experts_start_len"] = self.routed_experts_start_len
        return body

    @classmethod
    def from_json(cls, body: Any) -> GenerateRequest:
        """Server-side parse. Unknown top-level keys are ignored (SGLang drops them too)."""
        if not isinstance(body, dict):
            raise ProtocolError(f"/generate body must be a JSON object, got {type(body).__name__}")
        if body.get("text") is not None:
            raise ProtocolError("/generate: 'text' prompts are not supported by this engine; send input_ids")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise ProtocolError("/generate: input_ids must be a non-empty list of token ids or of lists")
        prompts = ids if isinstance(ids[0], list) else [ids]
        for i, p in enumerate(prompts):
            if not p or not all(_is_int(t) and t >= 0 for t in p):
                raise ProtocolError(f"/generate: input_ids[{i}] must be a non-empty list of non-negative ints")
        sp = body.get("sampling_params")
        if isinstance(sp, list):
            raise ProtocolError("/generate: a list of sampling_params is not supported; send one object")
        rlp = body.get("return_logprob") or False
        if not isinstance(rlp, bool):
            raise ProtocolError("/generate: return_logprob must be a boolean")
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, (str, list)):
            raise ProtocolError("/generate: rid must be a string or a list of strings")
        if isinstance(rid, list) and len(rid) != len(prompts):
            raise ProtocolError(f"/generate: {len(rid)} rids for a batch of {len(prompts)} prompts")
        lora = body.get("lora_path")
        if lora is not None and not isinstance(lora, str):
            raise ProtocolError("/generate: lora_path must be one adapter name (a string) for the whole request")
        routed = body.get("return_routed_experts") or False
        if not isinstance(routed, bool):
            raise ProtocolError("/generate: return_routed_experts must be a boolean")
        start = body.get("routed_experts_start_len") or 0
        if not _is_int(start):
            raise ProtocolError("/generate: routed_experts_start_len must be an integer")
        return cls(input_ids=ids, sampling_params=SamplingParams.from_json(sp), return_logprob=rlp, rid=rid,
                   lora_path=lora, return_routed_experts=routed, routed_experts_start_len=start)


@dataclass
class Completion:
    """One sample of a /generate response (the client's parsed view)."""

    rid: str
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    weight_version: str | None  # the version at the end of the sample
    logprobs: list[float] | None  # log-prob of each output token under the sampling distribution
    # (version, start, end) over the output tokens: more than one when weights changed mid-sample (SGLang
    # meta_info.weight_versions; None when the engine does not report it)
    weight_versions: list[tuple[str, int, int]] | None = None
    num_retractions: int = 0
    # meta_info["routed_experts"]: base64 int32 [positions, layers, top_k] (data/routes.py); None when not asked,
    # or when the engine was not started with --enable-return-routed-experts (SGLang then sends nothing)
    routed_experts: str | None = None

    @property
    def versions(self) -> list[str]:
        """Every weight version that produced a token of this sample (oldest first)."""
        if self.weight_versions:
            return [v for v, _, _ in self.weight_versions]
        return [] if self.weight_version is None else [self.weight_version]

    @classmethod
    def from_json(cls, item: Any) -> Completion:
        """Parse one response item; raises ProtocolError for anything malformed (a garbage engine)."""
        try:
            meta = item["meta_info"]
            output_ids = [int(t) for t in item["output_ids"]]
            finish = meta.get("finish_reason") or {}
            finish_type = finish.get("type") if isinstance(finish, dict) else str(finish)
            entries = meta.get("output_token_logprobs")
            logprobs = None
            if entries is not None:
                if len(entries) != len(output_ids):
                    raise ProtocolError(f"{len(entries)} logprob entries for {len(output_ids)} output ids")
                logprobs = []
                for entry, tok in zip(entries, output_ids):
                    lp, tid = entry[0], int(entry[1])
                    if tid != tok:
                        raise ProtocolError(f"logprob entry token {tid} != output id {tok}")
                    logprobs.append(float("-inf") if lp is None else float(lp))
            spans = meta.get("weight_versions")
            if spans is not None:
                spans = [(str(sp["version"]), int(sp["start"]), int(sp["end"])) for sp in spans]
            return cls(
                rid=str(meta["id"]),
                output_ids=output_ids,
                text=str(item.get("text", "")),
                finish_reason=str(finish_type),
                prompt_tokens=int(meta["prompt_tokens"]),
                completion_tokens=int(meta["completion_tokens"]),
                weight_version=None if meta.get("weight_version") is None else str(meta["weight_version"]),
                logprobs=logprobs,
                weight_versions=spans,
                num_retractions=int(meta.get("num_retractions") or 0),
                routed_experts=_optional_str(meta.get("routed_experts"), "routed_experts"),
            )
        except ProtocolError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
            raise ProtocolError(f"malformed /generate item: {type(err).__name__}: {err}") from None


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"meta_info.{name} must be a string, got {type(value).__name__}")
    return value


def parse_generate_response(body: Any, num_prompts: int, n: int) -> list[list[Completion]]:
    """Response JSON -> completions grouped per prompt ([prompt][sample]); checks the count."""
    items = body if isinstance(body, list) else [body]
    if len(items) != num_prompts * n:
        raise ProtocolError(f"expected {num_prompts * n} completions, got {len(items)}")
    flat = [Completion.from_json(item) for item in items]
    return [flat[p * n:(p + 1) * n] for p in range(num_prompts)]  # SGLang orders n > 1 prompt-major


# --------------------------------------------------------------------------------------------------
# Weight-update bodies (sglang io_struct: UpdateWeightFromDiskReqInput, InitWeightsUpdateGroupReqInput,
# UpdateWeightsFromDistributedReqInput)
# --------------------------------------------------------------------------------------------------
PAUSE_MODES = ("abort", "retract", "in_place")
# A weight push pauses with these: in_place leaves requests running, and SGLang then refuses the flush.
SYNC_PAUSE_MODES = tuple(mode for mode in PAUSE_MODES if mode != "in_place")


@dataclass
class PauseGenerationRequest:
    """abort: in-flight requests end with finish_reason abort; retract: they wait, and resume (their KV
    recomputed) under the new weights; in_place: they stay (SGLang then refuses to flush the cache)."""

    mode: str = "abort"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class UpdateWeightsFromDiskRequest:
    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class InitWeightsUpdateGroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class UpdateWeightsFromDistributedRequest:
    """One broadcast round: tensors named/typed/shaped in send order. ``load_format="flattened_bucket"``
    means one uint8 broadcast holding all tensors back to back (SGLang's FlattenedTensorBucket);
    None means one broadcast per tensor."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class UpdateWeightVersionRequest:
    """POST /update_weight_version: the engine's weight_version becomes new_version (an adapter push sets it
    after loading the adapter, with abort_all_requests False: requests on the old adapter finish on it)."""

    new_version: str
    abort_all_requests: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# LoRA adapter bodies (sglang io_struct: LoadLoRAAdapterFromTensorsReqInput, UnloadLoRAAdapterReqInput)
# --------------------------------------------------------------------------------------------------
@dataclass
class LoadLoraAdapterFromTensorsRequest:
    """POST /load_lora_adapter_from_tensors. ``serialized_named_tensors``: one base64 payload per engine TP rank,
    each the whole unsharded adapter in HF PEFT names (the engine slices it); ``config_dict``: the PEFT
    adapter_config.json; ``load_format`` "flattened_bucket": a payload is {"flattened_tensor", "metadata"}
    (SGLang's FlattenedTensorBucket), None: a {name: tensor} dict. A loaded name cannot be loaded again."""

    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    load_format: str | None = "flattened_bucket"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class LoadLoraAdapterRequest:
    """POST /load_lora_adapter (sglang io_struct LoadLoRAAdapterReqInput): load the HF PEFT directory ``lora_path``
    (adapter_config.json + *.safetensors; every TP rank of the engine reads it) under ``lora_name``."""

    lora_name: str
    lora_path: str
    pinned: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class UnloadLoraAdapterRequest:
    """POST /unload_lora_adapter: new requests can no longer select it; it goes once its requests finished."""

    lora_name: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_body(cls: type, body: Any, endpoint: str):
    """Lenient parse like SGLang's msgspec structs: unknown keys ignored, required keys enforced."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{endpoint}: body must be a JSON object")
    fields = cls.__dataclass_fields__
    try:
        return cls(**{k: v for k, v in body.items() if k in fields})
    except TypeError as err:
        raise ProtocolError(f"{endpoint}: {err}") from None
