"""What packing saves: the pad share at a realistic length spread, and the trainer's step with packed micro-batches
against padded ones, measured in one run.

    python tools/bench_packing.py                    # CPU: a tiny Llama, 3 SPO steps each way
    python tools/bench_packing.py --steps 5 --hidden 128 --json

1. Pad share (pure arithmetic, data/batching.py): 256 trajectories of a 200-token prompt and a log-normal response
   (median 2k, clipped to 200..16k tokens), cut by a 64k-token budget as padded rows or packed streams.
2. The real Trainer (one process, SPO, the deterministic in-process source of this file: groups of 4, responses
   log-normal with median --median tokens, clipped to 1/10..8x of it) trains --steps steps with
   batch.pack_sequences true and false on the same batches; tokens/s = response tokens / time of the model passes
   (time/forward_backward), its first step (warm-up) dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import warnings
from pathlib import Path

VOCAB = 97


class RandomTrajectories:
    """An in-process online source: groups of 4 trajectories per prompt of random tokens, a prompt of `prompt`
    tokens and a response of response_length(rng) tokens, rewards in {0, -1} (tools/bench_step.py uses it too)."""

    def __init__(self, response_length, prompt: int, vocab: int = VOCAB, seed: int = 0):
        self.rng, self.response_length, self.prompt, self.vocab = random.Random(seed), response_length, prompt, vocab
        self.drawn = 0

    def take(self, k: int, timeout_s: float | None = None) -> list:
        from megatron_spo.data.trajectory import Trajectory

        out = []
        for _ in range(k):
            ids = [self.rng.randrange(1, self.vocab) for _ in range(self.prompt + self.response_length(self.rng))]
            out.append(Trajectory(f"p{self.drawn // 4}", ids[:self.prompt], ids[self.prompt:],
                                  reward=-float(self.rng.random() < 0.5), source="online", policy_version=0, q0=-0.5))
            self.drawn += 1
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


def log_normal(median: int):
    """Response lengths log-normal with this median (sigma 1), clipped to median / 10 .. 8 x median."""
    return lambda rng: min(8 * median, max(median // 10, int(rng.lognormvariate(math.log(median), 1.0))))


def realistic_pad_share(n: int = 256, budget: int = 65_536, seed: int = 0) -> dict:
    from megatron_spo.data.batching import pad_share, split_by_token_budget

    rng = random.Random(seed)
    lengths = [200 + min(16_384, max(200, int(rng.lognormvariate(math.log(2000), 1.0)))) for _ in range(n)]
    padded = pad_share(lengths, split_by_token_budget(lengths, budget), packed=False)
    parts = split_by_token_budget(lengths, budget, packed=True)
    packed = pad_share(lengths, parts, packed=True)
    width = max(sum(lengths[i] for i in p) for p in parts)
    return {"padded": padded, "packed": packed,
            "packed_one_width": pad_share(lengths, parts, packed=True, width=width)}


def tiny_hf(path: Path, hidden: int, layers: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16_384,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def train(root: Path, hf: str, pack: bool, args) -> dict:
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    name = "packed" if pack else "padded"
    kernel = {"attention_kernel": args.kernel} if getattr(args, "kernel", None) else {}
    cfg = TrainConfig.model_validate(dict(
        parallel=kernel,
        run_dir=str(root / name), steps=args.steps, algo="spo", beta=0.5, init={"hf": hf},
        optimizer={"lr": 1e-4}, model_update_interval=args.steps + 1, checkpoint={"interval": 10_000},
        logging={"progress": False, "wandb_mode": "disabled"},
        batch={"sequences_per_step": args.sequences, "max_tokens_per_micro_batch": args.budget,
               "max_seq_length": 9 * args.median + 64, "pack_sequences": pack}))
    trainer = Trainer(cfg, online_source=RandomTrajectories(log_normal(args.median), prompt=20))
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()][1:]
    seconds = sum(r["time/forward_backward"] for r in rows)
    tokens = sum(r["tokens_per_s"] * r["time/step"] for r in rows)
    return {"tokens_per_s": tokens / seconds, "pad_share": sum(r["batch/pad_share"] for r in rows) / len(rows),
            "seconds": seconds, "peak_rss_gb": max(r["memory/peak_rss_gb"] for r in rows)}


ARMS = {"before": (False, "dot_product"), "after": (True, "sdpa")}  # (pack_sequences, attention kernel)


def before_after(args) -> dict:
    """The trainer step before the defaults of 2026-11-28 (padded rows, megatron's DotProductAttention) and after
    (packed, SDPA), each arm in a fresh process so its peak resident memory is its own."""
    import subprocess

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf = tiny_hf(Path(tmp) / "hf", args.hidden, args.layers)
        for arm in ARMS:
            cmd = [sys.executable, __file__, "--arm", arm, "--hf", hf, "--steps", str(args.steps), "--sequences",
                   str(args.sequences), "--median", str(args.median), "--budget", str(args.budget)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"bench_packing: arm {arm} failed: {proc.stderr.strip().splitlines()[-1:]}")
            out[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--median", type=int, default=120, help="median response tokens of the trainer runs")
    ap.add_argument("--budget", type=int, default=4096, help="batch.max_tokens_per_micro_batch")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--before-after", action="store_true", help="padded + DotProductAttention (before) against "
                    "packed + SDPA (after), each in its own process: tokens/s and peak resident memory")
    ap.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    ap.add_argument("--hf", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.arm:  # one arm of --before-after, in its own process
        pack, args.kernel = ARMS[args.arm]
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(train(Path(tmp), args.hf, pack, args)))
        return 0
    if args.before_after:
        r = before_after(args)
        print(f"trainer step, median response {args.median} tokens (clipped to {args.median // 10}..{8 * args.median}), "
              f"{args.sequences} sequences per step, {args.budget}-token micro-batches:")
        for arm, x in r.items():
            print(f"  {arm:>6} ({'packed, sdpa' if ARMS[arm][0] else 'padded, dot_product'}): {x['tokens_per_s']:9.1f} "
                  f"response tokens/s, peak RSS {x['peak_rss_gb']:.2f} GB, pad share {x['pad_share']:.1%}")
        print(f"after / before: tokens/s {r['after']['tokens_per_s'] / r['before']['tokens_per_s']:.2f}x, peak RSS "
              f"{r['after']['peak_rss_gb'] / r['before']['peak_rss_gb']:.2f}x")
        return 0
    report = {"realistic_pad_share": realistic_pad_share()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = tiny_hf(root / "hf", args.hidden, args.layers)
        report["padded"] = train(root, hf, False, args)
        report["packed"] = train(root, hf, True, args)
    report["tokens_per_s_ratio"] = report["packed"]["tokens_per_s"] / report["padded"]["tokens_per_s"]
    if args.json:
        print(json.dumps(report))
        return 0
    r = report["realistic_pad_share"]
    print(f"pad share, 256 trajectories of 200..16k tokens, 64k-token budget: padded {r['padded']:.1%}, packed "
          f"{r['packed']:.1%}, packed to one width (virtual stages) {r['packed_one_width']:.1%}")
    for name in ("padded", "packed"):
        x = report[name]
        print(f"trainer step, {name:>6}: {x['tokens_per_s']:9.1f} response tokens/s over the model passes, "
              f"pad share {x['pad_share']:.1%}")
    print(f"packed / padded tokens/s: {report['tokens_per_s_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
