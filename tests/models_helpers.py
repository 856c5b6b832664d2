"""Helpers for the models tests: tiny random Llama checkpoints and the multi-process worker.

The worker runs inside ``spawn_local`` processes (gloo): for each layout it builds the policy, loads
the HF weights through hf_map, and records measured numbers in a JSON file that the test asserts on.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

VOCAB = 1001  # TP=2 does not divide it; padded to 1024
SEQ = 48  # longer than original_max_position_embeddings=32 below, so llama3 rope scaling matters


def tiny_hf_config(num_layers: int = 4, vocab_size: int = VOCAB, **overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def make_tiny_llama(
    out_dir: str | Path, seed: int = 0, max_shard_size: str | None = "40KB", **overrides
) -> Path:
    """Write a random fp32 LlamaForCausalLM (config.json + safetensors shards + index + tokenizer file)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_hf_config(**overrides)).float().eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm cannot go unnoticed
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    out_dir = Path(out_dir)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}) + "\n")
    return out_dir


# ---------------------------------------------------------------------------------------------
# One tiny checkpoint per registered family (models/arch/), in the shapes that make each feature count
# ---------------------------------------------------------------------------------------------
FAMILY_CASES = {  # name -> (transformers config class, fields beyond the shared tiny shape)
    "llama3.2-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling=tiny_hf_config().rope_scaling)),
    "qwen2.5": ("Qwen2Config", dict(rope_theta=1000000.0)),
    "qwen2.5-tied": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, rope_theta=1000000.0)),  # head_dim != hidden / heads (16)
    "qwen3-tied": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=24, sliding_window=None)),
}


def make_tiny_family(out_dir: str | Path, case: str, seed: int = 0, num_layers: int = 4, vocab_size: int = VOCAB):
    """A random fp32 checkpoint of one FAMILY_CASES entry. Norm weights (incl. Qwen3's q/k norms) are
    1 + noise and biases (Qwen2's q/k/v) are noise, so a dropped or swapped one changes the logits."""
    import transformers

    cls_name, fields = FAMILY_CASES[case]
    config = getattr(transformers, cls_name)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        **{"tie_word_embeddings": False, **fields},
    )
    return save_random_checkpoint(config, out_dir, seed)


def save_random_checkpoint(config, out_dir: str | Path, seed: int = 0, noise: dict[str, float] | None = None) -> Path:
    """A random fp32 transformers model of ``config`` in 40 KB shards with a tokenizer file. Norm weights are
    1 + noise and biases noise; a parameter whose name ends in a key of ``noise`` is N(0, value^2)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif stds := [std for suffix, std in (noise or {}).items() if name.endswith(suffix)]:
                p.copy_(stds[0] * torch.randn_like(p))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, max_shard_size="40KB")
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}) + "\n")
    return out_dir


FAMILY_LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP) on a world of 4
PACKED_LENGTHS = torch.tensor([SEQ - 7, SEQ, 5, SEQ - 20])  # per row of tokens(): the micro-batches' packed streams


def family_worker(hf_dirs: dict[str, str], result_path: str, wanted: list[str]) -> None:
    """For each family checkpoint and layout in ``wanted`` ("case/tpT_ppP"): logits and gradients vs transformers,
    and the streaming export (the live weight-sync names) bit-exact against the checkpoint."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config
    from megatron_spo.models.hf_map import iter_hf_tensors, load_hf_into_model
    from megatron_spo.models.parallel import init_parallel
    from megatron_spo.models.pipeline import gather_logits_to_rank0, run_pipeline

    rank = int(os.environ["RANK"])
    ids = tokens()
    mb_ids = [ids[0:2], ids[2:4]]
    results: dict = {}
    for case, hf_dir in hf_dirs.items():
        layouts = [(tp, pp) for tp, pp in FAMILY_LAYOUTS if f"{case}/tp{tp}_pp{pp}" in wanted]
        if not layouts:
            continue
        cfg = read_hf_config(hf_dir)
        reader = HFReader(hf_dir)
        reader.validate(cfg)
        if rank == 0:
            ref_logits, ref_grads = hf_reference(hf_dir, ids)

        def loss_fn(logits_local, index):
            return vocab_parallel_cross_entropy(logits_local[:, :-1].float().contiguous(), mb_ids[index][:, 1:]).mean()

        for tp, pp in layouts:
            pcfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            init_parallel(pcfg, cfg, seed=123)
            chunks = build_policy(cfg, pcfg)
            load_hf_into_model(chunks, cfg, reader.get)
            rec: dict = {}
            logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=2)
            # packed sequences (THD): each row's first PACKED_LENGTHS[i] tokens back to back; causal attention makes
            # them the full rows' prefixes, so their logits are the reference's
            packed = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=2, lengths=PACKED_LENGTHS)
            if rank == 0:
                rec["logit_max_abs_diff"] = (logits - ref_logits).abs().max().item()
                rec["packed_logit_max_abs_diff"] = max(
                    (packed[i, :n] - ref_logits[i, :n]).abs().max().item() for i, n in enumerate(PACKED_LENGTHS.tolist()))
                rec["packed_padding_is_zero"] = all(
                    bool((packed[i, n:] == 0).all()) for i, n in enumerate(PACKED_LENGTHS.tolist()))
            for c in chunks:
                c.train()
                c.zero_grad(set_to_none=True)
            run_pipeline(chunks, ids, micro_batch_size=2, loss_fn=loss_fn)
            for c in chunks if tp > 1 else []:  # finalize_model_grads (the trainer's) sums q/k norm grads over TP
                for name, p in c.named_parameters():
                    if "q_layernorm" in name or "k_layernorm" in name:
                        dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            if cfg.tie_word_embeddings and pp > 1:  # what finalize_model_grads does in the trainer
                shared = chunks[0].shared_embedding_or_output_weight()
                dist.all_reduce(shared.grad, group=ps.get_embedding_group())
            worst, worst_name, names = 0.0, "", []
            for hf_name, g in iter_hf_tensors(chunks, cfg, grads=True):
                ref = ref_grads[hf_name]
                d = (g - ref).abs().max().item() / (ref.abs().max().item() + 1e-12)
                names.append(hf_name)
                if d > worst:
                    worst, worst_name = d, hf_name
            exact, exported = True, []
            for hf_name, t in iter_hf_tensors(chunks, cfg):
                exact &= torch.equal(t, reader.get(hf_name))
                exported.append(hf_name)
            if rank == 0:
                rec.update(grad_max_rel_diff=worst, grad_worst_tensor=worst_name, export_bit_exact=bool(exact),
                           exported=exported, hf_grad_names=sorted(ref_grads), checkpoint_names=reader.names())
            results[f"{case}/tp{tp}_pp{pp}"] = rec
            del chunks
            ps.destroy_model_parallel()
    if rank == 0:
        Path(result_path).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


