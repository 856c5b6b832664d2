"""The trainer's peak memory with LoRA against full SPO, same model, same batches, one run each (issue 46).

    python tools/bench_lora_memory.py [--hidden 32 --layers 2 --ffn 64 --heads 4 --kv-heads 2 --vocab 61] [--steps 3]

Each arm is a fresh process (megatron's spawn_local, one CPU rank) training SPO for --steps steps on the same
random-init HF Llama from the same synthetic trajectories (no fleet: weights are not pushed); its peak RSS is the
trainer's memory/peak_rss_gb (megatron_spo/memory.py: VmHWM) after the last step. Full SPO holds the policy, its
gradients and Adam states, and a second model (the reference); LoRA holds one model with the adapters, whose
gradients and Adam states are the adapters' alone. The defaults are the tests' tiny Llama; pass larger dims to see
the model's share (at the tiny model the process baseline, torch + megatron-core, is nearly all of it).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path


class _Source:
    """Reproducible trajectories: groups of 4 responses per prompt, rewards in {0, -1}."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab, self.drawn = random.Random(seed), vocab, 0

    def take(self, k: int, timeout_s: float | None = None) -> list:
        from types import SimpleNamespace

        out = []
        for _ in range(k):
            prompt = [self.rng.randrange(1, self.vocab) for _ in range(8)]
            response = [self.rng.randrange(1, self.vocab) for _ in range(self.rng.randrange(8, 24))]
            out.append(SimpleNamespace(prompt_id=f"p{self.drawn // 4}", prompt_tokens=prompt, response_tokens=response,
                                       reward=-float(response[0] % 2), source="online", policy_version=0, q0=-0.5,
                                       behaviour_logprobs=[-4.0] * len(response), mc_targets=[]))
            self.drawn += 1
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


def _train(cfg_data: dict, vocab: int) -> None:
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=_Source(vocab))
    try:
        trainer.train()
    finally:
        trainer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 32), ("layers", 2), ("ffn", 64), ("heads", 4), ("kv-heads", 2), ("vocab", 61),
                          ("steps", 3), ("rank", 8)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_spo.models.parallel import spawn_local

    root = Path(tempfile.mkdtemp(prefix="bench_lora_memory_"))
    hf = root / "hf"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                         intermediate_size=args.ffn, num_hidden_layers=args.layers,
                                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                         max_position_embeddings=128, tie_word_embeddings=False))
    model.save_pretrained(hf)
    params = sum(p.numel() for p in model.parameters())
    del model
    rows = {}
    for arm, lora in (("full", None), ("lora", {"rank": args.rank, "alpha": 2 * args.rank})):
        cfg = dict(run_dir=str(root / arm), steps=args.steps, algo="spo", beta=0.5, init={"hf": str(hf)},
                   optimizer={"lr": 1e-4, "warmup_steps": 1},
                   batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 256, "max_seq_length": 64},
                   model_update_interval=1, checkpoint={"interval": 1000, "export_hf": False},
                   logging={"progress": False}, lora=lora)
        spawn_local(_train, 1, cfg, args.vocab)
        metrics = [json.loads(line) for line in (root / arm / "metrics.jsonl").read_text().splitlines()]
        rows[arm] = max(m["memory/peak_rss_gb"] for m in metrics)
    print(f"SPO trainer peak RSS, Llama {params:,} params (hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}), fp32, CPU, {args.steps} steps: full {rows['full']:.3f} GB, LoRA rank {args.rank} "
          f"{rows['lora']:.3f} GB, full - LoRA {rows['full'] - rows['lora']:.3f} GB")
    print(json.dumps({"params": params, "peak_rss_gb": rows, "dims": vars(args)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
