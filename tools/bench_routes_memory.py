"""Host bytes of the engine's routed experts per training step, before and after issue 61 (routes at long sequences).

    python tools/bench_routes_memory.py [--sequences 4] [--tokens 32768] [--layers 48] [--top-k 8] [--experts 128]
                                        [--dp 8] [--pp 1] [--tp 1] [--step-sequences 128]

Before: every trajectory carried its routes as SGLang's base64 of int32 (4 / 3 x 4 bytes an id) inside the step's
trajectories, pickled and broadcast to every rank: each rank received and held the whole step's. After: the ids are
held in the smallest integer type (uint8 below 256 experts), the trajectories are broadcast without them, and rank 0
sends each rank only the rows of its data-parallel shard and the layers of its pipeline stage (trainer._deal_routes).
Measured here: the pickled bytes of what one rank receives, at --sequences sequences of --tokens tokens (random ids),
for the before and the after representation; scaled linearly to --step-sequences (the bytes are per token: exact
up to the pickles' few hundred bytes per trajectory). Prints bytes per rank per step and the ratio.
"""

from __future__ import annotations

import argparse
import base64
import pickle
import sys
from dataclasses import dataclass, replace

import numpy as np


@dataclass
class OldRoutes:
    """The representation before: SGLang's base64 string of int32 ids, with the shape."""

    tokens: int
    layers: int
    top_k: int
    b64: str


@dataclass
class Row:
    prompt_id: str
    prompt_tokens: list
    response_tokens: list
    reward: float
    routed_experts: object = None


def measure(sequences: int, tokens: int, layers: int, top_k: int, experts: int, dp: int, pp: int) -> dict:
    from megatron_spo.data.routes import RoutedExperts
    from megatron_spo.training.micro_batches import shard_indices

    rng = np.random.default_rng(0)
    rows_new, rows_old = [], []
    for i in range(sequences):
        ids = rng.integers(0, experts, size=(tokens, layers, top_k), dtype=np.int32)
        prompt, response = [1] * 64, [2] * (tokens + 1 - 64)
        new = RoutedExperts.from_array(ids)
        old = OldRoutes(tokens, layers, top_k, base64.b64encode(ids.tobytes()).decode("ascii"))
        rows_new.append(Row(f"p{i}", prompt, response, 0.0, new))
        rows_old.append(Row(f"p{i}", prompt, response, 0.0, old))
    before = len(pickle.dumps(rows_old, protocol=pickle.HIGHEST_PROTOCOL))  # every rank: the whole step
    plain = [replace(r, routed_experts=None) for r in rows_new]
    broadcast = len(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL))
    stage = [list(range(s * layers // pp, (s + 1) * layers // pp)) for s in range(pp)]
    shares = []
    for d in range(min(dp, sequences)):
        mine = shard_indices(plain, d, min(dp, sequences))
        for layers_of_stage in stage:
            share = {i: rows_new[i].routed_experts.select_layers(layers_of_stage) for i in mine}
            shares.append(len(pickle.dumps(share, protocol=pickle.HIGHEST_PROTOCOL)))
    # what one rank holds after: the routeless step and its own share (the largest share: the worst rank)
    after = broadcast + max(shares)
    return {"before": before, "after": after, "broadcast": broadcast, "largest_share": max(shares),
            "id_bytes_before": 4 * 4 / 3, "id_bytes_after": rows_new[0].routed_experts.ids.itemsize}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=8, help="measured (a multiple of --dp)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--dp", type=int, default=8, help="data-parallel ranks of the measured sequences")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--step-sequences", type=int, default=128, help="sequences of the step the figures scale to")
    a = ap.parse_args(argv)
    m = measure(a.sequences, a.tokens, a.layers, a.top_k, a.experts, a.dp, a.pp)
    scale = a.step_sequences / a.sequences
    gb = 1e9
    print(f"routes of {a.sequences} sequences x {a.tokens} tokens x {a.layers} layers x top-{a.top_k} "
          f"({a.experts} experts), one rank of DP {a.dp} x PP {a.pp}; scaled to {a.step_sequences} sequences a step:")
    print(f"  before: every rank receives and holds {m['before'] * scale / gb:.2f} GB a step "
          f"(base64 of int32: {m['id_bytes_before']:.2f} bytes an id)")
    print(f"  after:  each rank {m['after'] * scale / gb:.3f} GB a step (the routeless step "
          f"{m['broadcast'] * scale / gb:.4f} GB + its share {m['largest_share'] * scale / gb:.3f} GB; "
          f"{m['id_bytes_after']} byte(s) an id); ratio after / before {m['after'] / m['before']:.4f}")
    print(f"  rank 0 sends about {m['largest_share'] * scale * a.dp * a.pp / gb:.2f} GB a step in all, times TP x CP "
          f"(every rank of a TP / CP group gets its copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
