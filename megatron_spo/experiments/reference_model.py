"""The quickstart's reference policy pi_0: a tiny HF model (Llama by default), supervised-trained on a generated task, cached.

    path = build_reference(QuickstartModelConfig())   # ~/.cache/megatron-spo/quickstart-ref-<hash>
    model = AutoModelForCausalLM.from_pretrained(path); tokenizer = AutoTokenizer.from_pretrained(path)

The directory is a plain transformers checkpoint (config.json, generation_config.json, model.safetensors,
tokenizer.json, ...) plus build_info.json (settings, SFT time, losses). It is keyed by a hash of every
setting that changes the weights, written to a temporary directory and renamed into place (a crash never
leaves a directory that looks complete), and reused when present.

SFT data: each step draws ``batch_size`` problems (train split + SFT-only pipelines, never held-out ones)
and one of each problem's reference programs; with probability ``swap_fraction`` the target is a
neighbouring problem's program instead (a problem-specific error), and with probability ``slip_fraction`` it
carries its family's input-parsing slip (toy_code.with_input_slip: a generic error, the same on every problem),
so pi_0 is right only part of the time (room for RL, not zero) and part of what RL can fix transfers to
problems it never trains on. ``task.kind=toy_math`` (or ``task=toy_math``) builds the reference for the arithmetic
word problems instead (data/toy_math.py): there the slip drops the last step of the teacher's solution
(toy_math.with_slip), and the model is cached under its own key.
Loss: next-token cross-entropy on the program and its EOS only (the prompt is context).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from megatron_spo.checkpoint_digest import write_manifest
from megatron_spo.config import load_config
from megatron_spo.data import toy_code, toy_math
from megatron_spo.data.char_tokenizer import ALPHABET, SPECIAL_TOKENS, build_char_tokenizer
from megatron_spo.data.tasks import GENERATED_TASKS, generated_task
from megatron_spo.experiments.config import QuickstartModelConfig
from megatron_spo.fsutil import sha256_file

REFERENCE_VERSION = 2  # bump when the SFT recipe changes (part of the cache key)
BUILD_INFO = "build_info.json"
IGNORE_INDEX = -100


def task_from_config(cfg: QuickstartModelConfig) -> toy_code.ToyCodeTask | toy_math.ToyMathTask:
    return generated_task(GENERATED_TASKS[cfg.task.kind], cfg.task)


def with_slip(problem, text: str) -> str:
    """The SFT target with its task's slip: the code task's input-parsing slip, the math task's dropped step."""
    if isinstance(problem, toy_math.Problem):
        return toy_math.with_slip(problem, text)
    return toy_code.with_input_slip(problem.family, text)


