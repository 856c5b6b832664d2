"""Conversion time vs a plain safetensors read + write of the same bytes, measured in one run.

    python tools/bench_convert.py [--hidden 1024 --layers 8 --vocab 32000 --dtype bfloat16 --repeats 5]

Generates a random Llama HF checkpoint (no download), then times, in this process (imports warm):
  plain      read every tensor with safe_open and write it back with save_file (same shard layout),
             fsync'd like the converters' outputs (megatron's writer always fsyncs, and an output must
             be durable before it is renamed into place)
  hf->mcore  megatron_spo.models.convert.hf_to_megatron (validate, build, load, dist-checkpoint save)
  mcore->hf  megatron_spo.models.convert.megatron_to_hf (build, dist-checkpoint load, stream, write)
and prints each as a ratio to plain (target: <= 2x): the median over interleaved rounds of each round's
conversion time / that round's plain time, with the min-max spread; the same for CPU time (user +
system of this process: robust to other load on the machine). Also the fixed cost, measured on a
tiny model in the same run (process groups, model skeleton, checkpoint metadata): it does not grow
with the model, so the ratio tends to (ratio - fixed / plain) on large checkpoints.

    python tools/bench_convert.py --memory

runs each step in a fresh process instead and prints its peak anonymous memory (process-private
RAM, sampled every 2 ms; page cache and memory-mapped files excluded) above the process's baseline,
in units of the checkpoint's size: how many copies of the model each direction holds at once.

    python tools/bench_convert.py --shape llama3.1-8b --dir /big/scratch     # any `megatron-spo plan` preset

a random checkpoint of a real model's exact shape (written tensor by tensor: never the whole model in
memory), then each step ONCE in a fresh process with its wall time and peak anonymous memory: plain
read + write, hf->mcore, mcore->hf, and the streaming check-conversion (with its memory formula). A
70B-shaped run is only arithmetic: ``--shape llama3.1-70b --estimate`` prints the check's formula.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when run as a script

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


def make_shaped_checkpoint(out: Path, preset: str) -> None:
    """A random bf16 checkpoint of a preset's exact shape, one tensor at a time (std 0.02, norms 1)."""
    import torch

    from megatron_spo.models.hf_checkpoint import HFStreamWriter, write_hf_config
    from megatron_spo.models.hf_map import hf_shapes
    from megatron_spo.planning.capacity import load_preset

    cfg, _ = load_preset(preset)
    gen = torch.Generator().manual_seed(0)
    with HFStreamWriter(out, hf_shapes(cfg), torch.bfloat16, max_shard_bytes=5 * 2**30) as writer:
        for name, shape in hf_shapes(cfg).items():
            if name.endswith("norm.weight"):
                t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
            else:
                t = 0.02 * torch.randn(shape, generator=gen)
            writer.add(name, t.to(torch.bfloat16))
    write_hf_config(out, cfg)


def check_conversion(hf: Path, meg: Path) -> None:
    from megatron_spo.models.check_conversion import run_check

    report = run_check(hf, meg, progress=False)
    print(json.dumps({"check": report.summary(), "formula": report.memory["formula"]}))
    if not report.ok:
        raise SystemExit(1)


