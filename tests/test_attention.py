"""The local spec's SDPA core attention (models/attention.py) against megatron-core's own DotProductAttention,
on padded (sbhd) and packed (thd) layouts, and its memory against the sequence length."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_spo.config import build_config
from megatron_spo.models.config import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, attention_dropout=0.0, attention_softmax_in_fp32=True,
                             masked_softmax_fusion=False, use_cpu_initialization=True, **kw)


def _tp1():  # a process-group collection of one: no process group needed to build the attentions
    return SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


def _attention(kind: str, **config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_spo.models.attention import SDPAttention

    cls = SDPAttention if kind == "sdpa" else DotProductAttention
    return cls(config=_config(**config), layer_number=1, attn_mask_type=AttnMaskType.causal,
               attention_type="self", softmax_scale=None, cp_comm_type=None, pg_collection=_tp1())


def _qkv(s: int, b: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    k = torch.randn(s, b, GROUPS, HEAD_DIM, generator=g, requires_grad=True)
    v = torch.randn(s, b, GROUPS, HEAD_DIM, generator=g, requires_grad=True)
    return q, k, v


def _run(attn, q, k, v, **kw):
    out = attn(q, k, v, None, attn_mask_type=attn.attn_mask_type, attention_bias=None, **kw)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
    return out.detach(), grads


@pytest.fixture
def memory_buffer():
    """megatron's global memory buffer (DotProductAttention takes its scores tensor from it) and the model-parallel
    RNG its dropout forks, for this test only."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_spo.models.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    owned = ps._GLOBAL_MEMORY_BUFFER is None
    if owned:
        ps._set_global_memory_buffer()
    tracker = get_cuda_rng_tracker()
    added = "model-parallel-rng" not in tracker.get_states()
    if added:
        tracker.add("model-parallel-rng", 1234)
    yield
    if added:
        tracker.reset()
    if owned:
        ps._GLOBAL_MEMORY_BUFFER = None


def test_sdpa_equals_megatrons_dot_product_attention_with_gqa_and_its_gradients(memory_buffer):
    q, k, v = _qkv(s=37, b=3)
    out, grads = _run(_attention("sdpa"), q, k, v)
    ref, ref_grads = _run(_attention("dot_product"), q, k, v)
    assert out.shape == ref.shape == (37, 3, HEADS * HEAD_DIM)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        torch.testing.assert_close(g, r, rtol=0, atol=5e-6, msg=f"grad of {name}")


