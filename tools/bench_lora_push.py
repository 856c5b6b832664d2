"""Adapter push vs full push of a Llama-3.2-1B-shaped model to one local engine, in one run (issue 46).

    python tools/bench_lora_push.py [--rank 16] [--dtype bfloat16] [--dir /tmp/bench_lora_push] [--repeats 3]

Writes a 1B-shaped HF checkpoint (hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192, vocab 128256, tied
embeddings; zero weights: a push does not look at the values), starts ``megatron-spo serve`` on it with LoRA enabled
(engine_lora_args), then pushes, ``--repeats`` times each:
  full:    every HF tensor through the WeightBroadcaster (rollout.weight_sync=broadcast, gloo: pause, buckets,
           continue), what a LoRA run with lora.push=merged sends;
  adapter: the adapters (rank --rank on q/k/v/o/gate/up/down of every layer, HF PEFT names, as the trainer's
           peft_tensors makes them) through the AdapterPusher (/load_lora_adapter_from_tensors, then
           /update_weight_version, then the older adapter unloaded);
  path:    the same adapters by path (lora.transport=path): written once as an HF PEFT directory under
           --dir/lora_push (safetensors + digests, renamed into place), loaded with /load_lora_adapter {lora_name,
           lora_path}, the older adapter unloaded and its directory removed;
and prints bytes on the wire (HTTP bodies; path also the bytes written to the filesystem) and seconds of each (the
median over repeats) and their ratios. Nothing is kept but the checkpoint in --dir (delete it after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

LLAMA_32_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
               "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
               "bos_token_id": 128000, "eos_token_id": 128001}


def write_checkpoint(out: Path, dtype: torch.dtype) -> Path:
    """config.json + one safetensors file of zeros with the HF names and shapes of the family's rule table."""
    from safetensors.torch import save_file

    from megatron_spo.models.hf_checkpoint import read_hf_config
    from megatron_spo.models.hf_map import hf_shapes

    out.mkdir(parents=True, exist_ok=True)
    config = {**LLAMA_32_1B, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if not (out / "model.safetensors").exists():
        shapes = hf_shapes(read_hf_config(out))
        save_file({name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def adapters(model_cfg, lora, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random full adapters of every layer and target in HF PEFT names (the trainer's peft_tensors)."""
    from megatron_spo.models.lora import TARGETS, adapter_key
    from megatron_spo.models.peft_export import peft_tensors

    g = torch.Generator().manual_seed(0)
    d = model_cfg.kv_channels or model_cfg.hidden_size // model_cfg.num_attention_heads
    h, f = model_cfg.hidden_size, model_cfg.ffn_hidden_size
    dims = {"linear_qkv": (h, (model_cfg.num_attention_heads + 2 * model_cfg.num_query_groups) * d),
            "linear_proj": (model_cfg.num_attention_heads * d, h), "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}
    full = {}
    for layer in range(model_cfg.num_layers):
        for target in TARGETS:
            fan_in, fan_out = dims[target]
            full[adapter_key(layer, target, "lora_A")] = 0.01 * torch.randn(lora.rank, fan_in, generator=g)
            full[adapter_key(layer, target, "lora_B")] = 0.01 * torch.randn(fan_out, lora.rank, generator=g)
    return {k: v.to(dtype) for k, v in peft_tensors(full, model_cfg).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dir", default="/tmp/bench_lora_push")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    args = parser.parse_args(argv)

    from megatron_spo.models.hf_checkpoint import read_hf_config
    from megatron_spo.models.hf_map import hf_shapes
    from megatron_spo.models.lora import LoraConfig
    from megatron_spo.net import free_port
    from megatron_spo.rollout.adapter_push import AdapterPusher, engine_lora_args, push_config_dict
    from megatron_spo.rollout.client import wait_healthy
    from megatron_spo.rollout.weight_sync import WeightBroadcaster

    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    hf = write_checkpoint(Path(args.dir) / "llama-3.2-1b-shaped", dtype)
    model_cfg = read_hf_config(hf)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank)
    print(f"checkpoint {hf} ({time.perf_counter() - t0:.0f} s)", flush=True)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "megatron_spo.cli", "serve", "--model", str(hf), "--port", str(port), "--dtype",
           args.dtype, "--threads", str(args.threads), "--log-level", "warning", *engine_lora_args(lora, model_cfg)]
    engine = subprocess.Popen(cmd)
    try:
        wait_healthy([url], 600.0, path="/model_info")
        print(f"engine up ({time.perf_counter() - t0:.0f} s): {' '.join(cmd[3:])}", flush=True)
        full = {name: torch.zeros(shape, dtype=dtype) for name, shape in hf_shapes(model_cfg).items()}
        if model_cfg.tie_word_embeddings:
            full.pop("lm_head.weight", None)  # tied: the engine's state_dict names it, the push sends it once
        tensors = adapters(model_cfg, lora, dtype)
        rows = {"full": [], "adapter": [], "path": []}
        written = []
        config = push_config_dict(lora, model_cfg, str(hf))
        with WeightBroadcaster([url], mode="broadcast", backend="gloo") as sender, \
                AdapterPusher([url], config, base_dir=str(hf)) as pusher, \
                AdapterPusher([url], config, base_dir=str(hf), push_dir=str(Path(args.dir) / "lora_push")) as by_path:
            for i in range(args.repeats):
                r = sender.push(full.items(), version=str(3 * i + 1))
                rows["full"].append((r.bytes_sent, r.seconds, r.pause_seconds))
                a = pusher.push(tensors, version=3 * i + 2)
                pusher.retire()
                if a.failed:
                    raise RuntimeError(f"adapter push failed: {a.failed}")
                rows["adapter"].append((a.bytes_sent, a.seconds, 0.0))
                b = by_path.push(tensors, version=3 * i + 3)
                by_path.retire()
                if b.failed:
                    raise RuntimeError(f"adapter push by path failed: {b.failed}")
                rows["path"].append((b.bytes_sent, b.seconds, 0.0))
                written.append(b.bytes_written)
        params = {k: sum(t.numel() for t in v.values()) for k, v in (("full", full), ("adapter", tensors),
                                                                       ("path", tensors))}
        print(f"\nLlama-3.2-1B-shaped, {args.dtype}, LoRA rank {args.rank} on q/k/v/o/gate/up/down, one local engine "
              f"(TP 1), median of {args.repeats}:")
        med = {k: (statistics.median(b for b, _, _ in v), statistics.median(s for _, s, _ in v),
                   statistics.median(p for _, _, p in v)) for k, v in rows.items()}
        for kind in ("full", "adapter", "path"):
            nbytes, seconds, pause = med[kind]
            extra = f", {statistics.median(written) / 2**20:.1f} MiB written once" if kind == "path" else ""
            print(f"  {kind:8s} {params[kind]:>13,} params  {nbytes / 2**20:12.4f} MiB on the wire  "
                  f"{seconds:7.3f} s  (generation paused {pause:.3f} s{extra})")
        print(f"  ratio full / adapter: bytes {med['full'][0] / med['adapter'][0]:.1f}x, "
              f"seconds {med['full'][1] / med['adapter'][1]:.1f}x")
        print(f"  ratio adapter / path: HTTP bytes {med['adapter'][0] / med['path'][0]:,.0f}x "
              f"({med['adapter'][0] / statistics.median(written):.2f}x counting the file written), "
              f"seconds {med['adapter'][1] / med['path'][1]:.2f}x; full / path seconds "
              f"{med['full'][1] / med['path'][1]:.1f}x")
        print(json.dumps({"rank": args.rank, "dtype": args.dtype, "params": params, "runs": rows,
                          "path_bytes_written": written}))
    finally:
        engine.terminate()
        engine.wait(30)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    raise SystemExit(main())
