"""Mixture-of-experts trained at the layouts people train it at, held to one process (issue 61): expert parallelism
(EP 2 over 4 data-parallel ranks: expert-data-parallel 2), TP 2 + sequence parallelism x EP 2 and PP 2 x EP 2 over
DP 2 (each stage is sent its own layers' routes), for SPO (3 steps) and GRPO (1 step), replaying the engine's routes;
and an EP run resumed from its checkpoint trains as one that was not stopped. The model: a tiny odd Qwen3-MoE
(6 experts: not a power of two, EP 2 divides it; top-3; hidden 37, head_dim 12)."""

import json
import os

import pytest
import torch
from moe_helpers import make_tiny_moe
from trainer_helpers import EngineSource

pytestmark = [pytest.mark.multiproc]

ALGOS = {"spo": 3, "grpo": 1}
LAYOUTS = {  # name -> (ranks, parallel section)
    "ep2dp4": (4, {"expert_model_parallel_size": 2}),
    # each pipeline stage is sent its own layers' routes, each data-parallel rank its own rows' (trainer._deal_routes)
    "pp2-ep2dp2": (4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
    "tp2sp-ep2": (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2}),
}


def train_cfg(root, hf, name, algo, steps, parallel=None, **overrides):
    cfg = dict(run_dir=os.path.join(str(root), name), steps=steps, algo=algo, beta=0.5, init={"hf": hf},
               routing_replay="engine", parallel=dict(parallel or {}), optimizer={"lr": 1e-3, "warmup_steps": 2},
               batch={"sequences_per_step": 16, "max_tokens_per_micro_batch": 40, "max_seq_length": 64},
               rollout={"temperature_range": [1.0, 1.0], "top_p": 1.0},
               model_update_interval=1, checkpoint={"interval": 100}, logging={"progress": False})
    if algo == "grpo":  # whole prompt groups (4 sequences of up to 16 tokens) per micro-batch
        cfg["batch"] = dict(cfg["batch"], max_tokens_per_micro_batch=64)
    cfg.update(overrides)
    return cfg


def train_moe_and_dump(runs: list[tuple[dict, str]]) -> None:
    """One rank: each config trains on the local engine's samples of its MoE model with their routes (rank 0 holds the
    engine; a fresh one of seed 0 per run, so every run draws the same samples); rank 0 saves the HF-named weights."""
    from megatron_spo.models.hf_map import iter_hf_tensors
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, out_file) in enumerate(runs):
        cfg = TrainConfig.model_validate(cfg_data)
        source = EngineSource(cfg.init.hf, routes=True) if os.environ.get("RANK", "0") == "0" else None
        trainer = Trainer(cfg, online_source=source)
        try:
            trainer.train()
            weights = {name: t.clone() for name, t in iter_hf_tensors(trainer.policy, trainer.model_cfg)}
            if trainer.rank == 0:
                torch.save(weights, out_file)
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from megatron_spo.models.parallel import spawn_local

    root = tmp_path_factory.mktemp("moe-layouts")
    hf = str(make_tiny_moe(root / "hf", num_experts=6, num_experts_per_tok=3))
    single = [(train_cfg(root, hf, f"single-{a}", a, n), str(root / f"single-{a}.pt")) for a, n in ALGOS.items()]
    # 3 prompt groups on 2 data-parallel ranks: one rank has more micro-batches, the other runs idle ones
    uneven = dict(batch={"sequences_per_step": 12, "max_tokens_per_micro_batch": 40, "max_seq_length": 64})
    single.append((train_cfg(root, hf, "single-uneven", "spo", 3, **uneven), str(root / "single-uneven.pt")))
    # full activation recompute re-runs the routers in the backward: they must replay the same routes there
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    single.append((train_cfg(root, hf, "single-recompute", "spo", 3, recompute), str(root / "single-recompute.pt")))
    spawn_local(train_moe_and_dump, 1, single)
    spawn_local(train_moe_and_dump, 2, [(train_cfg(root, hf, "ep2dp2-uneven", "spo", 3, {"expert_model_parallel_size": 2},
                                                   **uneven), str(root / "ep2dp2-uneven.pt"))])
    runs = [(train_cfg(root, hf, f"{layout}-{a}", a, n, parallel), str(root / f"{layout}-{a}.pt"))
            for layout, (_, parallel) in LAYOUTS.items() for a, n in ALGOS.items()]
    # resume at EP 2: 1 step, checkpoint, then on to 3 steps in a new trainer (its source replays the draws it resumes)
    ep2 = LAYOUTS["ep2dp4"][1]
    first = train_cfg(root, hf, "resumed", "spo", 1, ep2)  # checkpointed at its last step
    second = train_cfg(root, hf, "resumed", "spo", 3, ep2)
    spawn_local(train_moe_and_dump, 4, runs + [(first, str(root / "resumed-1.pt")), (second, str(root / "resumed.pt"))])
    return root