def plain_copy(src: Path, dst: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_spo.fsutil import fsync_path

    dst.mkdir()
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        save_file(tensors, dst / f.name, metadata={"format": "pt"})
        fsync_path(dst / f.name)
    if (src / "model.safetensors.index.json").is_file():  # small models are one unsharded file
        shutil.copy2(src / "model.safetensors.index.json", dst)


CPU_TIMES: dict[str, list[float]] = {}


def timed(fn, *args, label: str | None = None) -> float:
    """Wall seconds of fn(*args); its CPU seconds (user + system, this process) go to CPU_TIMES[label]."""
    # Flush dirty pages first: otherwise whichever step runs after a big write pays its writeback.
    os.sync()
    start, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    if label:
        CPU_TIMES.setdefault(label, []).append(time.process_time() - cpu)
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _child(step: str, src: Path, dst: Path) -> None:
    """One step in this (fresh) process; prints its peak anonymous memory above the baseline."""
    from megatron_spo.memory import peak_anon_bytes
    from megatron_spo.models.convert import hf_to_megatron, megatron_to_hf

    steps = {"plain": plain_copy, "hf->mcore": hf_to_megatron, "mcore->hf": megatron_to_hf,
             "check": check_conversion}
    # Warm up on a tiny model first: imports and one-time initialisation are not the conversion's memory.
    with tempfile.TemporaryDirectory() as warm:
        make_checkpoint(Path(warm) / "hf", 64, 2, 1000, "float32")
        hf_to_megatron(Path(warm) / "hf", Path(warm) / "meg")
        megatron_to_hf(Path(warm) / "meg", Path(warm) / "back")
        plain_copy(Path(warm) / "hf", Path(warm) / "plain")
        if step == "check":
            from megatron_spo.models.check_conversion import run_check

            run_check(Path(warm) / "hf", Path(warm) / "meg", progress=False)

    def run() -> float:
        start = time.perf_counter()
        steps[step](src, dst)
        return time.perf_counter() - start

    seconds, peak = peak_anon_bytes(run)
    print(json.dumps({"peak_anon_bytes": peak, "seconds": seconds}))


def memory_report(args, tmp: Path, hf: Path, nbytes: int, check: bool = False) -> dict:
    import subprocess
    import sys

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = {}
    steps = [("plain", hf, tmp / "plain"), ("hf->mcore", hf, tmp / "meg"), ("mcore->hf", tmp / "meg", tmp / "back")]
    if check:
        steps.append(("check", hf, tmp / "meg"))
    for step, src, dst in steps:
        proc = subprocess.run([sys.executable, __file__, "--child", step, str(src), str(dst)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{step} failed:\n{proc.stderr[-2000:]}")
        lines = [json.loads(x) for x in proc.stdout.strip().splitlines() if x.startswith("{")]
        peak = lines[-1]["peak_anon_bytes"]
        result[step] = {"seconds": round(lines[-1]["seconds"], 1), "peak_anon_MB": round(peak / 2**20, 1),
                        "model_copies": round(peak / nbytes, 3), **{k: v for x in lines[:-1] for k, v in x.items()}}
    return result


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (plain, hf->mcore, mcore->hf)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: the system temp dir)")
    parser.add_argument("--memory", action="store_true", help="peak memory per step instead of time")
    parser.add_argument("--shape", default=None, help="a `megatron-spo plan` preset (e.g. llama3.1-8b): random "
                        "checkpoint of that exact shape, each step once with time and peak memory")
    parser.add_argument("--estimate", action="store_true", help="with --shape: only print the check's memory formula")
    parser.add_argument("--child", nargs=3, metavar=("STEP", "SRC", "DST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return

    if args.shape:
        from megatron_spo.models.check_conversion import memory_estimate
        from megatron_spo.planning.capacity import load_preset

        cfg, _ = load_preset(args.shape)
        print(json.dumps({"shape": args.shape, "check_memory": memory_estimate(cfg, 2, 64, 8192)["formula"]}))
        if args.estimate:
            return
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            tmp = Path(tmp)
            start = time.perf_counter()
            make_shaped_checkpoint(tmp / "hf", args.shape)
            nbytes = sum(f.stat().st_size for f in (tmp / "hf").glob("*.safetensors"))
            print(json.dumps({"generated_bytes": nbytes, "generate_seconds": round(time.perf_counter() - start, 1)}),
                  flush=True)
            print(json.dumps(memory_report(args, tmp, tmp / "hf", nbytes, check=True), indent=2))
        return

    import torch

    from megatron_spo.models.convert import hf_to_megatron, megatron_to_hf

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        hf = tmp / "hf"
        make_checkpoint(hf, args.hidden, args.layers, args.vocab, args.dtype)
        nbytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
        if args.memory:
            print(json.dumps({"checkpoint_bytes": nbytes, **memory_report(args, tmp, hf, nbytes)}, indent=2))
            return
        tiny = tmp / "tiny"
        make_checkpoint(tiny, 64, 2, 1000, args.dtype)
        # One untimed round: imports, first-use initialisation and the page cache warm for every step.
        hf_to_megatron(hf, tmp / "warm_meg")
        megatron_to_hf(tmp / "warm_meg", tmp / "warm_back", SHARD_BYTES)
        plain_copy(hf, tmp / "warm_plain")
        times: dict[str, list[float]] = {"plain": [], "hf->mcore": [], "mcore->hf": []}
        fixed: dict[str, list[float]] = {"hf->mcore": [], "mcore->hf": []}
        for i in range(args.repeats):  # interleaved, so load on the machine hits every step alike
            times["plain"].append(timed(plain_copy, hf, tmp / f"plain{i}", label="plain"))
            times["hf->mcore"].append(timed(hf_to_megatron, hf, tmp / f"meg{i}", label="hf->mcore"))
            # same shard size as the source and the plain copy, so both write the same file layout
            times["mcore->hf"].append(
                timed(megatron_to_hf, tmp / f"meg{i}", tmp / f"back{i}", SHARD_BYTES, label="mcore->hf")
            )
            fixed["hf->mcore"].append(timed(hf_to_megatron, tiny, tmp / f"tiny_meg{i}"))
            fixed["mcore->hf"].append(timed(megatron_to_hf, tmp / f"tiny_meg{i}", tmp / f"tiny_back{i}"))
            for name in (f"plain{i}", f"meg{i}", f"back{i}", f"tiny_meg{i}", f"tiny_back{i}"):
                shutil.rmtree(tmp / name)
        per_round = {
            key: [t / p for t, p in zip(times[key], times["plain"])] for key in ("hf->mcore", "mcore->hf")
        }
        cpu_round = {
            key: [t / p for t, p in zip(CPU_TIMES[key], CPU_TIMES["plain"])] for key in ("hf->mcore", "mcore->hf")
        }
        report = {
            "checkpoint_bytes": nbytes,
            "median_seconds": {k: round(median(v), 3) for k, v in times.items()},
            "ratio_hf_to_megatron": round(median(per_round["hf->mcore"]), 2),
            "ratio_megatron_to_hf": round(median(per_round["mcore->hf"]), 2),
            "ratio_spread": {k: [round(min(v), 2), round(max(v), 2)] for k, v in per_round.items()},
            "fixed_seconds_tiny_model": {k: round(median(v), 3) for k, v in fixed.items()},
            # CPU time (this process, user + system) is what the code spends; wall time on a shared
            # machine also holds other processes' share and the disk's.
            "median_cpu_seconds": {k: round(median(v), 3) for k, v in CPU_TIMES.items()},
            "cpu_ratio_hf_to_megatron": round(median(cpu_round["hf->mcore"]), 2),
            "cpu_ratio_megatron_to_hf": round(median(cpu_round["mcore->hf"]), 2),
        }
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
