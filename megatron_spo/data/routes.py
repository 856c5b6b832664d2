"""Routed experts of one trajectory (rollout routing replay, R3): which experts the engine's MoE routers chose for
every token it ran through the model, so the trainer can route the same tokens the same way.

Layout (SGLang 0.5.23, ``meta_info["routed_experts"]``): base64 of int32 [tokens, layers, top_k] in row-major
order, covering positions [0, prompt + response - 1) of prompt + response (the last sampled token is never run
through the model). ``RoutedExperts`` keeps the ids as an array in the smallest integer type they fit (uint8 below 256
experts: 5.3x fewer bytes than the engine's base64 of int32), ``b64`` the engine's string back.

    routes = RoutedExperts.from_engine(b64, tokens=P + R - 1, top_k=k, where="engine 0 rid r1")
    routes.check_model(num_layers=L, num_experts=E, top_k=k, where="trajectory 7")   # against the policy
    routes.check_for(model_cfg, where="trajectory 7")                                # the same, of a ModelConfig
    ids = routes.array()                                                             # int32 [T, L, k]
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

FIELD = "routed_experts"


class RoutesError(ValueError):
    """Routes that do not fit their trajectory or the model: "WHERE: field 'routed_experts': DETAIL"."""

    def __init__(self, where: str, detail: str):
        self.where, self.detail = where, detail
        super().__init__(f"{where}: field '{FIELD}': {detail}")


def compact(ids: np.ndarray) -> np.ndarray:
    """ids in the smallest integer type that holds them: uint8 below 256 experts, uint16 below 65536, else int32
    (negative or huge ids stay int32, for check_model to name)."""
    if ids.size and int(ids.min()) >= 0:
        top = int(ids.max())
        if top < 256:
            return ids.astype(np.uint8)
        if top < 65536:
            return ids.astype(np.uint16)
    return ids.astype(np.int32)


@dataclass(frozen=True, eq=False)
class RoutedExperts:
    """Expert ids [tokens, layers, top_k] held in the smallest integer type that fits them (``compact``: 1 byte an id
    below 256 experts, against the engine's 4 bytes of int32 in 4 / 3 as many base64 characters); ``b64`` gives the
    engine's format back (records, stores)."""

    ids: np.ndarray  # [tokens, layers, top_k], uint8 / uint16 / int32, read-only

    @property
    def tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def layers(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    @property
    def nbytes(self) -> int:
        return self.ids.nbytes

    @property
    def b64(self) -> str:
        """SGLang's base64 of the int32 ids, row-major."""
        return base64.b64encode(self.ids.astype(np.int32).tobytes()).decode("ascii")

    def __eq__(self, other) -> bool:
        return isinstance(other, RoutedExperts) and self.ids.shape == other.ids.shape and bool(
            np.array_equal(self.ids, other.ids))

    __hash__ = None

    def array(self) -> np.ndarray:
        """int32 [tokens, layers, top_k] (writable: torch takes it)."""
        return self.ids.astype(np.int32)

    def select_layers(self, layers) -> RoutedExperts:
        """The routes of ``layers`` (global MoE layer indices, in that order) only: what one pipeline stage replays."""
        return RoutedExperts(np.ascontiguousarray(self.ids[:, list(layers)]))

    @classmethod
    def from_array(cls, ids) -> RoutedExperts:
        ids = np.asarray(ids)
        if ids.ndim != 3:
            raise RoutesError("from_array", f"expected [tokens, layers, top_k], got shape {list(ids.shape)}")
        out = compact(np.ascontiguousarray(ids))
        out.flags.writeable = False
        return cls(out)

    @classmethod
    def from_engine(cls, b64: str, *, tokens: int, top_k: int, where: str) -> RoutedExperts:
        """An engine's ``meta_info["routed_experts"]`` for ``tokens`` positions of a model routing ``top_k``
        experts per token; the layer count is what the bytes hold (checked against the model by check_model)."""
        ids = _decode(b64, where)
        per_token = tokens * top_k
        if tokens <= 0 or ids.size % per_token:
            raise RoutesError(where, f"{ids.size} expert ids do not split into {tokens} tokens "
                              f"x layers x top_k {top_k}")
        return cls.from_array(ids.reshape(tokens, ids.size // per_token, top_k))

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "layers": self.layers, "top_k": self.top_k, "b64": self.b64}

    @classmethod
    def from_json(cls, obj: Any, where: str, tokens: int) -> RoutedExperts:
        """From a trajectory record; ``tokens`` = prompt + response - 1, the positions an engine routes."""
        if not isinstance(obj, dict) or set(obj) != {"tokens", "layers", "top_k", "b64"}:
            raise RoutesError(where, f"must be {{tokens, layers, top_k, b64}}, got "
                              f"{str(obj)[:60]}")
        shape = [obj["tokens"], obj["layers"], obj["top_k"]]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape):
            raise RoutesError(where, f"tokens, layers and top_k must be positive integers, "
                              f"got {shape}")
        if obj["tokens"] != tokens:
            raise RoutesError(where, f"routes for {obj['tokens']} tokens, but prompt + response "
                              f"- 1 = {tokens} tokens went through the model")
        if not isinstance(obj["b64"], str):
            raise RoutesError(where, "b64 must be a base64 string")
        ids = _decode(obj["b64"], where)
        if ids.size != obj["tokens"] * obj["layers"] * obj["top_k"]:
            raise RoutesError(where, f"{ids.size} expert ids for shape {shape}")
        return cls.from_array(ids.reshape(shape))

    def check_model(self, *, num_layers: int, num_experts: int, top_k: int, where: str) -> np.ndarray:
        """The ids int32 [tokens, layers, top_k] if they can be this model's routes, else RoutesError naming
        ``where`` (the trajectory) and the field: layer count, top_k, ids in [0, num_experts), k distinct ids."""
        if (self.layers, self.top_k) != (num_layers, top_k):
            raise RoutesError(where, f"routes of {self.layers} layers x top_k {self.top_k}, "
                              f"the model has {num_layers} MoE layers x top_k {top_k} (routes from another model?)")
        ids = self.array()
        bad = (ids < 0) | (ids >= num_experts)
        if bad.any():
            t, layer, j = (int(i) for i in np.argwhere(bad)[0])
            raise RoutesError(where, f"expert id {int(ids[t, layer, j])} at token {t}, layer "
                              f"{layer} is outside [0, {num_experts})")
        if top_k > 1:
            ordered = np.sort(ids, axis=-1)
            dup = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
            if dup.any():
                t, layer = (int(i) for i in np.argwhere(dup)[0])
                raise RoutesError(where, f"token {t}, layer {layer} routes to expert "
                                  f"{ids[t, layer].tolist()} more than once")
        return ids

    def check_for(self, model, where: str) -> np.ndarray:
        """check_model against a ModelConfig (its layers, model.moe's experts and top_k); a dense model takes no
        routes."""
        if model.moe is None:
            raise RoutesError(where, "routes for a model without experts (routes from another model?)")
        return self.check_model(num_layers=model.num_layers, num_experts=model.moe.num_experts,
                                top_k=model.moe.router_topk, where=where)


def _decode(b64: Any, where: str) -> np.ndarray:
    if not isinstance(b64, str):
        raise RoutesError(where, f"must be a base64 string, got {type(b64).__name__}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise RoutesError(where, "not valid base64") from None
    if len(raw) % 4:
        raise RoutesError(where, f"{len(raw)} bytes are not whole int32 ids")
    return np.frombuffer(raw, dtype=np.int32)