def _metrics(root, name):
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


def _assert_alike(root, ref, got, steps):
    a, b = _metrics(root, ref), _metrics(root, got)
    assert [m["step"] for m in b] == list(range(1, steps + 1))
    for x, y in zip(a, b):  # fp32; routes replayed, so every layout picks the same experts
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-6)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    # step 1 (the engine's weights: it takes no pushes here): the engine's routes replayed give its log-probs
    assert b[0]["logprob_gap/mean_abs"] < 1e-5
    wa, wb = torch.load(root / f"{ref}.pt"), torch.load(root / f"{got}.pt")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=f"{got}: {k}")


@pytest.mark.megatron
@pytest.mark.parametrize("algo", list(ALGOS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_trains_like_one_process(trained, layout, algo):
    _assert_alike(trained, f"single-{algo}", f"{layout}-{algo}", ALGOS[algo])


@pytest.mark.megatron
def test_a_rank_with_fewer_micro_batches_runs_idle_ones_and_trains_like_one_process(trained):
    """EP 2 over 2 data-parallel ranks with 3 prompt groups: the ranks' micro-batch counts differ, the short one runs
    idle micro-batches (batch/idle_micro_batches, over both ranks) and the run trains as one process does."""
    _assert_alike(trained, "single-uneven", "ep2dp2-uneven", 3)
    assert all(m["batch/idle_micro_batches"] >= 1 for m in _metrics(trained, "ep2dp2-uneven"))
    assert all("batch/idle_micro_batches" not in m for m in _metrics(trained, "single-uneven"))


def test_each_rank_holds_only_its_share_of_the_routes():
    """tools/bench_routes_memory.py at a small size (8 sequences of 512 tokens, 4 layers, top-8 of 128 experts, one
    rank of DP 4 x PP 2): the ids take 1 byte (the engine's base64 int32: 5.33), and a rank receives its rows' and
    stage's routes only, so what it holds of them is under 1 / 40 of what every rank held before."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_routes_memory

    m = bench_routes_memory.measure(8, 512, 4, 8, 128, dp=4, pp=2)
    assert m["id_bytes_after"] == 1
    assert m["largest_share"] < m["before"] / 40, m


@pytest.mark.megatron
def test_routing_replay_under_full_recompute_trains_as_keeping_activations(trained):
    """The recomputed routers replay the micro-batch's routes (kept set through its backward): losses, grad norms
    and weights are the run's without recompute; PP > 1 (interleaved micro-batches) is refused in one line."""
    from megatron_spo.config import ConfigError
    from megatron_spo.models.config import ParallelConfig
    from megatron_spo.models.routing_replay import check_replay_layout

    _assert_alike(trained, "single-spo", "single-recompute", 3)
    with pytest.raises(ConfigError, match=r"^routing_replay: routing replay with parallel.recompute_granularity "
                                          r"'full' at pipeline_model_parallel_size 2 is not built"):
        check_replay_layout(ParallelConfig(pipeline_model_parallel_size=2, recompute_granularity="full",
                                           recompute_method="uniform", recompute_num_layers=1))


def test_single_process_moe_runs_trained_their_experts(trained):
    """The experts moved (a parity of untrained experts would prove nothing)."""
    from safetensors.torch import load_file

    init = {k: v for f in sorted((trained / "hf").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    w = torch.load(trained / "single-spo.pt")
    moved = max((w[k] - init[k]).abs().max().item() for k in init if ".mlp.experts." in k)
    assert moved > 1e-4


@pytest.mark.megatron
def test_an_ep2_run_resumed_from_its_checkpoint_trains_as_one_not_stopped(trained):
    # steps 2-3 of the resumed run against the same steps of the run at EP 2 that was not stopped
    a, b = _metrics(trained, "ep2dp4-spo"), _metrics(trained, "resumed")
    assert [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6, abs=1e-7)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6)
    wa, wb = torch.load(trained / "ep2dp4-spo.pt"), torch.load(trained / "resumed.pt")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-6, msg=k)