def cache_key(cfg: QuickstartModelConfig) -> str:
    """12 hex digits of a hash over everything that changes the saved weights (not num_threads)."""
    settings = cfg.model_dump(mode="json", exclude={"num_threads"} | ({"moe"} if cfg.moe is None else set()))
    math_task = settings["task"].pop("kind") == "toy_math"  # toy_code keys stay what they were before kinds
    blob = json.dumps(
        {
            "settings": settings,
            "generator": toy_code.GENERATOR_VERSION,
            **({"task": "toy_math", "math_generator": toy_math.GENERATOR_VERSION} if math_task else {}),
            "recipe": REFERENCE_VERSION,
            "vocab": list(SPECIAL_TOKENS) + list(ALPHABET),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    return Path(os.environ.get("MEGATRON_SPO_CACHE", Path.home() / ".cache" / "megatron-spo"))


def reference_dir(cfg: QuickstartModelConfig, cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / f"quickstart-ref-{cache_key(cfg)}"


def reference_hf_config(cfg: QuickstartModelConfig, tokenizer):
    """The transformers config of the reference: its family's config.json (models/arch/), so the
    quickstart can start from any registered architecture (``reference.architecture``)."""
    from transformers import AutoConfig

    from megatron_spo.models.config import ModelConfig
    from megatron_spo.models.hf_checkpoint import model_config_to_hf_config

    model_cfg = ModelConfig(
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        vocab_size=len(tokenizer),
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        norm_epsilon=cfg.norm_epsilon,
        moe=cfg.moe,
    )
    token_ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    raw = model_config_to_hf_config(model_cfg, token_ids)
    raw.pop("architectures")
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


# ---------------------------------------------------------------------------------------------
# SFT batches
# ---------------------------------------------------------------------------------------------
def encode_example(tokenizer, prompt: str, program: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels): BOS + prompt + program + EOS; labels are IGNORE_INDEX on BOS and the prompt."""
    prompt_ids = tokenizer(prompt)["input_ids"]  # BOS comes from the post-processor
    program_ids = tokenizer(program, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + program_ids, [IGNORE_INDEX] * len(prompt_ids) + program_ids


class SFTSampler:
    """Draws (prompt, target program) pairs from the train split, swapping some targets for a neighbour's."""

    def __init__(self, task: toy_code.ToyCodeTask | toy_math.ToyMathTask, swap_fraction: float, seed: int,
                 slip_fraction: float = 0.0):
        self.task = task
        self.slip_fraction = slip_fraction
        self.num_slipped = 0
        self.pool = task.sft_problems  # train split + SFT-only pipelines; never a held-out prompt
        self.swap_fraction = swap_fraction
        self.rng = random.Random(seed)
        self.num_swapped = 0
        self.num_drawn = 0

    def draw(self) -> tuple[str, str]:
        problem = self.rng.choice(self.pool)
        source = problem
        if self.rng.random() < self.swap_fraction and problem.id in self.task.neighbour:
            source = self.task.by_id(self.task.neighbour[problem.id])
            self.num_swapped += 1
        self.num_drawn += 1
        program = self.rng.choice(source.solutions)
        if self.slip_fraction and self.rng.random() < self.slip_fraction:
            program = with_slip(source, program)
            self.num_slipped += 1
        return problem.prompt, program


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] input_ids, labels (IGNORE_INDEX on padding) and attention_mask."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def lr_at(step: int, cfg: QuickstartModelConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.sft_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def _quiet_transformers():
    """No 'Writing model shards' bar under our own progress display."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def train_sft(model, tokenizer, task: toy_code.ToyCodeTask | toy_math.ToyMathTask, cfg: QuickstartModelConfig,
              progress: bool = True) -> dict:
    """Run cfg.sft_steps AdamW steps in place; returns a summary (losses, timings, swap rate)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    sampler = SFTSampler(task, cfg.swap_fraction, seed=cfg.seed + 1, slip_fraction=cfg.slip_fraction)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    columns = (TextColumn("[bold]SFT reference"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress, transient=False) as bar:
        bar_task = bar.add_task("sft", total=cfg.sft_steps, loss=float("nan"))
        for step in range(cfg.sft_steps):
            batch = collate(
                [encode_example(tokenizer, *sampler.draw()) for _ in range(cfg.batch_size)], tokenizer.pad_token_id
            )
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            recent = sum(losses[-20:]) / len(losses[-20:])
            bar.update(bar_task, advance=1, loss=recent)
            if progress and not bar.console.is_terminal and (step + 1) % max(1, cfg.sft_steps // 10) == 0:
                # logs and CI: a plain line every 10% (a live bar only draws on a terminal)
                bar.console.print(f"SFT step {step + 1}/{cfg.sft_steps} loss {recent:.3f} "
                                  f"{time.perf_counter() - start:.0f}s")
    model.eval()
    tail = losses[-50:] or [float("nan")]
    return {
        "sft_seconds": round(time.perf_counter() - start, 2),
        "steps": cfg.sft_steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(tail) / len(tail),
        "swapped_fraction": sampler.num_swapped / max(1, sampler.num_drawn),
        "slipped_fraction": sampler.num_slipped / max(1, sampler.num_drawn),
    }


# ---------------------------------------------------------------------------------------------
# Build (cached, atomic)
# ---------------------------------------------------------------------------------------------
def build_reference(
    cfg: QuickstartModelConfig | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """The reference model's directory, building it (SFT) unless a complete one is cached.

    cache_dir: the cache root (default $MEGATRON_SPO_CACHE or ~/.cache/megatron-spo); the model goes in
    <cache_dir>/quickstart-ref-<hash>. force: rebuild even when cached (the old one is replaced atomically).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = cfg or QuickstartModelConfig()
    final = reference_dir(cfg, cache_dir)
    if final.is_dir() and (final / BUILD_INFO).is_file() and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)

    with _torch_threads(cfg.num_threads):
        torch.manual_seed(cfg.seed)
        tokenizer = build_char_tokenizer()
        task = task_from_config(cfg)
        model = AutoModelForCausalLM.from_config(reference_hf_config(cfg, tokenizer))
        summary = train_sft(model, tokenizer, task, cfg, progress=progress)

    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _quiet_transformers():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {
        "cache_key": cache_key(cfg),
        "settings": cfg.model_dump(mode="json"),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_train_problems": len(task.train),
        "num_heldout_problems": len(task.heldout),
        "built_at": time.time(),
        **summary,
    }
    (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    write_manifest(tmp)  # its digests: the quickstart's conversion checks them (checkpoint_digest.py)
    if final.exists():  # force, or another process finished first
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:  # a concurrent builder renamed its (equivalent) directory in first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_build_info(path: str | Path) -> dict:
    return json.loads((Path(path) / BUILD_INFO).read_text())


def reference_identity(path: str | Path) -> dict:
    """{"cache_key", "sha256"}: the reference by its weights' content. The cache key names the recipe; the same
    recipe rebuilt on another machine can give other weights (the SFT's float sums follow the CPU's kernels)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (not a built reference)")
    digest = hashlib.sha256("".join(f"{f.name}:{sha256_file(f)}\n" for f in files).encode()).hexdigest()
    return {"cache_key": read_build_info(path).get("cache_key"), "sha256": digest}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo reference", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="YAML with QuickstartModelConfig fields (optional)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft_steps=400 task.seed=1")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--eval", type=int, default=0, metavar="N", help="then print held-out pass@1 / pass@10 "
                        "from N samples per problem at T 0.4 (transformers' sampling; 0: no evaluation)")
    args = parser.parse_args(argv)
    config_path = args.config
    overrides = list(args.overrides)
    if config_path is not None and "=" in config_path:  # only overrides given
        overrides.insert(0, config_path)
        config_path = None
    cfg = load_config(QuickstartModelConfig, config_path, overrides)
    path = build_reference(cfg, args.cache_dir, force=args.force)
    info = read_build_info(path)
    print(f"{path}  ({info['num_parameters']} parameters, SFT {info['sft_seconds']} s, final loss {info['final_loss']:.3f})")
    if args.eval:
        from megatron_spo.experiments.reference_eval import evaluate_reference

        heldout = task_from_config(cfg).heldout
        result = evaluate_reference(path, heldout, n=args.eval, ks=(1, min(10, args.eval)), threads=cfg.num_threads)
        print(f"{cfg.task.kind} held-out ({len(heldout)} problems x {args.eval} samples, T 0.4): "
              + ", ".join(f"pass@{k} {v:.3f}" for k, v in result.mean.items()))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
