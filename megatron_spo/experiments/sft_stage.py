"""SFT on an offline source's trajectories: the first stage of "SFT then GRPO" (and of SPO after the same SFT).

    policy = sft_on_trajectories(ref_dir, records, out_dir, SFTStageConfig(steps=60))   # an HF checkpoint

Cross-entropy on the response tokens only (prompt tokens masked), the mean over the batch's response tokens, on
the records that pass (reward >= 0: SFT imitates, it cannot use failures), drawn uniformly with replacement
(seeded). AdamW, linear warm-up then constant lr, grad-norm clip 1. The result is a complete HF checkpoint (the
reference's config and tokenizer, the trained weights, digests.json) that the quickstart converts for the
trainer and serves as the arm's pi_0.

Early stopping (eval_every > 0), the common recipe: every eval_every steps the mean response NLL on validation
records (the validation problems' trajectories, never trained on) is measured, and the weights of the best such
step are kept; cfg.steps is then the most it trains.

The stage is deterministic (cfg.seed, not the run's seed): `sft_cached` trains once per (reference weights, data,
settings) into a folder named by their digest, which the arms of a study's seed share (sft-grpo and sft-spo).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import Field

from megatron_spo.config import StrictModel

IGNORE_INDEX = -100
SFT_INFO = "sft_info.json"


class SFTStageConfig(StrictModel):
    """The SFT budget a study gives every arm that uses it (steps x batch_size sequences)."""

    steps: int = Field(0, ge=0, description="0: no SFT stage")
    batch_size: int = Field(16, gt=0, description="sequences per step")
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(5, ge=0)
    seed: int = 0
    num_threads: int = Field(2, gt=0, description="torch CPU threads during SFT")
    eval_every: int = Field(0, ge=0, description="early stopping: every N steps the response NLL on the validation "
                            "problems' trajectories (quickstart validation_problems), keeping the best step's "
                            "weights (steps is then the most); 0: keep the last step's")


def sft_batch(records: Sequence, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] input_ids / attention_mask and labels = response tokens (IGNORE_INDEX on prompt and
    padding), T = the longest prompt + response."""
    seqs = [(list(r.prompt_tokens), list(r.response_tokens)) for r in records]
    width = max(len(p) + len(a) for p, a in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, a) in enumerate(seqs):
        n = len(p) + len(a)
        input_ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def response_nll(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean negative log-likelihood per response token (nats): the SFT loss."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=IGNORE_INDEX)


@torch.no_grad()
def validation_nll(model, records: Sequence, pad_id: int, batch_size: int) -> float:
    """Mean response NLL per token (nats) over ``records``, every token weighted alike."""
    was_training, total, tokens = model.training, 0.0, 0
    model.eval()
    for i in range(0, len(records), batch_size):
        batch = sft_batch(records[i:i + batch_size], pad_id)
        n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        total, tokens = total + response_nll(model, batch).item() * n, tokens + n
    model.train(was_training)
    return total / max(1, tokens)


def sft_on_trajectories(ref: str | Path, records: Sequence, out: str | Path, cfg: SFTStageConfig,
                        pass_reward: float = 0.0, validation: Sequence = ()) -> Path:
    """Train a copy of the HF checkpoint ``ref`` for cfg.steps on the passing ``records`` (early-stopped on the
    passing ``validation`` records when cfg.eval_every > 0); write it to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_spo.checkpoint_digest import write_manifest

    good = [r for r in records if r.reward >= pass_reward]
    if not good:
        raise ValueError(f"sft: none of the {len(records)} trajectories passes (reward >= {pass_reward}): nothing "
                         "to imitate")
    held = [r for r in validation if r.reward >= pass_reward]
    if cfg.eval_every and not held:
        raise ValueError(f"sft.eval_every {cfg.eval_every}: early stopping needs passing trajectories of the "
                         f"validation problems ({len(validation)} given, none passing); set validation_problems "
                         "and give offline_data for those problems, or sft.eval_every=0")
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        torch.manual_seed(cfg.seed)
        tokenizer = AutoTokenizer.from_pretrained(str(ref))
        model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
        rng = random.Random(cfg.seed)
        model.train()
        losses, t0 = [], time.perf_counter()
        curve: list[tuple[int, float]] = []  # (steps done, validation NLL)
        best = None  # (NLL, steps done, weights)

        def evaluate(done: int) -> None:
            nonlocal best
            curve.append((done, validation_nll(model, held, tokenizer.pad_token_id, cfg.batch_size)))
            if best is None or curve[-1][1] < best[0]:
                best = (curve[-1][1], done, {k: v.detach().clone() for k, v in model.state_dict().items()})

        if cfg.eval_every:
            evaluate(0)
        for step in range(cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))
            loss = response_nll(model, sft_batch([rng.choice(good) for _ in range(cfg.batch_size)],
                                                 tokenizer.pad_token_id))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                evaluate(step + 1)
        if best is not None:
            model.load_state_dict(best[2])
        model.eval()
    finally:
        torch.set_num_threads(before)
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    for name in ("build_info.json",):  # the reference's build info names the recipe (reference_identity reads it)
        if (Path(ref) / name).is_file():
            shutil.copyfile(Path(ref) / name, out / name)
    info = {"from": str(ref), "settings": cfg.model_dump(), "trajectories": len(good), "dropped_failing":
            len(records) - len(good), "first_loss": losses[0] if losses else None,
            "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])), "seconds": time.perf_counter() - t0,
            "chosen_step": best[1] if best is not None else cfg.steps,
            "validation_nll": [{"step": k, "nll": v} for k, v in curve], "validation_trajectories": len(held)}
    (out / SFT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    write_manifest(out)
    return out


def sft_key(reference_sha256: str, records: Sequence, validation: Sequence, cfg: SFTStageConfig) -> str:
    """The digest (hex) of what decides the SFT'd weights: the reference's weights, every record's tokens and reward
    in order (the draws index them), the validation records, and the settings."""
    h = hashlib.sha256(json.dumps({"reference": reference_sha256, "settings": cfg.model_dump()}).encode())
    for part, rows in (("train", records), ("validation", validation)):
        h.update(part.encode())
        for r in rows:
            h.update(json.dumps([list(r.prompt_tokens), list(r.response_tokens), float(r.reward)]).encode())
    return h.hexdigest()


def sft_cached(ref: str | Path, records: Sequence, cache_root: str | Path, cfg: SFTStageConfig, reference_sha256: str,
               validation: Sequence = ()) -> tuple[Path, bool]:
    """(the SFT'd checkpoint, whether it was reused): cache_root/sft-<sft_key[:16]>, trained there by
    sft_on_trajectories unless a complete one is (its digests verified); written under a .partial name and renamed,
    so a stopped stage leaves nothing that looks done."""
    from megatron_spo.checkpoint_digest import MANIFEST, verify_manifest

    out = Path(cache_root) / f"sft-{sft_key(reference_sha256, records, validation, cfg)[:16]}"
    if (out / MANIFEST).is_file():
        verify_manifest(out)  # a corrupted copy is an error naming the file, not a silently different pi_0
        return out, True
    partial = out.with_name(out.name + ".partial")
    sft_on_trajectories(ref, records, partial, cfg, validation=validation)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out, False
