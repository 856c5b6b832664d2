"""`megatron-spo plan`: the memory model against measurements, the weight-sync floor, throughput, CLI errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_spo.cli import main as cli_main
from megatron_spo.config import ConfigError
from megatron_spo.models.config import ModelConfig, ParallelConfig
from megatron_spo.planning import capacity
from megatron_spo.planning.config import CapacityConfig


def test_presets_are_the_published_llama31_sizes():
    # Hugging Face parameter counts of meta-llama/Llama-3.1-8B and -70B.
    assert capacity.load_preset("llama3.1-8b")[0].num_parameters() == 8_030_261_248
    assert capacity.load_preset("llama3.1-70b")[0].num_parameters() == 70_553_706_496
    for name, (model, _) in capacity.BUILTIN_PRESETS.items():
        assert model == capacity.load_preset(name)[0]  # built-in fallback = examples/models/*.yaml


def test_weight_sync_floor_and_bucketed_broadcast_70b():
    model, _ = capacity.load_preset("llama3.1-70b")
    shape = CapacityConfig()  # 400 Gb/s, 512 MB buckets, 10 ms per bucket, 90% efficiency
    ws = capacity.weight_sync(model, shape)
    assert ws.bytes == 2 * 70_553_706_496
    assert ws.floor_s == pytest.approx(2.822, abs=1e-3)  # the "about 2.8 s"
    assert ws.buckets == math.ceil(ws.bytes / 512e6) == 276
    assert ws.sequential_s == pytest.approx(276 * 0.010 + ws.bytes / (0.9 * 50e9))
    # Double buffering hides the per-bucket cost once a bucket's transfer outlasts it: 1/efficiency.
    assert ws.overlapped_over_floor == pytest.approx(1 / 0.9, rel=0.01)
    small = capacity.weight_sync(model, shape, bucket_mb=64)  # 1.4 ms transfer < 10 ms fixed cost
    assert small.overlapped_s == pytest.approx(small.buckets * 0.010, rel=0.01)
    zero_latency = capacity.weight_sync(model, CapacityConfig(weight_sync_bucket_latency_ms=0,
                                                              weight_sync_efficiency=1.0))
    assert zero_latency.sequential_s == pytest.approx(zero_latency.floor_s)


def test_optimizer_bytes_per_parameter_match_megatron():
    """18 B/param with the plain optimizer, 6 + 12/DP with the distributed one (megatron's own numbers)."""
    model, parallel = capacity.load_preset("llama3.1-70b")  # TP 8 x PP 2 -> DP 4 on 64 GPUs
    shape = CapacityConfig(reference_model=False, overhead_gb=0)
    params = capacity.stage_parameters(model, 8, 2)
    for distributed, per_param in ((False, 18), (True, 6 + 12 / 4)):
        m = capacity.memory_per_gpu(model, shape, parallel, distributed_optimizer=distributed, recompute="none")
        assert (m.weights + m.gradients + m.optimizer) / params == pytest.approx(per_param)
    # The larger stage of PP=2: 40 layers (norms replicated over TP) + the vocab-parallel LM head over the
    # vocabulary padded to a multiple of 128 x TP (129024) and the final norm (h more than the embedding).
    h, f, kv = 8192, 28672, 1024
    assert params == 40 * ((2 * h * h + 2 * h * kv + 3 * h * f) // 8 + 2 * h) + 129024 * h // 8 + h


def test_70b_plan_needs_distributed_optimizer_and_activation_terms():
    model, parallel = capacity.load_preset("llama3.1-70b")
    plan = capacity.make_plan(model, parallel, CapacityConfig())
    mem = plan["memory_gb"]
    assert not mem["plain opt, no recompute"]["fits"] and mem["dist-opt, no recompute"]["fits"]
    # Activations, TP 8 + SP, seq 4096, 1F1B with PP 2 and VPP 4: 40 layers x 2 micro-batches x (1 + 1/8)
    # per-layer bf16 elements per token (4h + h + 2kv + h + 3f) / 8, plus one layer's backward working set.
    per_layer = (6 * 8192 + 2 * 1024 + 3 * 28672) / 8 * 4096 * 2
    assert mem["dist-opt, no recompute"]["activations"] == pytest.approx((90 + 1) * per_layer / 1e9)
    full = (90 * 8192 / 8 * 4096 * 2 + 2 * per_layer) / 1e9
    assert mem["dist-opt, full recompute"]["activations"] == pytest.approx(full)
    # the op's backward: one fp32 logits block (4096 tokens x V/8 = 264 MB: capped at the op's default 64 MiB),
    # its bf16 copy, and grad_hidden in fp32 (4096 tokens x h)
    workspace = 1.5 * 64 * 2**20 + 4096 * 8192 * 4
    assert mem["dist-opt, no recompute"]["logprob_workspace"] == pytest.approx(workspace / 1e9)
    # Rollout demand: generated tokens per step / step time, step time from 8N + attention FLOPs.
    t = plan["throughput"]
    n = model.num_parameters()
    flops = (8 * n + 6 * 80 * 4096 * 8192) * 256 * 4096
    assert t["step_s"] == pytest.approx(flops / (64 * 400e12))
    assert t["rollout_tokens_per_s"] == pytest.approx(256 * 2048 / t["step_s"])
    assert t["rollout_tokens_per_s_per_worker_gpu"] == pytest.approx(t["rollout_tokens_per_s"] / 64)


def test_saved_activations_match_a_transformers_llama_exactly():
    """The per-layer accounting vs every tensor autograd saves in a real forward (GQA, sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                      num_query_groups=2, vocab_size=256, make_vocab_size_divisible_by=1)
    batch, seq = 2, 64
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=seq, tie_word_embeddings=False,
                                      attn_implementation="sdpa"))
    params = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 256, (batch, seq + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.log_softmax(hf(input_ids=ids[:, :-1]).logits, -1).gather(-1, ids[:, 1:, None])
    tokens = batch * seq
    predicted = (cfg.num_layers * capacity.layer_activation_elements(cfg, 1, False, "transformers")
                 + 3 * cfg.hidden_size + cfg.vocab_size) * tokens * 4
    # What the model leaves out: RMSNorm rstd, attention log-sum-exp, RoPE tables, token ids (< 1%).
    assert sum(saved.values()) == pytest.approx(predicted, rel=0.01)


@pytest.mark.slow
@pytest.mark.alone  # its peak RSS read 0.61x the model beside another xdist worker, 0.9-1.1x alone
def test_memory_model_within_30_percent_of_measured_cpu_peak():
    """A real fp32 forward + backward + Adam step of a 3.5M-param Llama (batch 4 x 512) in a subprocess."""
    result = capacity.validate_on_cpu()
    assert result["params_measured"] == result["params_model"]
    assert 0.7 <= result["ratio"] <= 1.3, result


def test_plan_cli_json_and_errors(capsys):
    assert cli_main(["plan", "--preset", "llama3.1-8b", "--json", "seq_length=8192", "global_batch_size=512"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["seq_length"] == 8192 and plan["layout"]["tp"] == 2 and plan["layout"]["dp"] == 32
    assert plan["weight_sync"]["floor_s"] == pytest.approx(2 * 8_030_261_248 * 8 / 400e9)

    assert cli_main(["plan", "--preset", "llama4"]) == 2
    assert "config error: plan: unknown model preset 'llama4' (known: llama3.1-70b, llama3.1-8b" in capsys.readouterr().err
    assert cli_main(["plan", "seq_length=0"]) == 2
    assert "command line: seq_length: Input should be greater than 0 (got 0)" in capsys.readouterr().err
    assert cli_main(["plan", "--tp", "16"]) == 2
    assert ("parallel.tensor_model_parallel_size 16 does not divide model.num_query_groups 8"
            in capsys.readouterr().err)
    assert cli_main(["plan", "global_batch_size=102"]) == 2
    assert ("plan: global_batch_size 102 is not divisible by micro_batch_size 1 x data-parallel size 4"
            in capsys.readouterr().err)


def test_plan_reads_the_example_configs(capsys):
    for size, bucket_mb in (("8b", 512), ("70b", 1024)):
        path = str(capacity.EXAMPLES / "slurm" / f"llama3.1-{size}.yaml")
        assert cli_main(["plan", "--preset", f"llama3.1-{size}", "--config", path, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["shape"]["weight_sync_bucket_mb"] == bucket_mb
        assert plan["memory_gb"]["dist-opt, no recompute"]["fits"]  # what the configs' comments claim
    assert cli_main(["plan", "--config", "no/such.yaml"]) == 2
    assert "config error: plan: config file 'no/such.yaml' does not exist" in capsys.readouterr().err


def test_rich_table_output(capsys):
    assert cli_main(["plan", "--preset", "llama3.1-70b"]) == 0
    out = capsys.readouterr().out
    assert "Memory per GPU" in out and "276 buckets of 512 MB" in out and "2.82" in out
    with pytest.raises(ConfigError, match="recompute must be 'none', 'selective' or 'full', got 'partial'"):
        capacity.activation_bytes(*capacity.load_preset("llama3.1-8b")[:1], CapacityConfig(trainer_gpus=8, global_batch_size=8),
                                  ParallelConfig(), "partial")


def test_plan_takes_its_throughput_from_a_measured_step_benchmark(tmp_path, capsys):
    """`plan --measured step_bench.json` (tools/bench_step.py): the SPO step's TFLOP/s in the plan's own FLOP count
    replaces the assumed 400, and the plan names the report; an explicit override still wins; a bad file is one line."""
    report = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01",
              "cases": [{"seq": 4096, "sequences": 8, "spo_plan_tflops": 312.5}]}
    path = tmp_path / "step_bench.json"
    path.write_text(json.dumps(report))
    assert cli_main(["plan", "--preset", "llama3.1-8b", "--json"]) == 0
    assumed = json.loads(capsys.readouterr().out)
    assert cli_main(["plan", "--preset", "llama3.1-8b", "--json", "--measured", str(path)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shape"]["achieved_tflops_per_gpu"] == 312.5
    assert plan["throughput_source"] == "measured: step_bench.json: NVIDIA H100 80GB HBM3, 2026-12-01, SPO step of 8 x 4096"
    assert assumed["throughput_source"] == "assumed"
    assert plan["throughput"]["step_s"] == pytest.approx(assumed["throughput"]["step_s"] * 400 / 312.5)
    assert cli_main(["plan", "--preset", "llama3.1-8b", "--json", "--measured", str(path),
                     "achieved_tflops_per_gpu=500"]) == 0
    assert json.loads(capsys.readouterr().out)["throughput_source"] == "as given"
    assert cli_main(["plan", "--preset", "llama3.1-8b"]) == 0
    assert "400 TFLOP/s achieved per trainer GPU, assumed" in capsys.readouterr().out
    path.write_text("{}")
    assert cli_main(["plan", "--measured", str(path)]) == 2
    assert ("config error: plan --measured: '" + str(path) + "' is not a readable step benchmark report"
            in capsys.readouterr().err)


def test_lora_plan_holds_the_adapters_gradients_and_state_and_pushes_them_alone():
    """lora_rank: the frozen base keeps its bf16 weights, gradients and Adam state are the adapters' (megatron's
    split), no reference weights, 4N + 2N training FLOPs per token, and a push is worker_gpus base64 copies of the
    bf16 adapter in HF PEFT names (q/k/v, gate/up each with their own A)."""
    model, parallel = capacity.load_preset("llama3.1-70b")  # TP 8 x PP 2, DP 4 on 64 GPUs
    shape = CapacityConfig(lora_rank=16, overhead_gb=0)
    h, f, q, kv, r = 8192, 28672, 8192, 1024, 16
    per_gpu = 40 * (r * 4 * h + r * (q + 2 * kv + q + 3 * f) // 8)
    assert capacity.lora_parameters(model, 16, 8, 2) == per_gpu
    assert capacity.lora_parameters(model, 16) == 80 * r * (4 * h + q + 2 * kv + q + 3 * f) == 175_636_480
    m = capacity.memory_per_gpu(model, shape, parallel, distributed_optimizer=True, recompute="none")
    params = capacity.stage_parameters(model, 8, 2)
    assert (m.weights, m.gradients, m.optimizer, m.reference) == (2 * (params + per_gpu), 4 * per_gpu,
                                                                   12 * per_gpu / 4, 0.0)
    pushed = 80 * r * (3 * h + q + 2 * h + f + q + 2 * kv + h + 2 * f + h)
    ws = capacity.weight_sync(model, shape)
    assert ws.bytes == 64 * 4 * math.ceil(pushed * 2 / 3) and ws.buckets == 1
    assert ws.sequential_s == pytest.approx(0.010 + ws.bytes / (0.9 * 50e9))
    full = capacity.make_plan(model, parallel, CapacityConfig())
    lora = capacity.make_plan(model, parallel, CapacityConfig(lora_rank=16))
    n = model.num_parameters()
    assert lora["throughput"]["step_s"] / full["throughput"]["step_s"] == pytest.approx(
        (6 * n + 6 * 80 * 4096 * 8192) / (8 * n + 6 * 80 * 4096 * 8192))
    assert lora["memory_gb"]["plain opt, no recompute"]["fits"] and not full["memory_gb"]["plain opt, no recompute"]["fits"]


def test_moe_presets_are_the_published_qwen3_moe_sizes():
    """Qwen3-30B-A3B and Qwen3-235B-A22B (their config.json): total and active parameters, exactly, and the model
    cards' 30.5B / 3.3B and 235B / 22B to the cards' digits (truncated)."""
    small, big = capacity.moe_counts(capacity.load_preset("qwen3-30b-a3b")[0]), capacity.moe_counts(
        capacity.load_preset("qwen3-235b-a22b")[0])
    assert (small.total, small.active) == (30_532_122_624, 3_353_032_704)
    assert (big.total, big.active) == (235_093_634_560, 22_190_763_520)
    assert (small.total // 10**8, small.active // 10**8, big.total // 10**9, big.active // 10**9) == (305, 33, 235, 22)
    # embeddings + L x (attention + q/k norms + 2 norms + router + E experts) + final norm + LM head
    h, q, kv, e, f = 2048, 32 * 128, 4 * 128, 128, 768
    assert small.total == 2 * 151936 * h + 48 * (2 * h * q + 2 * h * kv + 256 + 2 * h + e * h + e * 3 * h * f) + h
    assert (small.router, small.expert_tensors, big.router, big.expert_tensors) == (
        48 * 128 * 2048, 48 * 128 * 3, 94 * 128 * 4096, 94 * 128 * 3)


def test_moe_plan_splits_experts_over_ep_and_prices_active_flops():
    """30B-A3B on 64 GPUs at EP 8 (TP 1, dist-opt): experts' weights / grads over EP, their Adam state over the
    8 expert-DP ranks, the rest over DP 64; k dispatched copies per token in the activations; 8 x active
    parameters in the FLOPs; the push is every tensor (all 18432 expert tensors) in bf16."""
    model, parallel = capacity.load_preset("qwen3-30b-a3b")
    plan = capacity.make_plan(model, parallel, CapacityConfig())
    h, q, kv, e, f, k, layers = 2048, 4096, 512, 128, 768, 8, 48
    experts = layers * (e // 8) * 3 * h * f
    dense = layers * (2 * h * q + 2 * h * kv + 256 + 2 * h + e * h) + 2 * 151936 * h + h
    assert capacity.moe_stage_parameters(model, 1, 1, 8) == capacity.StageParameters(dense=dense, experts=experts)
    mem = plan["memory_gb"]["dist-opt, no recompute"]
    assert mem["weights"] * 1e9 == pytest.approx(2 * (dense + experts))
    assert mem["gradients"] * 1e9 == pytest.approx(4 * (dense + experts))
    assert mem["optimizer"] * 1e9 == pytest.approx(12 * (dense / 64 + experts / 8))
    assert mem["reference"] * 1e9 == pytest.approx(2 * (dense + experts))
    per_layer = (4 * h + 4 * e + q + 2 * kv + q + k * (2 * h + 3 * f)) * 4096 * 2  # bf16, one sequence of 4096
    assert mem["activations"] * 1e9 == pytest.approx((layers + 1) * per_layer)
    assert mem["fits"] and round(mem["total"], 1) == 78.9
    assert (plan["layout"]["dp"], plan["layout"]["ep"], plan["layout"]["expert_dp"]) == (64, 8, 8)
    moe = plan["model"]["moe"]
    per_token = 8 * 3_353_032_704 + 6 * layers * 4096 * h
    assert plan["throughput"]["flops_per_step"] == 256 * 4096 * per_token
    assert moe["router_share_of_flops"] == pytest.approx(8 * 48 * 128 * 2048 / per_token)
    assert moe["router_share_of_parameters"] == pytest.approx(48 * 128 * 2048 / 30_532_122_624)
    assert plan["weight_sync"]["bytes"] == 2 * 30_532_122_624 and moe["expert_tensors"] == 18432
    assert plan["notes"][0].startswith("expert_model_parallel_size 8: each rank of an expert group runs the step's "
                                       "most micro-batches")
    # 235B-A22B: no expert-DP sharding at 64 GPUs (does not fit); at 256 its Adam state splits 4 ways, fits with
    # full recompute
    model, parallel = capacity.load_preset("qwen3-235b-a22b")
    at64 = capacity.make_plan(model, parallel, CapacityConfig())["memory_gb"]
    at256 = capacity.make_plan(model, parallel, CapacityConfig(trainer_gpus=256))["memory_gb"]
    assert not any(v["fits"] for v in at64.values())
    assert at256["dist-opt, full recompute"]["fits"] and not at256["dist-opt, no recompute"]["fits"]
    assert at64["dist-opt, full recompute"]["optimizer"] / at256["dist-opt, full recompute"]["optimizer"] == \
        pytest.approx(4, rel=0.02)


def test_validate_checks_a_moe_config_with_the_moe_memory_formula():
    """`megatron-spo validate`'s memory line for a MoE model is the MoE plan's (experts' activations: k copies of
    the expert's sizes), not the dense one (which would price the HF intermediate_size as one SwiGLU)."""
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.validate import Report, _check_memory

    model, _ = capacity.load_preset("qwen3-30b-a3b")
    cfg = TrainConfig.model_validate(dict(init={"hf": "x"}, parallel={"use_distributed_optimizer": True}))
    r = Report()
    _check_memory(cfg, model, 8, 80.0, r)
    shape = CapacityConfig(**capacity.capacity_shape(cfg, 8, 80.0))
    moe = capacity.memory_per_gpu(model, shape, cfg.parallel, distributed_optimizer=True, recompute="none")
    h, q, kv, e, f, k = 2048, 4096, 512, 128, 768, 8
    tokens = shape.micro_batch_size * shape.seq_length
    assert moe.activations == pytest.approx(49 * (4 * h + 4 * e + 2 * q + 2 * kv + k * (2 * h + 3 * f)) * tokens * 2)
    assert r.problems == [f"memory: the plan needs {moe.total / 1e9:.1f} GB per GPU (batch 128 x seq 4096, "
                          "micro-batch 4 x 4096 tokens) > 80 GB (megatron-spo plan --config shows the breakdown; raise "
                          "TP / PP / CP, set use_distributed_optimizer or recompute_granularity full, or lower "
                          "batch.max_tokens_per_micro_batch)"]
    dense_activations = 49 * (4 * h + 2 * q + 2 * kv + 3 * 6144) * tokens * 2
    assert abs(moe.activations - dense_activations) > 50e9


def _70b_layout(**kw) -> ParallelConfig:
    """The 70B preset's TP 8 + SP x PP 2 x VPP 4, distributed optimizer, with these fields changed."""
    return ParallelConfig(**{**capacity.load_preset("llama3.1-70b")[1].model_dump(), **kw})


def test_context_parallel_halves_each_ranks_tokens_and_keeps_whole_keys_values(capsys):
    """CP 2 on 64 GPUs (TP 8 x PP 2 x CP 2 -> DP 2): a rank keeps half of each 32768-token sequence's activations
    plus the all-gathered keys / values of all of it in place of its own half (2 kv/TP x T x (1 - 1/CP) elements
    per layer more); the distributed optimizer's state over DP x CP = 4 ranks as at CP 1 (DP 4); the log-prob op
    on half the tokens."""
    model = capacity.load_preset("llama3.1-70b")[0]
    shape = CapacityConfig(seq_length=32768, global_batch_size=128, overhead_gb=0)
    h, f, kv, t = 8192, 28672, 1024, 32768
    per_layer = (6 * h + 2 * kv + 3 * f) / 8 * t * 2  # bf16, CP 1
    held = 40 * 2 * (1 + 1 / 8)  # PP 2 micro-batches in flight, VPP 4
    one, two = (capacity.memory_per_gpu(model, shape, _70b_layout(context_parallel_size=cp), distributed_optimizer=True,
                                        recompute="none") for cp in (1, 2))
    assert one.activations == pytest.approx((held + 1) * per_layer)
    assert two.activations == pytest.approx(one.activations / 2 + (held + 1) * 2 * kv / 8 * t / 2 * 2)
    assert (two.weights, two.gradients, two.optimizer, two.reference) == (one.weights, one.gradients, one.optimizer,
                                                                          one.reference)
    assert one.logprob_workspace - two.logprob_workspace == pytest.approx(t / 2 * h * 4)  # grad_hidden halves
    full = capacity.memory_per_gpu(model, shape, _70b_layout(context_parallel_size=2), distributed_optimizer=True,
                                   recompute="full")
    per_layer_cp2 = (6 * h + 2 * kv + 3 * f) / 8 * t / 2 * 2 + 2 * kv / 8 * t / 2 * 2
    assert full.activations == pytest.approx(held * h / 8 * t / 2 * 2 + 2 * per_layer_cp2)
    plan = capacity.make_plan(model, _70b_layout(context_parallel_size=2), shape)
    assert {k: plan["layout"][k] for k in ("tp", "pp", "cp", "dp", "microbatches")} == dict(tp=8, pp=2, cp=2, dp=2,
                                                                                           microbatches=64)
    # a MoE model's expert state over the expert-data-parallel ranks DP x CP / EP: 30B-A3B at CP 2 (DP 32) as at DP 64
    moe, moe_parallel = capacity.load_preset("qwen3-30b-a3b")
    at = [capacity.memory_per_gpu(moe, CapacityConfig(), moe_parallel.model_copy(update={"context_parallel_size": cp}),
                                  distributed_optimizer=True, recompute="none").optimizer for cp in (1, 2)]
    assert at[0] == at[1]
    assert cli_main(["plan", "--cp", "2", "--json", "seq_length=32768", "global_batch_size=128"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert (cli["layout"]["cp"], cli["layout"]["dp"]) == (2, 2)
    assert cli["memory_gb"]["dist-opt, no recompute"]["activations"] == pytest.approx(two.activations / 1e9)


def test_recompute_variants_drop_what_megatron_core_drops():
    """Selective core_attn keeps what no recompute keeps (flash / SDPA attention stores no scores); mlp drops the
    fc1 and SwiGLU outputs (3f/TP), layernorm the two norms' outputs (2h/TP under SP); full recompute's units:
    uniform n keeps one input per n layers and re-runs n, block n keeps the input of the first n layers of each
    10-layer model chunk and everything of the others."""
    model = capacity.load_preset("llama3.1-70b")[0]
    shape = CapacityConfig(global_batch_size=128)
    h, f, kv, t = 8192, 28672, 1024, 4096
    per_layer = (6 * h + 2 * kv + 3 * f) / 8 * t * 2
    layer_input = h / 8 * t * 2
    held = 40 * 2 * (1 + 1 / 8)

    def act(recompute, **kw):
        return capacity.activation_bytes(model, shape, _70b_layout(**kw), recompute)

    assert act("selective", recompute_granularity="selective") == act("none")  # megatron's default: core_attn
    dropped = (3 * f / 8 + 2 * h / 8) * t * 2
    assert act("selective", recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]) == \
        pytest.approx(held * (per_layer - dropped) + dropped + per_layer)
    full = dict(recompute_granularity="full")
    assert act("full") == act("full", **full, recompute_method="uniform", recompute_num_layers=1) == pytest.approx(
        held * layer_input + 2 * per_layer)
    assert act("full", **full, recompute_method="uniform", recompute_num_layers=2) == pytest.approx(
        held * layer_input / 2 + 3 * per_layer)
    assert act("full", **full, recompute_method="block", recompute_num_layers=4) == pytest.approx(
        held * (4 * layer_input + 6 * per_layer) / 10 + 2 * per_layer)
    assert act("full", **full, recompute_method="block", recompute_num_layers=10) == pytest.approx(act("full"))


def test_validate_prices_a_selective_config_as_its_plan_column():
    """A training config with selective recompute of the MLP: capacity_shape takes its recompute, the plan adds its
    column (dist-opt, selective recompute) and validate's line is that column's figure."""
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.validate import Report, _check_memory

    model, _ = capacity.load_preset("llama3.1-8b")
    cfg = TrainConfig.model_validate(dict(init={"hf": "x"}, parallel=dict(
        tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True,
        recompute_granularity="selective", recompute_modules=["mlp"])))
    shape = CapacityConfig(**capacity.capacity_shape(cfg, 64, 80.0))
    plan = capacity.make_plan(model, cfg.parallel, shape)
    assert shape.recompute == "selective" and plan["config_scenario"] == "dist-opt, selective recompute"
    column = plan["memory_gb"]["dist-opt, selective recompute"]
    tokens = shape.micro_batch_size * shape.seq_length
    assert plan["memory_gb"]["dist-opt, no recompute"]["activations"] - column["activations"] == pytest.approx(
        31 * 3 * 14336 / 2 * tokens * 2 / 1e9)  # 32 layers' fc1 / SwiGLU outputs less one layer's, recomputed
    r = Report()
    _check_memory(cfg, model, 64, 80.0, r)
    assert r.notes == [f"memory plan {column['total']:.1f} GB per GPU of 80 (batch 128 x seq 4096, micro-batch 4 x "
                       "4096 tokens, selective recompute)"]
