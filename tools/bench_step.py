"""The real Trainer's SPO step against megatron-core's plain LM training step of the same model, on one device.

    python tools/bench_step.py --out $OUT                     # GPU: Llama-3.2-1B shape, random bf16 weights
    python tools/bench_step.py --device cpu --size tiny --out /tmp/bench   # the same code, a tiny model, seconds

Each case (8 sequences of 4096 tokens, 4 per micro-batch; one sequence of 16k tokens) builds one Trainer (SPO, no engines: an
in-process source of random token sequences, a 256-token prompt each, groups of 4) and times, on the same
micro-batches, model and optimizer:
  - the SPO step: Trainer.train_step() (reference forward, policy forward + backward with the fused log-prob op and
    the loss, optimizer step), split into reference forward / policy forward + backward / optimizer step;
  - the LM step: megatron-core's own language-model loss (GPTModel with labels: logits of every token and its
    vocab-parallel cross-entropy, as megatron's pretraining computes it) through the same pipeline schedule, then the
    same optimizer's step.
The first step of each is a warm-up and not counted. tokens/s counts every token the step's sequences hold.
MFU = achieved model FLOP/s / the device's dense bf16 peak (--peak-tflops, default 989 for an H100 SXM), with the
model FLOPs of one training token = 6 * P + 6 * L * S * d_attn (P the parameters of the layers and the LM head,
embedding excluded; the second term causal attention's QK^T and AV forward and backward, S the sequence's length,
d_attn = heads * head_dim) and the SPO step's reference forward not counted as useful work (so its ideal ratio to
the LM step is 3 / 4 = 0.75). Writes --out/step_bench.json and step_bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

from bench_packing import RandomTrajectories  # tools/ is on sys.path when a tool runs

SHAPES = {  # (hidden, ffn, layers, heads, kv heads, vocab)
    "full": dict(hidden_size=2048, ffn_hidden_size=8192, num_layers=16, num_attention_heads=32, num_query_groups=8,
                 vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),  # Llama-3.2-1B
    "tiny": dict(hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                 vocab_size=1000, tie_word_embeddings=False),
}
PROMPT = 256


def write_random_hf(out: Path, model_cfg, device: str) -> str:
    """A random checkpoint of the config's shape (bf16; norms 1, the rest N(0, 0.02)), written tensor by tensor."""
    import torch

    from megatron_spo.models.hf_checkpoint import HFWriter, write_hf_config
    from megatron_spo.models.hf_map import hf_shapes

    g = torch.Generator(device=device).manual_seed(0)
    with HFWriter(out) as writer:
        for name, shape in hf_shapes(model_cfg).items():
            if "norm" in name:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
            writer.add(name, t.cpu())
    write_hf_config(out, model_cfg)
    return str(out)


def model_flops_per_token(model_cfg, seq: int) -> float:
    """6 * (layer + LM-head parameters) + 6 * layers * seq * heads * head_dim (causal attention, fwd + bwd)."""
    embedding = model_cfg.vocab_size * model_cfg.hidden_size
    params = model_cfg.num_parameters() - embedding
    if model_cfg.tie_word_embeddings:
        params += embedding  # the tied matrix is also the LM head's GEMM
    attn = 6 * model_cfg.num_layers * seq * model_cfg.num_attention_heads * model_cfg.head_dim
    return 6.0 * params + attn


class Timer:
    def __init__(self, cuda: bool):
        self.cuda, self.totals = cuda, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0


