"""TRL's GRPOTrainer on our task: an outside reference implementation of GRPO, for benchmarks only.

    hf = train_trl_grpo(ref_dir, prompts, RewardPool(SandboxPool(cfg)), out_dir, steps=90, lr=2e-4, beta=0.5,
                        prompts_per_step=4, samples_per_prompt=8, max_new_tokens=96, warmup_steps=10, seed=0)
    read_metrics(out_dir)        # one record per optimizer step, the trainer's metrics.jsonl format

Same inputs as our trainer: the HF checkpoint at ref_dir (policy and KL reference), token-for-token the same
prompts (``prompt.tokens``; checked at start-up), and the same reward: each completion is decoded as our engines
decode it (``tokenizer.decode(output_ids, skip_special_tokens=True)``, output_ids up to and including the first
EOS, or max_new_tokens tokens when none came: scored as is, like a finish_reason "length" rollout) and scored by
OUR RewardPool (the sandboxed tests) against the prompt's problem. Everything else is TRL 1.16's documented
GRPOConfig defaults (loss_type "dapo", scale_rewards "group", epsilon 0.2, num_iterations 1, linear LR decay
after warm-up, AdamW betas (0.9, 0.999)), except: on CPU in float32 (no bf16), no gradient checkpointing (it
changes nothing but speed), one optimizer step per generation batch of prompts_per_step * samples_per_prompt
completions (per_device_train_batch_size = generation_batch_size = that, gradient_accumulation_steps 1, so
TRL's global_step == our step and the samples are on-policy), logging every step, saving only at the end.

Metrics (out_dir/metrics.jsonl, read_metrics reads it): our names where the quantity is the same one (loss,
reward, grad_norm, lr, entropy, clip_fraction, kl_ref_k3 = TRL's "kl": the per-token k3 estimate of
KL(pi || pi_0) on the batch, what our GRPO logs as kl_ref_k3; it is also written as "kl", which for our SPO/AGRO
is the per-SEQUENCE log(pi / pi_0) instead), "time" = seconds since training started, "time/step", and TRL's
other metrics under "trl/<name>". The trained model goes to out_dir/hf (safetensors, config.json, the reference's
tokenizer and generation config files, the reference's dtype).

TRL is an optional dependency: pip install megatron-spo[bench].
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_spo.data.prompts import Prompt

TRL_MISSING = "TRL is not installed: pip install megatron-spo[bench] (the benchmark-only GRPO baseline needs it)"

# TRL's logged names -> ours (the same quantity); the rest are kept as "trl/<name>".
METRIC_NAMES = {
    "loss": "loss",
    "reward": "reward",
    "grad_norm": "grad_norm",
    "learning_rate": "lr",
    "entropy": "entropy",
    "clip_ratio/region_mean": "clip_fraction",
}
# Logged by Trainer itself at the end (a summary, not a step) or pure bookkeeping.
_SKIPPED = {"epoch", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
            "train_loss"}


# ---------------------------------------------------------------------------------------------
# Prompts: the text TRL is given re-tokenizes to exactly prompt.tokens
# ---------------------------------------------------------------------------------------------
def trl_tokenize(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """How GRPOTrainer (1.16, ``_tokenize_prompts``) turns plain-text (non-conversational) prompts into ids:
    ``processing_class(text=prompts)["input_ids"]``, the tokenizer's default special tokens included (BOS), no
    chat template, no truncation."""
    return lambda texts: [list(ids) for ids in tokenizer(text=list(texts))["input_ids"]]


def prompt_texts(prompts: Sequence[Prompt], tokenizer, tokenize: Callable[[list[str]], list[list[int]]] | None = None
                 ) -> list[str]:
    """A text per prompt that ``tokenize`` (default: TRL's plain-text tokenization) turns into exactly
    prompt.tokens. Tried in order: the decoded tokens after a leading BOS (TRL's tokenizer adds it back), all
    tokens decoded with their special tokens, and without them. ValueError naming the prompt and the first
    differing position when none fits."""
    tokenize = tokenize or trl_tokenize(tokenizer)
    bos = getattr(tokenizer, "bos_token_id", None)
    texts = []
    for p in prompts:
        tokens = list(p.tokens)
        candidates = []
        if bos is not None and tokens and tokens[0] == bos:
            candidates.append(tokenizer.decode(tokens[1:], skip_special_tokens=False))
        candidates += [tokenizer.decode(tokens, skip_special_tokens=False),
                       tokenizer.decode(tokens, skip_special_tokens=True)]
        candidates = list(dict.fromkeys(candidates))
        fits = [c for c, ids in zip(candidates, tokenize(candidates)) if ids == tokens]
        if not fits:
            raise ValueError(_mismatch(p, tokenize([candidates[0]])[0]))
        texts.append(fits[0])
    return texts


def check_prompt_tokens(prompts: Sequence[Prompt], texts: Sequence[str],
                        tokenize: Callable[[list[str]], list[list[int]]]) -> None:
    """ValueError unless ``tokenize(texts)`` (TRL's own tokenization) gives every prompt's tokens exactly."""
    got = tokenize(list(texts))
    for p, ids in zip(prompts, got, strict=True):
        if list(ids) != list(p.tokens):
            raise ValueError(_mismatch(p, list(ids)))


def _mismatch(prompt: Prompt, ids: list[int]) -> str:
    tokens = list(prompt.tokens)
    at = next((i for i, (a, b) in enumerate(zip(tokens, ids)) if a != b), min(len(tokens), len(ids)))
    return (f"trl_grpo: TRL would feed prompt '{prompt.prompt_id}' as {len(ids)} tokens, not its {len(tokens)} "
            f"prompt.tokens (first difference at position {at}: {ids[at:at + 4]} vs {tokens[at:at + 4]}); "
            "the baseline would not train on the same prompts as our trainer")


# ---------------------------------------------------------------------------------------------
# Rewards: our RewardPool, on the text our engines would return
# ---------------------------------------------------------------------------------------------
def completion_text(tokenizer, completion_ids: Sequence[int]) -> str:
    """The text our rollout scores for these output ids (engine_server / SGLang: decode with
    skip_special_tokens=True; the ids run up to and including the first EOS, or stop at max_new_tokens,
    truncated text scored as is)."""
    return tokenizer.decode(list(completion_ids), skip_special_tokens=True)


def reward_function(reward_pool, prompts: Sequence[Prompt], tokenizer, seconds: dict[str, float] | None = None):
    """The reward function handed to GRPOTrainer: async (TRL awaits it on its own event loop), one float per
    completion, each scored by ``reward_pool`` against the problem of its row's ``prompt_id`` (a dataset
    column), as engine_tools.sampling.score_all does (each distinct text of a prompt once, concurrently).
    ``seconds["reward"]``, when given, accumulates the wall time spent scoring."""
    from megatron_spo.engine_tools.sampling import gather_or_cancel, score_all

    problems = {p.prompt_id: p.problem for p in prompts}

    async def megatron_spo_reward(prompts=None, completions=None, completion_ids=None, prompt_id=None,
                                  **_: Any) -> list[float]:
        if completion_ids is None or prompt_id is None:
            raise ValueError("trl_grpo reward: TRL passed no completion_ids / prompt_id column")
        t0 = time.perf_counter()
        texts = [completion_text(tokenizer, ids) for ids in completion_ids]
        rows: dict[str, list[int]] = {}
        for i, pid in enumerate(prompt_id):
            if pid not in problems:
                raise KeyError(f"trl_grpo reward: unknown prompt_id '{pid}'")
            rows.setdefault(pid, []).append(i)
        results = await gather_or_cancel([score_all(reward_pool, problems[pid], [texts[i] for i in idx])
                                          for pid, idx in rows.items()])
        rewards = [math.nan] * len(texts)
        for idx, group in zip(rows.values(), results):
            for i, result in zip(idx, group):
                rewards[i] = float(result.reward)
        if seconds is not None:
            seconds["reward"] = seconds.get("reward", 0.0) + time.perf_counter() - t0
        return rewards

    return megatron_spo_reward


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def _checkpointing_field(config_cls) -> str:
    """transformers 5.x renamed gradient_checkpointing to activation_checkpointing (the old name warns)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_cls)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def _config_json(path: Path) -> dict:
    """config.json, with transformers 4's "torch_dtype" under its 5.x name "dtype"."""
    raw = json.loads((path / "config.json").read_text())
    if "torch_dtype" in raw:
        raw.setdefault("dtype", raw.pop("torch_dtype"))
    return raw


def train_trl_grpo(ref_dir: Path, prompts: Sequence[Prompt], reward_pool, out_dir: Path, *, steps: int, lr: float,
                   beta: float, prompts_per_step: int, samples_per_prompt: int, max_new_tokens: int,
                   warmup_steps: int, seed: int, clip_grad: float = 1.0, temperature: float = 1.0,
                   progress: bool = True) -> Path:
    """Train the HF model at ref_dir with TRL's GRPOTrainer on ``prompts`` (rewards from ``reward_pool``);
    write out_dir/metrics.jsonl (one record per optimizer step; an earlier one there is replaced) and the
    trained model to out_dir/hf, whose path is returned. See the module docstring for what is matched."""
    try:  # the one optional dependency (accelerate comes with it)
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        raise ImportError(f"{TRL_MISSING} ({err})") from None
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from megatron_spo.checkpoint_digest import write_manifest
    from megatron_spo.models.hf_checkpoint import copy_tokenizer_files
    from megatron_spo.rollout.local_engine import _eos_ids
    from megatron_spo.training.metrics import METRICS_FILE, MetricsLogger, progress_line

    ref_dir, out_dir = Path(ref_dir), Path(out_dir)
    if not prompts:
        raise ValueError("train_trl_grpo: no prompts")
    if len(prompts) < prompts_per_step:
        raise ValueError(f"train_trl_grpo: {len(prompts)} prompts, fewer than prompts_per_step={prompts_per_step} "
                         "(TRL drops an incomplete batch of prompts: it would never take a step)")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / METRICS_FILE).unlink(missing_ok=True)
    ref_config = AutoConfig.from_pretrained(ref_dir)
    ref_dtype = getattr(ref_config, "dtype", None) or torch.float32
    if isinstance(ref_dtype, str):
        ref_dtype = getattr(torch, ref_dtype)
    tokenizer = AutoTokenizer.from_pretrained(ref_dir)
    texts = prompt_texts(prompts, tokenizer)

    batch = prompts_per_step * samples_per_prompt
    args = GRPOConfig(
        output_dir=str(out_dir / "trl"),
        use_cpu=True, bf16=False, fp16=False,
        model_init_kwargs={"dtype": "float32"},  # policy and reference in float32 (also TRL's default)
        **{_checkpointing_field(GRPOConfig): False},  # TRL turns it on by default: memory for time, same math
        num_generations=samples_per_prompt,
        per_device_train_batch_size=batch,  # one micro-batch of the whole step, one optimizer step per generation
        gradient_accumulation_steps=1,
        generation_batch_size=batch,  # -> steps_per_generation = 1: every step generates afresh (on-policy)
        max_steps=steps,
        learning_rate=lr,
        warmup_steps=warmup_steps,
        max_grad_norm=clip_grad,
        beta=beta,
        temperature=temperature,
        top_p=1.0,
        max_completion_length=max_new_tokens,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,  # our progress line instead
    )
    dataset = Dataset.from_dict({"prompt": texts, "prompt_id": [p.prompt_id for p in prompts]})
    seconds: dict[str, float] = {}  # time split of the current step: generation, reward scoring
    trainer = GRPOTrainer(model=str(ref_dir), reward_funcs=reward_function(reward_pool, prompts, tokenizer, seconds),
                          args=args, train_dataset=dataset, processing_class=tokenizer)
    generate = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            seconds["generate"] = seconds.get("generate", 0.0) + time.perf_counter() - t0

    trainer._generate_single_turn = timed_generate  # this instance only: times HF generate for time/generate
    # the prompts as TRL itself tokenizes them, and the tokens that end a completion, as our engines see them
    check_prompt_tokens(prompts, texts, lambda t: [list(ids) for ids in trainer._tokenize_prompts(t)[0]])
    engine_eos = set(_eos_ids(trainer.model, tokenizer))
    if set(trainer.eos_token_ids) != engine_eos:
        raise ValueError(f"trl_grpo: TRL ends completions at tokens {sorted(set(trainer.eos_token_ids))}, our "
                         f"engines at {sorted(engine_eos)}: completions would not be the ones we score")

    start = time.perf_counter()
    update = progress_line(progress, steps, 0)

    class StepMetrics(TrainerCallback):
        """One metrics.jsonl record per optimizer step (logging_steps=1: on_log follows every step)."""

        def __init__(self, logger: MetricsLogger):
            self.logger, self.last = logger, start

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary
                return
            now = time.perf_counter()
            record: dict[str, float] = {}
            for key, value in logs.items():
                if key in _SKIPPED or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue  # None: a metric with no valid value this step
                record[METRIC_NAMES.get(key, f"trl/{key}")] = float(value)
            if "kl" in logs and logs["kl"] is not None:  # per-token k3 KL(pi || pi_0) (beta > 0 only)
                record["kl_ref_k3"] = record["kl"] = float(logs["kl"])
                record.pop("trl/kl", None)
            record["time"] = now - start
            record["time/step"] = now - self.last
            for name in ("generate", "reward"):
                record[f"time/{name}"] = seconds.pop(name, 0.0)
            record["samples/online"] = float(batch)
            if "trl/completions/mean_length" in record:
                record["tokens_per_s"] = record["trl/completions/mean_length"] * batch / max(record["time/step"],
                                                                                              1e-9)
            self.last = now
            self.logger.log(state.global_step, record)
            update(state.global_step, record)

    with MetricsLogger(out_dir) as logger:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(StepMetrics(logger))
        try:
            trainer.train()
        finally:
            update(None, None)

    model = trainer.accelerator.unwrap_model(trainer.model)
    model.config.pad_token_id = ref_config.pad_token_id  # TRL mirrors the tokenizer's pad token onto the model
    model.config.use_cache = ref_config.use_cache  # Trainer turns the KV cache off for training
    if (ref_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(ref_dir)
    try:
        (out_dir / "trl").rmdir()  # TRL's output_dir: nothing is saved there (save_strategy "no")
    except OSError:
        pass
    hf = out_dir / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    model.to(ref_dtype).save_pretrained(hf, safe_serialization=True)
    copy_tokenizer_files(ref_dir, hf)  # the reference's tokenizer, byte for byte (TRL may have set a pad token)
    write_manifest(hf)  # its digests, as every checkpoint written here carries (checkpoint_digest.py)
    saved, reference = (_config_json(d) for d in (hf, ref_dir))
    changed = sorted(k for k in saved.keys() | reference.keys()
                     if k != "transformers_version" and saved.get(k) != reference.get(k))
    if changed:  # architectures, dtype, ...: what the conversion and the engines read
        raise RuntimeError(f"trl_grpo: the saved config.json differs from the reference's in {changed}")
    return hf
