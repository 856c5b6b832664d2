"""`megatron-spo check-conversion`: an HF and a Megatron checkpoint compared layer by layer, in bounded memory.

    megatron-spo check-conversion --hf HF_DIR --megatron MEGATRON_PATH [--tol 1e-4] [--vocab-chunk 8192] [--json]

MEGATRON_PATH is anything ``megatron-spo convert megatron-to-hf`` reads: a convert output, a trainer step
directory, its checkpoints directory or run directory (latest complete step), written under any TP/PP
layout and with either layer spec (the dist checkpoint is keyed globally). Both sides compute in float32
from their own stored weights (identical bytes when the conversion is right), one piece at a time:

  tensors   each HF tensor against the Megatron checkpoint's, mapped back through the family's rule table:
            exact (the Megatron tensor cast to the HF tensor's dtype must equal it)
  layer i   transformers' own decoder layer i and megatron-core's layer i, each with its side's weights,
            on the same input (HF's output of layer i-1): the "isolated" error of that layer alone. The
            Megatron side also carries its own output through every layer: the "carried" error, the
            accumulation its final logits see.
  vocab     embeddings and the LM head in row chunks; the final logits and the log-probs of the check's
            sequences (tokenized text when the HF dir has a tokenizer, else random ids) are reduced chunk by
            chunk with a running logsumexp, never as a whole [B, S, V] tensor.

Errors are relative to the HF side's largest magnitude (max |a - b| / max |b|), so one tolerance means the
same for every layer and size; float32 from identical weights agrees to ~1e-6. The report names the first
tensor and layer that disagree. Peak memory is about one layer per side in float32 plus one vocabulary
chunk, never the model: ``memory_estimate`` gives the formula (printed), and the run refuses up front when
it does not fit. Both checkpoints are checked against their digest manifests first (checkpoint_digest.py):
a flipped byte is refused naming the file, not reported as a differing tensor (--no-verify compares them anyway).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from megatron_spo.checkpoint_digest import CheckpointDigestError, verification, verify_checkpoint
from megatron_spo.cli import non_negative_float, non_negative_int, positive_int
from megatron_spo.config import ConfigError
from megatron_spo.memory import BASELINE_BYTES, GB, MemoryPreflightError, preflight, release_large_frees
from megatron_spo.models.config import ModelConfig

SHAPE_FIELDS = ("architecture", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "head_dim", "vocab_size", "qkv_bias", "qk_layernorm", "tie_word_embeddings")
SAMPLE_TEXTS = (  # "real-looking" sequences when the checkpoint has a tokenizer
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The quick brown fox jumps over the lazy dog. Reinforcement learning from verifiable rewards trains a policy "
    "to solve problems whose answers can be checked.",
)


class CheckError(ValueError):
    """The two checkpoints cannot be compared (different shapes, unreadable input); one line."""


# ---------------------------------------------------------------------------------------------
# The memory formula
# ---------------------------------------------------------------------------------------------
HEADROOM = 0.10  # on top of what the formula models


def memory_estimate(cfg: ModelConfig, batch: int, seq_len: int, vocab_chunk: int) -> dict:
    """Peak bytes of the streaming check, by part. One layer is held in float32 by each side plus, on the
    Megatron side, its read buffer in the checkpoint dtype; one vocabulary chunk likewise; activations are
    a few [B, S, max(F, chunk)] float32 tensors."""
    from megatron_spo.models.hf_map import hf_shapes

    item = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.params_dtype]
    layer_params = sum(math.prod(s) for n, s in hf_shapes(cfg).items() if n.startswith("model.layers.0."))
    per_param = 4 + 4 + item  # HF layer fp32 + Megatron layer fp32 + Megatron read buffer
    parts = {
        "baseline": BASELINE_BYTES,
        "one_layer": layer_params * per_param,
        "vocab_chunk": min(vocab_chunk, cfg.vocab_size) * cfg.hidden_size * per_param,
        "activations": 8 * batch * seq_len * max(cfg.ffn_hidden_size, min(vocab_chunk, cfg.vocab_size), 3 * cfg.hidden_size) * 4,
    }
    # allocator fragmentation and transient copies: measured up to 2% above the three parts on an 81M-parameter
    # model checked beside other work (tests/test_check_conversion.py), so 10% keeps the formula an upper bound
    parts["headroom"] = HEADROOM * (parts["one_layer"] + parts["vocab_chunk"] + parts["activations"])
    parts["total"] = sum(parts.values())
    parts["formula"] = (f"{BASELINE_BYTES / GB:.1f} GB + ({layer_params / 1e6:.0f}M params/layer x {per_param} B "
                        f"+ {min(vocab_chunk, cfg.vocab_size)} x {cfg.hidden_size} vocab chunk x {per_param} B "
                        f"+ activations) x {1 + HEADROOM:g} = {parts['total'] / GB:.2f} GB")
    return parts


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
@dataclass
class Finding:
    """One compared item: a tensor (exact), a layer output (isolated / carried), logits or log-probs."""

    what: str  # "tensor" | "layer" | "final_norm" | "logits" | "logprobs"
    name: str  # HF tensor name, or "model.layers.{i}" etc.
    error: float  # tensors: max abs diff; outputs: relative error; log-probs: max abs diff
    tol: float
    carried: float | None = None  # layers: the Megatron side's own carried output vs HF

    @property
    def ok(self) -> bool:
        return self.error <= self.tol


@dataclass
class CheckReport:
    findings: list[Finding] = field(default_factory=list)
    memory: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def first_failure(self) -> Finding | None:
        return next((f for f in self.findings if not f.ok), None)

    def worst(self, what: str) -> Finding | None:
        items = [f for f in self.findings if f.what == what]
        return max(items, key=lambda f: f.error / f.tol if f.tol else f.error) if items else None

    def summary(self) -> str:
        bad = self.first_failure()
        if bad is None:
            layers = [f for f in self.findings if f.what == "layer"]
            logits, logprobs = self.worst("logits"), self.worst("logprobs")
            worst_layer = max((f.error for f in layers), default=0.0)
            carried = max((f.carried or 0.0 for f in layers), default=0.0)
            return (f"OK: {sum(f.what == 'tensor' for f in self.findings)} tensors identical; {len(layers)} layers, "
                    f"worst isolated rel err {worst_layer:.1e}, carried {carried:.1e}; logits rel err "
                    f"{logits.error:.1e}, log-probs max abs diff {logprobs.error:.1e}")
        kind = "differs" if bad.what == "tensor" else "disagrees"
        line = f"FAIL: first disagreement: {bad.what} {bad.name} {kind} (error {bad.error:.3e} > tol {bad.tol:g})"
        if bad.what == "tensor":
            layer = next((f for f in self.findings if f.what == "layer" and bad.name.startswith(f.name + ".")), None)
            if layer is not None:
                line += f"; {layer.name} output rel err {layer.error:.3e}"
        return line

    def to_json(self) -> dict:
        return {"ok": self.ok, "summary": self.summary(), "memory": self.memory,
                "findings": [{**asdict(f), "ok": f.ok} for f in self.findings]}


def _rel(a, b) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


# ---------------------------------------------------------------------------------------------
# The Megatron side: one layer or one vocabulary chunk read at a time
# ---------------------------------------------------------------------------------------------
class MegatronReader:
    """Reads a Megatron checkpoint's tensors per layer (Megatron layout, TP = 1) and vocabulary row chunks.

    A TP = 1 x PP = 1 model of the checkpoint's config names and shapes the tensors; its parameters are
    allocated but never touched (no resident memory). Stored chunks that are exactly a requested tensor are
    viewed in place (page cache); anything else (TP/PP-sharded checkpoints) is read into new buffers."""

    def __init__(self, source, init_parallel):
        from megatron_spo.models.convert import _one_model, check_correspondence
        from megatron_spo.models.megatron_checkpoint import MappedTorchDist, mapped_sharded_tensors

        self.source = source
        _, entries = mapped_sharded_tensors(_one_model(source.cfg, init_parallel))
        check_correspondence(source, entries)
        self.layers: dict[int | None, list] = {}
        for entry in entries:
            self.layers.setdefault(entry.layer, []).append(entry)
        self.in_place = MappedTorchDist(source.dist_dir)
        self._chunks: dict = {}

    def layer(self, index: int) -> list[tuple[object, list]]:
        """[(rule, [stored parts])] of one decoder layer (fc1 as its gate and up halves)."""
        import torch

        from megatron_spo.models.megatron_checkpoint import load_parts

        to_read: dict[str, list] = {}
        out = []
        for entry in self.layers[index]:
            for st in entry.parts:
                prefix = self.source.key_prefix(st.key, entry.layer)
                stored = (1,) * st.prepend_axis_num + tuple(st.local_shape)
                view = self.in_place.get(prefix + st.key, st.global_offset, stored, st.dtype)
                if view is not None:
                    st.data = view.view(st.local_shape)
                else:
                    st.data = torch.empty(st.local_shape, dtype=st.dtype)
                    to_read.setdefault(prefix, []).append(st)
            out.append((entry.rule, entry.parts))
        for prefix, parts in to_read.items():
            load_parts(parts, self.source.dist_dir, prefix)
        return [(rule, [st.data for st in parts]) for rule, parts in out]

    def vocab_rows(self, megatron_name: str, start: int, stop: int):
        """Rows [start, stop) of the embedding or output layer ([n, H], the checkpoint's dtype), cut from the
        stored chunks that hold them (one per TP rank that wrote it): each viewed in place when possible,
        else read whole (megatron reads only regions aligned to their own size, so never a row range)."""
        import torch

        from megatron_spo.models.megatron_checkpoint import load_parts

        entry = next(e for e in self.layers[None] if e.rule.megatron == megatron_name)
        st = entry.parts[0]
        prefix = self.source.key_prefix(st.key, None)
        meta = self.source.stored.get(prefix + st.key)
        if meta is None:
            raise CheckError(f"{self.source.dist_dir}: no tensor '{prefix + st.key}' in the checkpoint")
        pieces = []
        for chunk in sorted(meta.chunks, key=lambda c: c.offsets[0]):
            first, size = chunk.offsets[0], chunk.sizes[0]
            lo, hi = max(start, first), min(stop, first + size)
            if lo >= hi:
                continue
            key = (prefix + st.key, tuple(chunk.offsets), tuple(chunk.sizes))
            stored = self._chunks.get(key)
            if stored is None:
                stored = self.in_place.get(key[0], key[1], key[2], st.dtype)
                if stored is None:
                    part = replace(st, data=torch.empty(key[2], dtype=st.dtype), local_shape=key[2],
                                   global_shape=tuple(meta.size), global_offset=key[1], allow_shape_mismatch=False)
                    load_parts([part], self.source.dist_dir, prefix)
                    stored = part.data
                self._chunks = {key: stored}  # keep the last chunk: consecutive row ranges mostly share it
            pieces.append(stored[lo - first:hi - first])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------
def _sequences(hf_dir: Path, cfg: ModelConfig, batch: int, seq_len: int, seed: int):
    import torch

    ids = None
    if any((hf_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(hf_dir)
            rows = [tok(SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)])["input_ids"] for i in range(batch)]
            if min(len(r) for r in rows) >= 8:
                n = min(seq_len, min(len(r) for r in rows))
                ids = torch.tensor([r[:n] for r in rows]).clamp(0, cfg.vocab_size - 1)
        except Exception:  # a tokenizer that does not load is no reason to skip the check
            ids = None
    if ids is None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    return ids


def _hf_skeleton(hf_dir: Path):
    """transformers' model of the checkpoint on the meta device (no memory), sdpa attention (causal without a
    mask), and its rotary embedding built for real."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    config._attn_implementation = "sdpa"
    if hasattr(config, "_experts_implementation"):  # transformers 5: its grouped_mm refuses odd shapes on CPU
        config._experts_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rotary = type(model.model.rotary_emb)(config=config)
    return model, rotary


