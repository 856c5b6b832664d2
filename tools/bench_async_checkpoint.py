"""How long a checkpoint blocks training, written in line and in the background (checkpoint.async_save; issue 65's
done-when: the async save blocks the step for less than the synchronous one, as a ratio from one run).

    python tools/bench_async_checkpoint.py [--hidden 512 --layers 8 --vocab 32000] [--steps 6] [--interval 2]

Generates a random Llama of the given size (HF, fp32) and an offline store of synthetic trajectories, then trains
it twice in the same processes, one rank, saving every --interval steps: once in line, once in the background. Each
save's blocked seconds come from the runs' metrics (checkpoint/blocked_s: in line, the whole save; in the background,
the planning and the copy to host memory plus the completion's finalize and commit); the last step's save is in line
in both runs and is left out. Also the mean step time of the steps a background writer overlapped, against the
same steps of the in-line run (the writer's cost to the training thread), and both runs' wall time. The two runs'
losses are checked equal step for step. Prints the ratios background / in line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path


def make_model(path: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def make_store(path: Path, vocab: int, rows: int) -> None:
    from megatron_spo.data.trajectory import Trajectory, write_jsonl

    rng = random.Random(0)
    write_jsonl([Trajectory(prompt_id=f"p{i // 4}", prompt_tokens=[rng.randrange(1, vocab) for _ in range(16)],
                            response_tokens=[rng.randrange(1, vocab) for _ in range(rng.randrange(16, 48))],
                            reward=-float(i % 2), source="offline", policy_version=0, q0=-0.5)
                 for i in range(rows)], path)


def config(root: Path, name: str, async_save: bool, steps: int, interval: int) -> dict:
    return dict(run_dir=str(root / name), steps=steps, beta=0.5, init={"hf": str(root / "hf")},
                sources={"offline": {"path": str(root / "offline.jsonl"), "objective": "reverse_q",
                                     "loss": "squared"}},
                optimizer={"lr": 1e-4, "warmup_steps": 0},
                batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 256, "max_seq_length": 128},
                checkpoint={"interval": interval, "async_save": async_save, "keep_last": 2, "export_hf": False},
                logging={"progress": False})


def train_both(runs: list[dict], out_file: str) -> None:
    """One rank: each run in turn; its wall seconds to out_file."""
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    walls = []
    for i, data in enumerate(runs):
        trainer = Trainer(TrainConfig.model_validate(data))
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)
        walls.append(time.perf_counter() - t0)
    Path(out_file).write_text(json.dumps(walls))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    from megatron_spo.models.parallel import spawn_local

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        params = make_model(root / "hf", args.hidden, args.layers, args.vocab)
        make_store(root / "offline.jsonl", args.vocab, 8 * args.steps)
        runs = [config(root, name, name == "background", args.steps, args.interval)
                for name in ("inline", "background")]
        spawn_local(train_both, 1, runs, str(root / "walls.json"))
        walls = json.loads((root / "walls.json").read_text())
        inline, background = metrics(root / "inline"), metrics(root / "background")
        ckpt_bytes = sum(f.stat().st_size for f in (root / "background" / "checkpoints" / f"iter_{args.steps:07d}").rglob("*.distcp"))
    assert [m["loss"] for m in inline] == [m["loss"] for m in background], "the runs' losses differ"
    saves = list(range(args.interval, args.steps, args.interval))  # not the last step's (in line in both runs)
    blocked_inline = [m["checkpoint/blocked_s"] for m in inline if "checkpoint/blocked_s" in m]
    blocked_background = [m["checkpoint/blocked_s"] for m in background if "checkpoint/blocked_s" in m]
    if not len(blocked_inline) == len(blocked_background) == len(saves):
        raise SystemExit(f"expected {len(saves)} saves' metrics in each run, got {len(blocked_inline)} in line and "
                         f"{len(blocked_background)} in the background (a writer slower than the interval: raise "
                         "--interval)")
    overlapped = [s + 1 for s in saves]  # the step after each save, which the writer overlaps
    step_inline = sum(m["time/step"] for m in inline if m["step"] in overlapped) / len(overlapped)
    step_background = sum(m["time/step"] for m in background if m["step"] in overlapped) / len(overlapped)
    blocked_inline, blocked_background = sum(blocked_inline), sum(blocked_background)
    print(f"model: {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
          f"fp32, 1 rank, CPU; {len(saves)} saves compared, {ckpt_bytes / 2**20:.0f} MiB of shards a checkpoint")
    print(f"  blocked by the saves: in line {blocked_inline:.2f} s, background {blocked_background:.2f} s: "
          f"ratio {blocked_background / blocked_inline:.3f}")
    print(f"  step time after a save (the writer overlapping it): in line {step_inline:.2f} s, background "
          f"{step_background:.2f} s: ratio {step_background / step_inline:.3f}")
    print(f"  run wall time: in line {walls[0]:.1f} s, background {walls[1]:.1f} s: ratio {walls[1] / walls[0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