def test_packed_sequences_attend_only_within_themselves():
    """thd: the pack [t, heads, hn] with cu_seqlens gives each sequence exactly what it gives alone (sbhd, b = 1);
    the pack's padding tail (past the last cu_seqlens entry) comes back as zeros."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = _attention("sdpa")
    lengths = [5, 1, 12, 9]
    q, k, v = _qkv(s=sum(lengths) + 3, b=1, seed=1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12)
    packed, _ = _run(attn, q[:, 0], k[:, 0], v[:, 0], packed_seq_params=params)
    assert packed.shape == (sum(lengths) + 3, HEADS * HEAD_DIM)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone, _ = _run(attn, q[start:end], k[start:end], v[start:end])
        torch.testing.assert_close(packed[start:end], alone[:, 0], rtol=0, atol=1e-6)
    assert torch.equal(packed[sum(lengths):], torch.zeros(3, HEADS * HEAD_DIM))


def test_what_sdpa_attention_cannot_do_is_refused_by_name():
    cp = _attention("sdpa", context_parallel_size=2)  # context parallelism: causal, no padding mask
    q, k, v = _qkv(s=4, b=1)
    with pytest.raises(ValueError, match="context parallelism takes causal attention without a padding mask"):
        cp(q, k, v, torch.zeros(1, 1, 4, 4, dtype=torch.bool), attn_mask_type=cp.attn_mask_type)
    attn = _attention("sdpa")
    q, k, v = _qkv(s=4, b=1)
    with pytest.raises(ValueError, match="attention_bias is not supported"):
        attn(q, k, v, None, attn_mask_type=attn.attn_mask_type, attention_bias=torch.zeros(1))


def test_the_layer_spec_takes_the_configured_kernel():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_spo.models.attention import SDPAttention
    from megatron_spo.models.config import ModelConfig
    from megatron_spo.models.spec import layer_spec

    cfg = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      vocab_size=100)
    for kernel, cls in (("sdpa", SDPAttention), ("dot_product", DotProductAttention)):
        spec, backend = layer_spec(cfg, "local", kernel)
        assert backend == "local"
        assert spec.submodules.self_attention.submodules.core_attention is cls
    assert ParallelConfig().attention_kernel == "sdpa"


@pytest.mark.parametrize("fields, message", [
    ({"recompute_granularity": "full"}, "recompute_granularity 'full' needs recompute_method"),
    ({"recompute_method": "uniform", "recompute_num_layers": 1}, "act only with recompute_granularity 'full'"),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1,
      "recompute_modules": ["mlp"]}, "recompute_modules acts only with recompute_granularity 'selective'"),
    ({"attention_kernel": "flash"}, "attention_kernel"),
])
def test_recompute_and_kernel_fields_are_checked(fields, message):
    from megatron_spo.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_config(ParallelConfig, fields, "parallel")


def test_recompute_fields_reach_megatrons_transformer_config():
    from megatron_spo.models.builders import transformer_config
    from megatron_spo.models.config import ModelConfig

    model = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=100)
    full = transformer_config(model, ParallelConfig(recompute_granularity="full", recompute_method="block",
                                                    recompute_num_layers=3))
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "block", 3)
    selective = transformer_config(model, ParallelConfig(recompute_granularity="selective",
                                                         recompute_modules=["mlp"]))
    assert (selective.recompute_granularity, selective.recompute_modules) == ("selective", ["mlp"])
    assert transformer_config(model, ParallelConfig()).recompute_granularity is None


def test_packing_with_megatrons_dot_product_attention_is_refused_in_the_config(tmp_path):
    from megatron_spo.config import ConfigError
    from megatron_spo.training.config import TrainConfig

    data = {"init": {"hf": str(tmp_path)}, "parallel": {"attention_kernel": "dot_product"}}
    with pytest.raises(ConfigError, match="batch.pack_sequences: megatron-core's DotProductAttention"):
        build_config(TrainConfig, data, "config")
    build_config(TrainConfig, {**data, "batch": {"pack_sequences": False}}, "config")


@pytest.mark.megatron
def test_attention_memory_grows_linearly_with_tokens_not_quadratically():
    """One decoder layer, forward + backward, 1024 -> 4096 tokens (tools/bench_attention.py, a fresh process): the
    SDPA kernel's peak grows at most 5x (the issue's bound; linear is 4x), megatron's DotProductAttention's
    materialised [s, s] scores ~16x (15.65x measured here), which shows the measurement can tell them apart."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_attention.py"), "--json"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])["results"]
    sdpa, dot = (results[k][1]["memory_ratio"] for k in ("sdpa", "dot_product"))
    assert sdpa <= 5.0, results
    assert dot >= 10.0, results


def test_the_gpu_varlen_path_asks_torch_for_causal_gqa_attention(monkeypatch):
    """On a GPU in half precision packed sequences go to torch's varlen flash kernel (CUDA only: it cannot run here).
    The wrapper must ask for causal attention in the signature torch has (torch 2.13: window_size (-1, 0)) and pass
    the K/V groups unexpanded with enable_gqa; a stand-in with that signature records the call."""
    import torch.nn.attention.varlen as varlen_module

    from megatron_spo.models import attention

    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append(dict(shapes=(query.shape, key.shape), cu=cu_seq_q.tolist(), max=(max_q, max_k), scale=scale,
                          window_size=window_size, enable_gqa=enable_gqa))
        return query.clone()

    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_attn)
    run = attention._varlen_causal()
    q, k = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    assert run(q, k, k, cu, 6, 0.125).shape == (10, 4, 8)
    assert calls == [dict(shapes=((10, 4, 8), (10, 2, 8)), cu=[0, 4, 10], max=(6, 6), scale=0.125,
                          window_size=(-1, 0), enable_gqa=True)]