def lm_step(trainer, mbs) -> float:
    """megatron-core's language-model training step on the trainer's policy, micro-batches and optimizer; the loss."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks, optimizer = trainer.policy, trainer.optimizer
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    layouts = trainer._layouts(mbs)
    packed = trainer.cfg.batch.pack_sequences
    losses = []

    def forward_step(data_iterator, model):
        i, mb = next(data_iterator)
        lay = layouts[i]
        # every token of every sequence is a target (pretraining's loss); not the padding
        valid = (torch.arange(mb.input_ids.shape[1], device=mb.input_ids.device)[None] < mb.lengths[:, None]).float()
        if packed:
            out = model(lay.input_ids, lay.position_ids, None, labels=lay.gather(mb.targets)[None],
                        packed_seq_params=lay.params())
            mask = lay.gather(valid)[None]
        else:
            out = model(mb.input_ids, mb.position_ids, None, labels=mb.targets)
            mask = valid

        def loss_func(per_token):
            loss = (per_token.float() * mask).sum() / mask.sum() / len(mbs)
            losses.append(float(loss.detach()) * len(mbs))
            return loss, {}

        return out, loss_func

    seq = max(lay.num_tokens for lay in layouts) if packed else max(mb.input_ids.shape[1] for mb in mbs)
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(list(enumerate(mbs))),
                                model=chunks, num_microbatches=len(mbs), seq_length=seq,
                                micro_batch_size=1 if packed else max(mb.num_sequences for mb in mbs),
                                forward_only=False)
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("LM step: the optimizer skipped the update (non-finite gradients)")
    return sum(losses) / len(losses)


def run_case(root: Path, hf: str, model_cfg, args, seq: int, sequences: int, budget: int, last: bool) -> dict:
    import torch

    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.micro_batches import micro_batches, shard
    from megatron_spo.training.trainer import Trainer

    cuda = args.device == "cuda"
    cfg = TrainConfig.model_validate(dict(
        run_dir=str(root / f"seq{seq}"), steps=10_000, algo="spo", beta=0.1, init={"hf": hf},
        model=model_cfg.model_dump(), optimizer={"lr": 1e-6, "warmup_steps": 0},
        model_update_interval=10_000, checkpoint={"interval": 10_000},
        logging={"progress": False, "wandb_mode": "disabled"},
        parallel={"recompute_granularity": args.recompute} if args.recompute == "selective" else {},
        batch={"sequences_per_step": sequences, "max_tokens_per_micro_batch": budget, "max_seq_length": seq + 1}))
    prompt = min(PROMPT, seq // 4)
    source = RandomTrajectories(lambda rng: seq + 1 - prompt, prompt, model_cfg.vocab_size)
    trainer = Trainer(cfg, online_source=source)
    timer = Timer(cuda)
    for name in ("forward", "optimize"):  # the time split of the SPO step, by the trainer's own verbs
        method = getattr(trainer, name)

        def timed(model, *a, _method=method, _name=name, **kw):
            label = "reference forward" if (_name, model) == ("forward", "reference") else (
                "policy forward (no grad)" if _name == "forward" else "policy forward + backward + optimizer")
            with timer(label):
                return _method(model, *a, **kw)
        setattr(trainer, name, timed)
    tokens = sequences * seq
    spo_times, lm_times, spo_peak, lm_peak, lm_loss = [], [], 0, 0, float("nan")
    try:
        for i in range(args.steps + 1):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            if i == 1:
                timer.totals.clear()
            t0 = time.perf_counter()
            trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
                spo_peak = max(spo_peak, torch.cuda.max_memory_allocated())
            if i:
                spo_times.append(time.perf_counter() - t0)
        trajs = source.take(sequences)
        mbs = micro_batches(shard(trajs, 0, 1), cfg, keep_groups=False, pad_id=0, dp_rank=0, device=trainer.device)
        for i in range(args.steps + 1):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            lm_loss = lm_step(trainer, mbs)
            if cuda:
                torch.cuda.synchronize()
                lm_peak = max(lm_peak, torch.cuda.max_memory_allocated())
            if i:
                lm_times.append(time.perf_counter() - t0)
        if args.profile:
            profile_steps(trainer, mbs, out_dir=Path(args.out), tag=f"{sequences}x{seq}", cuda=cuda)
    finally:
        trainer.close(keep_process_group=not last)
    spo_s, lm_s = sum(spo_times) / len(spo_times), sum(lm_times) / len(lm_times)
    flops = model_flops_per_token(model_cfg, seq) * tokens
    # what `megatron-spo plan` counts for an SPO step (8 N per token: forward + backward + the reference forward, N
    # every parameter; 6 L S h causal attention), so `plan --measured` can turn this step's time into its TFLOP/s
    plan_flops = (8 * model_cfg.num_parameters() + 6 * model_cfg.num_layers * seq * model_cfg.hidden_size) * tokens
    split = {k: v / args.steps for k, v in timer.totals.items()}
    return {"seq": seq, "sequences": sequences, "micro_batch_tokens": budget, "micro_batches": len(mbs),
            "spo_step_s": spo_s, "lm_step_s": lm_s, "spo_tokens_per_s": tokens / spo_s, "lm_tokens_per_s": tokens / lm_s,
            "spo_over_lm": lm_s / spo_s, "lm_mfu": flops / lm_s / (args.peak_tflops * 1e12),
            "spo_mfu": flops / spo_s / (args.peak_tflops * 1e12), "spo_plan_tflops": plan_flops / spo_s / 1e12,
            "spo_peak_gib": spo_peak / 2**30,
            "lm_peak_gib": lm_peak / 2**30, "lm_loss": lm_loss, "spo_split_s": split}


def profile_steps(trainer, mbs, *, out_dir: Path, tag: str, cuda: bool) -> None:
    """One more SPO step and LM step under torch.profiler (kernel times) and cProfile (where the host waits or
    works): out_dir/profile_<tag>.txt. For finding what a step spends beyond its GEMMs; not timed."""
    import cProfile
    import io
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sections = []
    for name, step in (("SPO step", trainer.train_step), ("LM step", lambda: lm_step(trainer, mbs))):
        with profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        averages = prof.key_averages()
        for key in ("self_cuda_time_total", "self_device_time_total", "self_cpu_time_total"):
            try:
                table = averages.table(sort_by=key, row_limit=35)
                break
            except (AttributeError, KeyError, ValueError):
                continue
        host = cProfile.Profile()
        t0 = time.perf_counter()
        host.enable()
        step()
        if cuda:
            torch.cuda.synchronize()
        host.disable()
        wall = time.perf_counter() - t0
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(45)
        sections.append(f"## {name}: kernels (torch.profiler, sorted by {key})\n\n{table}\n\n"
                        f"## {name}: host (cProfile, {wall:.3f} s wall, sorted by cumulative time)\n\n"
                        f"{text.getvalue()[-12000:]}")
    (out_dir / f"profile_{tag}.txt").write_text("\n\n".join(sections))


def markdown(report: dict) -> str:
    lines = [f"# SPO step vs megatron-core's LM step ({report['device']}, {report['date']})", "",
             f"Model: {report['model']}; {report['note']}", "",
             "| case | tokens / step | SPO tokens/s | LM tokens/s | SPO / LM | LM MFU | SPO MFU | SPO peak GiB | "
             "LM peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for c in report["cases"]:
        if "error" in c:
            lines.append(f"| {c['sequences']} x {c['seq']} | {c['sequences'] * c['seq']} | failed: {c['error'][:200]} "
                         "| | | | | | |")
            continue
        lines.append(f"| {c['sequences']} x {c['seq']} | {c['sequences'] * c['seq']} | {c['spo_tokens_per_s']:.0f} | "
                     f"{c['lm_tokens_per_s']:.0f} | {c['spo_over_lm']:.2f} | {c['lm_mfu']:.1%} | {c['spo_mfu']:.1%} | "
                     f"{c['spo_peak_gib']:.1f} | {c['lm_peak_gib']:.1f} |")
    lines += ["", "SPO step time split (s per step):", ""]
    for c in report["cases"]:
        if "error" in c:
            continue
        parts = ", ".join(f"{k} {v:.3f}" for k, v in c["spo_split_s"].items())
        lines.append(f"- {c['sequences']} x {c['seq']}: step {c['spo_step_s']:.3f}; {parts}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size", choices=list(SHAPES), default="full")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each kind (after one warm-up)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the device (H100 SXM: 989)")
    ap.add_argument("--recompute", choices=["none", "selective"], default="none")
    ap.add_argument("--profile", action="store_true", help="profile one more step of each kind: out/profile_*.txt")
    ap.add_argument("--cases", default="", help="comma list of case indices to run (default all)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    from megatron_spo.models.config import ModelConfig

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_step: --device cuda but no GPU is visible (use --device cpu)")
    if args.device == "cpu":
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_cfg = ModelConfig(**SHAPES[args.size], params_dtype=dtype, max_position_embeddings=32_768)
    # (seq, sequences, micro-batch budget): 4096-token sequences, a prompt group of 4 per micro-batch (whole groups:
    # no third pass for the centred coefficient); one 16k-token sequence
    cases = [(4096, 8, 16_384), (16_384, 1, 16_384)] if args.size == "full" else [(96, 8, 384), (384, 1, 384)]
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d"), "model": f"{args.size} ({model_cfg.num_parameters() / 1e9:.2f} B "
              f"parameters, {dtype})", "note": f"one device, packed micro-batches, recompute {args.recompute}; "
              f"MFU against {args.peak_tflops:g} TFLOP/s", "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = write_random_hf(root / "hf", model_cfg, "cuda" if args.device == "cuda" else "cpu")
        for i, case in enumerate(cases):
            try:
                report["cases"].append(run_case(root, hf, model_cfg, args, *case, last=i == len(cases) - 1))
            except Exception as err:  # a case that fails (e.g. out of memory) is reported; the others still run
                seq, sequences, budget = case
                report["cases"].append({"seq": seq, "sequences": sequences, "micro_batch_tokens": budget,
                                        "error": f"{type(err).__name__}: {str(err)[:500]}"})
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            # written after every case: a run stopped by its time limit still leaves what it measured
            (out / "step_bench.json").write_text(json.dumps(report, indent=1))
            (out / "step_bench.md").write_text(markdown(report))
    print(markdown(report))
    return 1 if any("error" in c for c in report["cases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
