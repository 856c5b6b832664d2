"""Conversion time vs a plain safetensors read + write of the same bytes, measured in one run.

    python tools/bench_convert.py [--hidden 1024 --layers 8 --vocab 32000 --dtype bfloat16]

Generates a random Llama HF checkpoint (no download), then times, in this process (imports warm):
  plain      read every tensor with safe_open and write it back with save_file (same shard layout),
             fsync'd like the converters' outputs (megatron's writer always fsyncs, and an output must
             be durable before it is renamed into place)
  hf->mcore  megatron_spo.models.convert.hf_to_megatron (validate, build, load, dist-checkpoint save)
  mcore->hf  megatron_spo.models.convert.megatron_to_hf (build, dist-checkpoint load, stream, write)
and prints each as a ratio to plain (target: <= 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

SHARD_BYTES = 200 * 2**20


def make_checkpoint(out: Path, hidden: int, layers: int, vocab: int, dtype: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        tie_word_embeddings=False,
    )
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out, max_shard_size=SHARD_BYTES)


def plain_copy(src: Path, dst: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_spo.models.hf_checkpoint import fsync_file

    dst.mkdir()
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        save_file(tensors, dst / f.name, metadata={"format": "pt"})
        fsync_file(dst / f.name)
    shutil.copy2(src / "model.safetensors.index.json", dst)


def timed(fn, *args) -> float:
    # Flush dirty pages first: otherwise whichever step runs after a big write pays its writeback.
    os.sync()
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2, help="best of N for every measurement")
    args = parser.parse_args()

    import torch

    from megatron_spo.models.convert import hf_to_megatron, megatron_to_hf

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf = tmp / "hf"
        make_checkpoint(hf, args.hidden, args.layers, args.vocab, args.dtype)
        nbytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        times: dict[str, list[float]] = {"plain": [], "hf->mcore": [], "mcore->hf": []}
        for i in range(args.repeats):
            times["plain"].append(timed(plain_copy, hf, tmp / f"plain{i}"))
            times["hf->mcore"].append(timed(hf_to_megatron, hf, tmp / f"meg{i}"))
            # same shard size as the source and the plain copy, so both write the same file layout
            times["mcore->hf"].append(timed(megatron_to_hf, tmp / f"meg{i}", tmp / f"back{i}", SHARD_BYTES))
            shutil.rmtree(tmp / f"plain{i}")
            if i > 0:
                shutil.rmtree(tmp / f"back{i - 1}")
        best = {k: min(v) for k, v in times.items()}
        report = {
            "checkpoint_bytes": nbytes,
            "seconds": {k: round(v, 3) for k, v in best.items()},
            "ratio_hf_to_megatron": round(best["hf->mcore"] / best["plain"], 2),
            "ratio_megatron_to_hf": round(best["mcore->hf"] / best["plain"], 2),
        }
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