def tokens(batch: int = 4, seq: int = SEQ, vocab: int = VOCAB, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def hf_reference(hf_dir: str | Path, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits [B, S, V] and gradients (by HF name) of the mean next-token cross-entropy."""
    from transformers import AutoModelForCausalLM

    return logits_and_grads(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), ids)


def logits_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A transformers model's logits [B, S, V] and gradients (by parameter name) of the mean next-token
    cross-entropy."""
    logits = model(ids).logits
    loss = next_token_loss(logits, ids)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), grads


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    v = logits.shape[-1]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------
# Multi-process worker (runs in every spawned rank)
# ---------------------------------------------------------------------------------------------
def layout_name(tp: int, pp: int, vpp: int | None) -> str:
    return f"tp{tp}_pp{pp}" + (f"_vpp{vpp}" if vpp else "")


LAYOUTS = [  # (TP, PP, VPP); world size 4, so DP = 4 / (TP * PP)
    (1, 1, None),
    (2, 1, None),
    (1, 2, None),
    (2, 2, None),
    (1, 2, 2),
]


def parallel_worker(hf_dir: str, result_path: str, ckpt_dir: str, wanted: list[str], after: bool) -> None:
    """Each layout named in ``wanted`` (LAYOUTS' names) against transformers; with ``after``, also the TP=2 x PP=2
    checkpoint loaded at TP=1, the reference and value models, and a DDP + distributed-optimizer step."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_spo.models.builders import build_policy, lm_head_weight, mask_padded_logits
    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config
    from megatron_spo.models.hf_map import iter_hf_tensors, load_hf_into_model
    from megatron_spo.models.megatron_checkpoint import load_megatron, save_megatron
    from megatron_spo.models.parallel import init_parallel
    from megatron_spo.models.pipeline import gather_logits_to_rank0, run_pipeline
    from megatron_spo.ops import token_logprobs

    cfg = read_hf_config(hf_dir)
    reader = HFReader(hf_dir)
    ids = tokens()
    rank = int(os.environ["RANK"])
    if rank == 0:
        ref_logits, ref_grads = hf_reference(hf_dir, ids)
    results: dict = {}

    def loss_fn(logits_local, index):
        # mean next-token CE over one micro-batch of 2 sequences; the batch of 4 has 2 micro-batches
        losses = vocab_parallel_cross_entropy(logits_local[:, :-1].float().contiguous(), mb_ids[index][:, 1:])
        return losses.mean()  # the schedule divides by the number of micro-batches

    mb_ids = [ids[0:2], ids[2:4]]
    for tp, pp, vpp in LAYOUTS:
        name = layout_name(tp, pp, vpp)
        if name not in wanted:
            continue
        pcfg = ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
        )
        init_parallel(pcfg, cfg, seed=123)
        chunks = build_policy(cfg, pcfg)
        load_hf_into_model(chunks, cfg, reader.get)
        rec: dict = {}

        # 1. logit parity with transformers
        logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size, micro_batch_size=2)
        if rank == 0:
            rec["logit_max_abs_diff"] = (logits - ref_logits).abs().max().item()

        # 2. final hidden states @ LM-head shard == this rank's logits shard (last stage)
        hidden = run_pipeline(chunks, ids, micro_batch_size=2, hidden_states=True)
        logit_out = run_pipeline(chunks, ids, micro_batch_size=2)
        diff = torch.zeros(())
        if hidden:
            head = chunks[-1]
            w = lm_head_weight(head)
            recomputed = mask_padded_logits(
                torch.cat(hidden) @ w.T, head.output_layer_vocab_start(), cfg.vocab_size
            )
            got = torch.cat(logit_out)
            finite = torch.isfinite(got)
            assert torch.equal(finite, torch.isfinite(recomputed))
            diff = (recomputed[finite] - got[finite]).abs().max()
            rec_hidden_shape = list(hidden[0].shape)
            rec_padded_cols = int((~finite[0, 0]).sum())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        rec["hidden_matmul_vs_logits"] = diff.item()

        # 3. gradients vs the single-process transformers run
        for c in chunks:
            c.train()
            c.zero_grad(set_to_none=True)
        run_pipeline(chunks, ids, micro_batch_size=2, loss_fn=loss_fn)
        worst = 0.0
        worst_name = ""
        for hf_name, g in iter_hf_tensors(chunks, cfg, grads=True):
            d = (g - ref_grads[hf_name]).abs().max().item() / (ref_grads[hf_name].abs().max().item() + 1e-12)
            if d > worst:
                worst, worst_name = d, hf_name
        if rank == 0:
            rec["grad_max_rel_diff"] = worst
            rec["grad_worst_tensor"] = worst_name

        # 3b. the trainer's path: final hidden states + LM-head shard -> fused token log-probs (ops)
        tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None

        def hidden_loss_fn(hidden_mb, index, head=chunks[-1], tp_group=tp_group):
            h = hidden_mb[:, :-1].reshape(-1, hidden_mb.shape[-1])
            targets = mb_ids[index][:, 1:].reshape(-1)
            logp = token_logprobs(
                h, lm_head_weight(head), targets, tp_group=tp_group, valid_vocab_size=cfg.vocab_size
            )
            return -logp.mean()

        for c in chunks:
            c.zero_grad(set_to_none=True)
        run_pipeline(chunks, ids, micro_batch_size=2, loss_fn=hidden_loss_fn, hidden_states=True)
        worst = 0.0
        for hf_name, g in iter_hf_tensors(chunks, cfg, grads=True):
            ref = ref_grads[hf_name]
            worst = max(worst, (g - ref).abs().max().item() / (ref.abs().max().item() + 1e-12))
        if rank == 0:
            rec["grad_via_hidden_max_rel_diff"] = worst

        # 4. streaming export to rank 0 is bit-exact
        exact = True
        count = 0
        for hf_name, t in iter_hf_tensors(chunks, cfg):
            exact &= torch.equal(t, reader.get(hf_name))
            count += 1
        if rank == 0:
            rec["export_bit_exact"] = bool(exact)
            rec["export_count"] = count

        # 5. the TP=2 x PP=2 layout writes the dist checkpoint that TP=1 loads below
        if (tp, pp, vpp) == (2, 2, None):
            save_megatron(chunks, cfg, ckpt_dir)
        if hidden:
            rec["hidden_shape"] = rec_hidden_shape
            rec["padded_cols_on_last_rank"] = rec_padded_cols
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(
            gathered, {k: v for k, v in rec.items() if k.startswith(("hidden_shape", "padded"))}
        )
        rec["last_stage_info"] = [g for g in gathered if g]
        results[name] = rec
        del chunks
        ps.destroy_model_parallel()

    if not after:
        if rank == 0:
            Path(result_path).write_text(json.dumps(results, indent=2))
        dist.destroy_process_group()
        return
    # TP=2 x PP=2 checkpoint -> TP=1 (DP=4) model: same logits as transformers
    pcfg = ParallelConfig()
    init_parallel(pcfg, cfg, seed=7)
    chunks = build_policy(cfg, pcfg)
    load_megatron(chunks, ckpt_dir)
    logits = gather_logits_to_rank0(chunks, ids, cfg.vocab_size)
    if rank == 0:
        results["ckpt_tp2pp2_to_tp1"] = {"logit_max_abs_diff": (logits - ref_logits).abs().max().item()}

    # reference and value models (TP=1 here)
    from megatron_spo.models.builders import build_reference, build_value_model, gpt_hidden_states

    reference = build_reference(cfg, pcfg)
    value = build_value_model(cfg, pcfg)
    load_megatron(reference, ckpt_dir)
    load_hf_into_model(value, cfg, reader.get)  # the trunk; the value model has no LM head
    head = value[0].value_head
    with torch.no_grad():
        head.weight.copy_(torch.randn_like(head.weight))
        head.bias.fill_(0.5)
        values = value[0](ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        hidden = gpt_hidden_states(chunks[0], ids)
    # PPO from init.megatron: the trunk from a language-model checkpoint, the head as initialised (zeros)
    value_ckpt = build_value_model(cfg, pcfg)
    try:  # asked to read the head too: a one-line error naming it
        load_megatron(value_ckpt, ckpt_dir)
        without_keep_own = "loaded"
    except ValueError as err:
        without_keep_own = str(err)
    load_megatron(value_ckpt, ckpt_dir, keep_own=("value_head.",))
    head_ckpt = value_ckpt[0].value_head
    head_was_zero = bool((head_ckpt.weight == 0).all() and (head_ckpt.bias == 0).all())
    with torch.no_grad():
        head_ckpt.weight.copy_(head.weight)
        head_ckpt.bias.fill_(0.5)
        values_ckpt = value_ckpt[0](ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    if rank == 0:
        results["reference"] = {
            "any_requires_grad": any(p.requires_grad for c in reference for p in c.parameters()),
            "training": any(c.training for c in reference),
            "logits_equal_policy": torch.equal(
                gather_logits_to_rank0(reference, ids, cfg.vocab_size), logits
            ),
        }
        results["value"] = {
            "shape": list(values.shape),
            "max_abs_diff_vs_hidden_dot_head": (values - (hidden @ head.weight[0] + 0.5)).abs().max().item(),
            "from_megatron_head_was_zero": head_was_zero,
            "from_megatron_max_abs_diff": (values_ckpt - values).abs().max().item(),
            "from_megatron_without_keep_own": without_keep_own,
        }
    else:
        gather_logits_to_rank0(reference, ids, cfg.vocab_size)

    # megatron DDP + distributed optimizer over DP=4 run on CPU through the shims: the pre-clip grad
    # norm equals the transformers gradient norm (every DP rank sees the same batch)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    wrapped = [DistributedDataParallel(c.config, ddp_cfg, c) for c in chunks]
    opt_cfg = OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0)
    optimizer = get_megatron_optimizer(opt_cfg, wrapped)
    for c in wrapped:
        c.train()
        c.zero_grad_buffer()
    optimizer.zero_grad()
    before = chunks[0].decoder.final_layernorm.weight.detach().clone()
    run_pipeline(wrapped, ids, micro_batch_size=2, loss_fn=loss_fn)
    for c in wrapped:
        c.finish_grad_sync()
    stepped, grad_norm, _ = optimizer.step()
    if rank == 0:
        ref_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())).item()
        moved = (chunks[0].decoder.final_layernorm.weight - before).abs().max().item()
        results["ddp_distributed_optimizer"] = {
            "stepped": bool(stepped),
            "grad_norm": grad_norm,
            "hf_grad_norm": ref_norm,
            "param_moved": moved,
        }

    if rank == 0:
        Path(result_path).write_text(json.dumps(results, indent=2))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The CLI in a subprocess, and HF directories as tensors
# ---------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, check: bool = True, code: str | None = None):
    """`python -m megatron_spo.cli ARGS` (or `python -c CODE ARGS`) from the repo root, one thread, quiet."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "megatron_spo.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def all_tensors(hf: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's *.safetensors files, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------------------------------------
# Peak process-private memory of one call, in a fresh process (benchmarks and the memory tests)
# ---------------------------------------------------------------------------------------------
PEAK_ANON_CODE = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from megatron_spo.memory import peak_anon_bytes
from megatron_spo.models.check_conversion import run_check

warm_hf, warm_meg, hf, meg, chunk = sys.argv[1:6]
run_check(warm_hf, warm_meg, progress=False)  # imports and one-time set-up are not the check's memory
report, peak = peak_anon_bytes(run_check, hf, meg, vocab_chunk=int(chunk), progress=False)
print(json.dumps({"peak_anon_bytes": peak, "ok": report.ok, "estimate": report.memory}))
"""