def _materialise(module, tensors: dict) -> None:
    """Give a meta-device module float32 CPU storage holding ``tensors`` (names relative to the module)."""
    module.to_empty(device="cpu")
    missing, unexpected = module.load_state_dict(_fused_experts(module, tensors), strict=False)
    if missing or unexpected:
        raise CheckError(f"transformers module {type(module).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}")


def _fused_experts(module, tensors: dict) -> dict:
    """transformers 5 holds a layer's experts as mlp.experts.gate_up_proj [E, 2F, H] (gate rows, then up) and
    down_proj [E, H, F]; checkpoints (and transformers 4) name them per expert, mlp.experts.{e}.gate_proj.weight."""
    import torch

    expected = module.state_dict(keep_vars=True)
    if "mlp.experts.gate_up_proj" not in expected or "mlp.experts.0.gate_proj.weight" not in tensors:
        return tensors
    out = {k: v for k, v in tensors.items() if not k.startswith("mlp.experts.")}
    n = expected["mlp.experts.gate_up_proj"].shape[0]
    e = [f"mlp.experts.{i}." for i in range(n)]
    out["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([tensors[x + "gate_proj.weight"], tensors[x + "up_proj.weight"]]) for x in e])
    out["mlp.experts.down_proj"] = torch.stack([tensors[x + "down_proj.weight"] for x in e])
    return out


def run_check(hf_dir, megatron_path, *, batch: int = 2, seq_len: int = 64, seed: int = 0, vocab_chunk: int = 8192,
              tol: float = 1e-4, logprob_tol: float = 1e-3, progress: bool = True) -> CheckReport:
    import torch

    from megatron_spo.models.builders import build_policy
    from megatron_spo.models.convert import _progress, _single_process_world, find_megatron_source
    from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config
    from megatron_spo.models.hf_map import (
        EMBED,
        FINAL_NORM,
        LM_HEAD,
        _param,
        hf_from_checkpoint_parts,
        hf_names,
        layer_rules,
    )

    hf_dir = Path(hf_dir)
    if hf_dir.is_dir():
        verify_checkpoint(hf_dir)  # before config.json or any shard is read (find_megatron_source: the other side)
    hf_cfg = read_hf_config(hf_dir)
    source = find_megatron_source(megatron_path)
    cfg = source.cfg
    for name in SHAPE_FIELDS:
        if getattr(hf_cfg, name) != getattr(cfg, name):
            raise CheckError(f"{name} differs: HF {getattr(hf_cfg, name)} vs Megatron {getattr(cfg, name)}")
    reader = HFReader(hf_dir)
    reader.validate(hf_cfg)
    memory = memory_estimate(cfg, batch, seq_len, vocab_chunk)
    avail = preflight("check-conversion", memory["total"], hint="a smaller --vocab-chunk lowers the vocabulary part")
    report = CheckReport(memory={**memory, "available": avail.bytes, "available_from": avail.source})
    release_large_frees()  # per-layer buffers go back to the kernel, so the peak stays about one layer

    def tensor_finding(name: str, megatron_value, hf_value) -> None:
        for where, value in ((hf_dir, hf_value), (source.dist_dir, megatron_value)):
            # NaN != NaN would read as "differs"; the sum is the fast test (an overflow falls to the exact one)
            if not bool(torch.isfinite(value.sum())) and not bool(torch.isfinite(value).all()):
                raise CheckError(f"{where}: tensor '{name}' holds a non-finite value (NaN / inf): "
                                 f"nothing to compare")
        exact = torch.equal(megatron_value.to(hf_value.dtype).reshape(hf_value.shape), hf_value)
        diff = 0.0 if exact else (megatron_value.float().reshape(hf_value.shape) - hf_value.float()).abs().max().item()
        report.findings.append(Finding("tensor", name, diff if not exact else 0.0, 0.0))

    ids = _sequences(hf_dir, cfg, batch, seq_len, seed)
    b, s = ids.shape
    torch.manual_seed(seed)
    with _single_process_world() as init_parallel, torch.no_grad():
        meg = MegatronReader(source, init_parallel)
        compute_cfg = ModelConfig.model_validate({**cfg.model_dump(), "num_layers": 1, "params_dtype": "float32"})
        (compute,) = build_policy(compute_cfg, _parallel(), init_weights=False)
        compute.eval()
        meg_layer = compute.decoder.layers[0]
        rope = compute.rotary_pos_emb(s)
        hf_model, hf_rotary = _hf_skeleton(hf_dir)
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        emb_name = "embedding.word_embeddings.weight"
        head_name = emb_name if cfg.tie_word_embeddings else "output_layer.weight"
        hf_head = EMBED if cfg.tie_word_embeddings else LM_HEAD
        chunks = [(v, min(v + vocab_chunk, cfg.vocab_size)) for v in range(0, cfg.vocab_size, vocab_chunk)]
        flat = ids.reshape(-1)
        rules = layer_rules(cfg)

        with (_progress() if progress else _NoProgress()) as bar:
            task = bar.add_task("check layers", total=cfg.num_layers + 2 * len(chunks))
            # embeddings, chunk by chunk: the tensor, and the rows of the check's tokens
            x_hf = torch.empty(b * s, cfg.hidden_size)
            x_meg = torch.empty(b * s, cfg.hidden_size)
            for start, stop in chunks:
                hf_rows = reader.view(EMBED)[start:stop]
                meg_rows = meg.vocab_rows(emb_name, start, stop)
                tensor_finding(f"{EMBED}[{start}:{stop}]", meg_rows, hf_rows)
                hit = (flat >= start) & (flat < stop)
                x_hf[hit] = hf_rows[flat[hit] - start].float()
                x_meg[hit] = meg_rows[flat[hit] - start].float()
                bar.advance(task)
            x_hf, x_meg = x_hf.view(b, s, -1), x_meg.view(b, s, -1)
            cos_sin = hf_rotary(x_hf, positions)

            for i in range(cfg.num_layers):
                stored = meg.layer(i)
                hf_tensors = {}
                for rule, parts in stored:
                    for name, value in zip(hf_names(rule, i), hf_from_checkpoint_parts(rule, parts, cfg)):
                        hf_value = reader.view(name)
                        tensor_finding(name, value, hf_value)
                        hf_tensors[name[len(f"model.layers.{i}."):]] = hf_value
                    full = torch.cat(parts, dim=0) if rule.kind == "fc1" else parts[0]
                    _param(meg_layer, rule).data = full.float().contiguous()
                layer = hf_model.model.layers[i]
                _materialise(layer, hf_tensors)
                out_hf = layer(x_hf, position_ids=positions, position_embeddings=cos_sin)
                out_hf = out_hf[0] if isinstance(out_hf, tuple) else out_hf
                iso = _megatron_layer(meg_layer, x_hf, rope)
                own = _megatron_layer(meg_layer, x_meg, rope)
                report.findings.append(Finding("layer", f"model.layers.{i}", _rel(iso, out_hf), tol,
                                               carried=_rel(own, out_hf)))
                x_hf, x_meg = out_hf, own
                layer.to("meta")
                for rule in rules:
                    _param(meg_layer, rule).data = torch.empty(0)
                bar.advance(task)

            # final norm and LM head
            norm_meg = None
            for entry in meg.layers[None]:
                if entry.rule.megatron == "decoder.final_layernorm.weight":
                    norm_meg = _single(meg, entry)
            tensor_finding(FINAL_NORM, norm_meg, reader.view(FINAL_NORM))
            meg_final_norm = compute.decoder.final_layernorm
            meg_final_norm.weight.data = norm_meg.float().contiguous()
            hf_norm = hf_model.model.norm
            _materialise(hf_norm, {"weight": reader.view(FINAL_NORM)})
            h_hf = hf_norm(x_hf)
            h_iso = meg_final_norm(x_hf.transpose(0, 1)).transpose(0, 1)
            h_own = meg_final_norm(x_meg.transpose(0, 1)).transpose(0, 1)
            report.findings.append(Finding("final_norm", "model.norm", _rel(h_iso, h_hf), tol, carried=_rel(h_own, h_hf)))

            targets = ids[:, 1:]
            lse_hf = torch.full((b, s - 1), -math.inf)
            lse_own = torch.full((b, s - 1), -math.inf)
            tgt_hf = torch.zeros(b, s - 1)
            tgt_own = torch.zeros(b, s - 1)
            logit_err, logit_scale = 0.0, 0.0
            for start, stop in chunks:
                w_hf = reader.view(hf_head)[start:stop]
                w_meg = meg.vocab_rows(head_name, start, stop)
                if not cfg.tie_word_embeddings:
                    tensor_finding(f"{LM_HEAD}[{start}:{stop}]", w_meg, w_hf)
                l_hf = h_hf[:, :-1] @ w_hf.float().T
                l_own = h_own[:, :-1] @ w_meg.float().T
                logit_err = max(logit_err, (l_own - l_hf).abs().max().item())
                logit_scale = max(logit_scale, l_hf.abs().max().item())
                lse_hf = torch.logaddexp(lse_hf, torch.logsumexp(l_hf, dim=-1))
                lse_own = torch.logaddexp(lse_own, torch.logsumexp(l_own, dim=-1))
                hit = (targets >= start) & (targets < stop)
                local = (targets - start).clamp(0, stop - start - 1).unsqueeze(-1)
                tgt_hf = torch.where(hit, l_hf.gather(-1, local).squeeze(-1), tgt_hf)
                tgt_own = torch.where(hit, l_own.gather(-1, local).squeeze(-1), tgt_own)
                bar.advance(task)
            report.findings.append(Finding("logits", "lm_head", logit_err / (logit_scale or 1.0), tol))
            logprob_diff = ((tgt_own - lse_own) - (tgt_hf - lse_hf)).abs().max().item()
            report.findings.append(Finding("logprobs", f"{b} x {s} tokens", logprob_diff, logprob_tol))
    # tensors come first in the order things are read: put each layer's tensors before its output
    report.findings.sort(key=_reading_order)
    return report


def _reading_order(f: Finding) -> tuple:
    if f.name.startswith("model.embed_tokens"):
        return (0, 0, 0)
    if f.name.startswith("model.layers."):
        return (1, int(f.name.split(".")[2]), 0 if f.what == "tensor" else 1)
    return (2, 0, {"tensor": 0, "final_norm": 1, "logits": 2, "logprobs": 3}[f.what])


def _single(meg: MegatronReader, entry):
    import torch

    from megatron_spo.models.megatron_checkpoint import load_parts

    st = entry.parts[0]
    prefix = meg.source.key_prefix(st.key, None)
    view = meg.in_place.get(prefix + st.key, st.global_offset, tuple(st.local_shape), st.dtype)
    if view is not None:
        return view.view(st.local_shape)
    st.data = torch.empty(st.local_shape, dtype=st.dtype)
    load_parts([st], meg.source.dist_dir, prefix)
    return st.data


def _megatron_layer(layer, x, rope):
    """megatron's TransformerLayer on [B, S, H] (it works in [S, B, H]); causal, no mask needed."""
    out = layer(x.transpose(0, 1).contiguous(), attention_mask=None, rotary_pos_emb=rope)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(0, 1)


def _parallel():
    from megatron_spo.models.config import ParallelConfig

    return ParallelConfig()


class _NoProgress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, *args, **kwargs):
        return 0

    def advance(self, *args, **kwargs):
        pass


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo check-conversion", description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF checkpoint dir")
    parser.add_argument("--megatron", required=True, help="convert output, trainer step / checkpoints / run dir")
    parser.add_argument("--tol", type=non_negative_float, default=1e-4,
                        help="max relative error of a layer output, the final norm and the logits (default 1e-4: "
                             "float32 from identical weights agrees to ~1e-6)")
    parser.add_argument("--logprob-tol", type=non_negative_float, default=1e-3, help="max abs log-prob difference")
    parser.add_argument("--vocab-chunk", type=positive_int, default=8192, help="vocabulary rows per chunk (memory)")
    parser.add_argument("--batch", type=positive_int, default=2, help="random token sequences compared (default 2)")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random tokens (default 0)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check either checkpoint's files against its digest manifest (digests.json): for "
                             "checkpoint files you edited yourself; a mismatch is otherwise refused naming the file")
    args = parser.parse_args(argv)
    from megatron_spo.models.dcp_metadata import CheckpointFileError
    from megatron_spo.models.hf_checkpoint import HFCheckpointError

    try:
        with verification(False) if args.no_verify else nullcontext():
            report = run_check(args.hf, args.megatron, batch=args.batch, seq_len=args.seq_len, seed=args.seed,
                               vocab_chunk=args.vocab_chunk, tol=args.tol, logprob_tol=args.logprob_tol,
                               progress=not args.no_progress)
    except (CheckError, HFCheckpointError, CheckpointFileError, CheckpointDigestError, MemoryPreflightError,
            FileNotFoundError, ConfigError) as err:
        print(f"megatron-spo check-conversion: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_table(report)
        print(f"memory: {report.memory['formula']} (available {report.memory['available'] / GB:.1f} GB)")
        print(report.summary())
    return 0 if report.ok else 1


def _print_table(report: CheckReport) -> None:
    tensors_bad: dict[str, int] = {}
    for f in report.findings:
        if f.what == "tensor" and not f.ok and f.name.startswith("model.layers."):
            key = ".".join(f.name.split(".")[:3])
            tensors_bad[key] = tensors_bad.get(key, 0) + 1
    print(f"{'layer':<18} {'isolated':>10} {'carried':>10}  tensors")
    for f in report.findings:
        if f.what in ("layer", "final_norm"):
            bad = tensors_bad.get(f.name, 0)
            print(f"{f.name:<18} {f.error:>10.2e} {f.carried or 0.0:>10.2e}  {'identical' if not bad else f'{bad} differ'}"
                  f"{'' if f.ok else '  <- FAIL'}")
