"""Activation memory of one long sequence per rank at context parallelism 1 and CP (issue 60's done-when: an 8k-token
sequence at CP 2 costs each rank at most 0.6x what it costs at CP 1; ideal 0.5).

    python tools/bench_cp_memory.py [--tokens 8192] [--cp 2] [--hidden 128 --layers 4]

Builds the policy (local spec, SDPA attention, fp32) at CP 1 (one process) and at CP (CP processes, gloo), packs one
sequence of --tokens tokens (models/packing.py; models/context_parallel.py's split), runs the trainer's forward: final
hidden states, the fused log-prob op on this rank's tokens, the CP all-gather of the log-probs, a loss over the whole
sequence; then the backward. Measured per rank: the bytes of every tensor the forward keeps for the backward (the
activations; unique storages, so views and the shared causal-mask storage count once), and the process's peak RSS
growth over the pass (noisier: it includes the allocator's reuse). Also checks the CP log-probs equal CP 1's.
Prints the ratios CP / CP 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch


def model_config(hidden: int, layers: int, tokens: int):
    from megatron_spo.models.config import ModelConfig

    return ModelConfig(num_layers=layers, hidden_size=hidden, ffn_hidden_size=2 * hidden, num_attention_heads=4,
                       num_query_groups=2, vocab_size=1000, max_position_embeddings=tokens, params_dtype="float32")


def measure_rank(cp: int, tokens: int, hidden: int, layers: int, out_file: str) -> None:
    """One rank: build, forward (counting saved tensors), backward; rank 0 of the CP group writes its numbers."""
    import torch.distributed as dist

    from megatron_spo.memory import peak_rss_gb, release_large_frees, reset_peak_rss
    from megatron_spo.models import builders
    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.context_parallel import ContextShard
    from megatron_spo.models.packing import Packed
    from megatron_spo.models.parallel import destroy_parallel, init_parallel
    from megatron_spo.ops import token_logprobs

    cfg = model_config(hidden, layers, tokens)
    parallel = ParallelConfig(context_parallel_size=cp)
    init_parallel(parallel, cfg, seed=7)
    policy = builders.build_policy(cfg, parallel)
    model = policy[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (1, tokens), generator=gen)
    targets = torch.randint(1, cfg.vocab_size, (1, tokens), generator=gen)
    whole = Packed.of(ids, torch.tensor([tokens]), seq_multiple=2 * cp if cp > 1 else 1)
    layout = whole if cp == 1 else ContextShard.of(whole, cp, dist.get_rank())
    storages: dict[int, int] = {}

    def keep(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    for p in model.parameters():  # weights are not activations
        storages[p.untyped_storage().data_ptr()] = 0
    weights = set(storages)
    release_large_frees()
    reset_peak_rss()
    rss0 = peak_rss_gb()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        with builders.output_hidden_states(model):
            hidden_states = model(layout.input_ids, layout.position_ids, None, packed_seq_params=layout.params())
        local = token_logprobs(hidden_states[0], builders.lm_head_weight(model), layout.gather(targets),
                               vocab_start_index=0, valid_vocab_size=cfg.vocab_size)
        logp = layout.unpack(local)  # [1, tokens] on every CP rank
        loss = -(logp * torch.linspace(0.5, 1.5, tokens)).sum() / tokens
    saved = sum(n for ptr, n in storages.items() if ptr not in weights)
    loss.backward()
    rss = (peak_rss_gb() - rss0) * 1e9
    if dist.get_rank() == 0:
        Path(out_file).write_text(json.dumps({"cp": cp, "tokens": tokens, "saved_bytes": saved, "rss_growth_bytes": rss,
                                              "loss": float(loss), "logp": logp.detach()[0].tolist()}))
    destroy_parallel()


def run(cp: int, tokens: int, hidden: int, layers: int) -> dict:
    from megatron_spo.models.parallel import spawn_local

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "m.json")
        spawn_local(measure_rank, cp, cp, tokens, hidden, layers, out)
        return json.loads(Path(out).read_text())


def compare(tokens: int = 8192, cp: int = 2, hidden: int = 128, layers: int = 4) -> dict:
    """The two runs and their ratios: saved (activation) bytes and RSS growth per rank, CP / CP 1; the largest
    log-prob difference between them; the loss of each."""
    one, many = run(1, tokens, hidden, layers), run(cp, tokens, hidden, layers)
    diff = max(abs(a - b) for a, b in zip(one["logp"], many["logp"]))
    return {"tokens": tokens, "cp": cp, "hidden": hidden, "layers": layers,
            "saved_mb": [one["saved_bytes"] / 2**20, many["saved_bytes"] / 2**20],
            "saved_ratio": many["saved_bytes"] / one["saved_bytes"],
            "rss_growth_mb": [one["rss_growth_bytes"] / 2**20, many["rss_growth_bytes"] / 2**20],
            "rss_ratio": many["rss_growth_bytes"] / max(one["rss_growth_bytes"], 1),
            "logp_max_abs_diff": diff, "loss": [one["loss"], many["loss"]]}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args(argv)
    r = compare(args.tokens, args.cp, args.hidden, args.layers)
    print(f"one sequence of {r['tokens']} tokens, hidden {r['hidden']}, {r['layers']} layers, fp32, CPU (gloo)")
    print(f"  activations kept for the backward per rank: CP 1 {r['saved_mb'][0]:.1f} MiB, CP {r['cp']} "
          f"{r['saved_mb'][1]:.1f} MiB: ratio {r['saved_ratio']:.3f} (ideal {1 / r['cp']:.3f})")
    print(f"  peak RSS growth over forward + backward per rank: {r['rss_growth_mb'][0]:.1f} / {r['rss_growth_mb'][1]:.1f} "
          f"MiB: ratio {r['rss_ratio']:.3f}")
    print(f"  log-probs CP vs CP 1: max abs diff {r['logp_max_abs_diff']:.2e}; loss {r['loss'][0]:.6f} / "
          f"{r['loss'][1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
