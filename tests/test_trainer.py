"""The trainer on megatron-core: TP / PP / PP x VPP parity with one process, for SPO, AGRO and PPO."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from selection import is_selected, selected_params
from trainer_helpers import (
    DeterministicSource,
    Traj,
    make_tiny_hf,
    run_spawned,
    train_with_failing_pushes,
    trainer_config,
)

from megatron_spo.config import ConfigError, build_config
from megatron_spo.training.config import TrainConfig
from megatron_spo.training.metrics import PANELS, UNPLOTTED, panel_names, plot_run
from megatron_spo.training.micro_batches import micro_batches, microbatch_group_size, split_to_count

# Marked `megatron` (run again on the newest megatron-core): the tests whose subject is megatron-core's layouts and
# schedules; the others test this project's logic on top of them.
pytestmark = [pytest.mark.multiproc]

ALGOS = ("spo", "agro", "ppo", "grpo", "grpo-guided")  # grpo-guided: GRPO with demonstrations (grpo.guide_path)
LAYOUTS = (("single", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2))


def _metrics(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hf):
    """Two optimizer steps (several micro-batches each) of every algorithm under every layout. The TP=2 runs
    also set logprobs.chunk_size: the trainer passes it to the fused op, whose blocks must not change results."""
    root = tmp_path_factory.mktemp("runs")
    for layout, tp, pp in LAYOUTS:
        kw = {"logprobs": {"chunk_size": 5, "backend": "torch"}} if layout == "tp2" else {}
        runs = [(trainer_config(root, hf, f"{layout}-{algo}", algo, tp, pp, **kw), str(root / f"{layout}-{algo}.pt"))
                for algo in ALGOS]
        run_spawned(runs, tp * pp)
    return root


def _assert_trains_alike(root, ref_name, name, algo):
    ref_metrics = _metrics(root, ref_name)
    ref_weights = torch.load(root / f"{ref_name}.pt")
    metrics = _metrics(root, name)
    weights = torch.load(root / f"{name}.pt")
    assert [m["step"] for m in metrics] == [1, 2]
    # PPO's loss is a sum of O(1) terms (whitened advantages x ratios) cancelling to ~0.04, so fp32
    # reduction-order noise of ~1e-7 per term shows as ~2e-6 absolute (measured); its grad norm still
    # agrees to 1e-7 relative. The other losses do not cancel and keep the tighter bound.
    loss_abs = 1e-5 if algo == "ppo" else 1e-6
    for a, b in zip(ref_metrics, metrics):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=loss_abs)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)  # TP: from vocabulary-parallel statistics
        if algo == "ppo":
            assert b["grad_norm/value"] == pytest.approx(a["grad_norm/value"], rel=1e-4)
    assert weights.keys() == ref_weights.keys()
    for k in ref_weights:
        torch.testing.assert_close(weights[k], ref_weights[k], rtol=1e-4, atol=1e-5, msg=f"{name}: {k}")


@pytest.mark.megatron
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_parallel_layout_trains_like_one_process(trained, hf, algo, layout):
    _assert_trains_alike(trained, f"single-{algo}", f"{layout}-{algo}", algo)


@pytest.mark.megatron
@pytest.mark.parametrize("algo", ALGOS)
def test_training_moved_the_policy(trained, hf, algo):
    init = load_file(f"{hf}/model.safetensors")
    weights = torch.load(trained / f"single-{algo}.pt")
    assert init.keys() == weights.keys()
    assert max((weights[k] - init[k]).abs().max().item() for k in init) > 1e-4
    m = _metrics(trained, f"single-{algo}")
    assert m[0]["lr"] == pytest.approx(5e-4) and m[1]["lr"] == pytest.approx(1e-3)  # linear warm-up, then constant


def test_every_logged_metric_is_plotted_and_kl_comes_from_online_samples(trained, hf, tmp_path):
    """Each algorithm's metrics.jsonl: every name it logs lands in a plot panel (PANELS names drift from the
    losses' metric names otherwise: two SPO panels once drew nothing). All data here is online, so the KL
    estimate is the mean sequence log-ratio; the trainer's own rollout keys come from the quickstart test."""
    for algo in ALGOS:
        records = _metrics(trained, f"single-{algo}")
        logged = {k for r in records for k in r} - UNPLOTTED
        drawn = {n for title in PANELS for n in panel_names(title, logged)}
        assert logged - drawn == set(), algo
        for r in records:
            if algo == "ppo":
                assert "kl" not in r and "approx_kl_old_new" in r
            elif algo == "grpo":
                assert "approx_kl_old_new" in r and "clip_fraction" in r
                assert r["kl"] == r["mean_seq_log_ratio/online"] == pytest.approx(r["mean_seq_log_ratio"], rel=1e-9)
            elif algo == "grpo-guided":  # 8 rollouts + p0's (step 1) or p2's (step 2) demonstration
                assert r["guide_share"] == pytest.approx(1 / 9)
                assert r["kl"] == r["mean_seq_log_ratio/online"]
                assert r["mean_seq_log_ratio"] == pytest.approx(
                    (8 * r["mean_seq_log_ratio/online"] + r["mean_seq_log_ratio/guide"]) / 9, rel=1e-9)
            else:
                assert r["kl"] == r["mean_seq_log_ratio/online"] == pytest.approx(r["mean_seq_log_ratio"], rel=1e-9)
    # step 1's shaped p / (p + 0.1) of the demonstration is the initial model's, in plain torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]])).logits[0].double(), -1)
    p = logp[3:8].gather(1, torch.tensor([[5], [6], [7], [8], [9]])).exp()
    for name in ("single-grpo-guided", "tp2-grpo-guided", "pp2-grpo-guided"):
        assert _metrics(trained, name)[0]["guide_shaped_p"] == pytest.approx(float((p / (p + 0.1)).mean()), rel=1e-5)
    written = {p.name for p in plot_run(trained / "single-spo", tmp_path)}
    assert {"spo_terminal_q_t_reward.png", "spo_mean_token_advantage.png", "log_pi_pi_0_of_online_samples_kl_if_t_1_fresh.png",
            "policy_entropy_nats_token.png", "learning_rate.png"} <= written


def test_logged_entropy_is_the_initial_policys_on_the_first_batch(trained, hf):
    """Step 1 logs the entropy of the policy before its first update, i.e. of the initial model: here in plain
    torch (the HF model, a full softmax in fp64) on the same 8 trajectories, at the positions that predict
    response tokens, averaged per sequence, then over sequences. Step 2's policy has moved: a different value."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    per_sequence = []
    for traj in DeterministicSource().take(8):
        ids = torch.tensor([traj.prompt_tokens + traj.response_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)[len(traj.prompt_tokens) - 1 : -1]
        per_sequence.append(-(logp.exp() * logp).sum(-1).mean().item())
    want = sum(per_sequence) / len(per_sequence)
    for name in ("single-spo", "single-agro", "single-ppo", "tp2-spo", "pp2-ppo"):
        first, second = _metrics(trained, name)
        assert first["entropy"] == pytest.approx(want, rel=1e-5), name
        assert abs(second["entropy"] - first["entropy"]) > 1e-4, name


# -- interleaved (virtual) pipeline: PP=2 x VPP=2 on a 4-layer model, one layer per model chunk --------------
# name: (algo, max_tokens_per_micro_batch). With virtual stages every micro-batch of a step has one shape (the
# step's longest sequence, here 11 tokens; rows padded): 48 -> 2 micro-batches of 4; 36 -> 3 (3, 3, 2+1 padded
# row: megatron's interleaved schedule then needs 3 contiguous micro-batches per virtual stage); 100 -> 1 of 8,
# split in 2 (the schedule needs >= PP); AGRO 128 -> both prompt groups in 1, split at the group boundary.
# No loss depends on the packing: PPO whitens its advantages over the whole step (algorithms.whiten_over_batch),
# so its 3-micro-batch and split runs match the 2-micro-batch single process too (per micro-batch whitening
# did not).
VPP_RUNS = {"spo": ("spo", 48), "spo-3mb": ("spo", 36), "spo-split": ("spo", 100), "agro-split": ("agro", 128),
            "ppo": ("ppo", 48), "ppo-3mb": ("ppo", 36)}


def test_centred_spo_trains_alike_however_micro_batches_cut_its_prompt_groups(tmp_path, hf):
    """sources.online.centre with one micro-batch per step (groups whole, one process: centred inside the loss,
    no extra forward) and with a 24-token budget at PP=2 (3-4 micro-batches cutting the groups of 4: the
    step-wide baselines, one no-grad forward over the step on the last stage): the same two steps, the same
    residual_group_var and share clipped."""
    online = {"online": {"centre": True, "trust_region": 0.2}}

    def cfg(name, budget, pp=1):
        c = trainer_config(tmp_path, hf, name, pp=pp, sources=online)
        c["batch"] = dict(c["batch"], max_tokens_per_micro_batch=budget)
        return c, str(tmp_path / f"{name}.pt")

    run_spawned([cfg("whole", 512), cfg("groups-whole", 48)], 1)
    run_spawned([cfg("pp2-cut", 24, pp=2)], 2)
    _assert_trains_alike(tmp_path, "whole", "pp2-cut", "spo")
    # 48 tokens hold a group of 4 (~40 tokens) but not the step's 2: two micro-batches, each group whole in one,
    # each centring inside its own loss without the step-wide forward, exactly as one micro-batch does
    _assert_trains_alike(tmp_path, "whole", "groups-whole", "spo")
    for a, b in zip(_metrics(tmp_path, "whole"), _metrics(tmp_path, "pp2-cut")):
        assert b["residual_group_var/online"] == pytest.approx(a["residual_group_var/online"], rel=1e-5)
        assert b["trust_region_clipped/online"] == pytest.approx(a["trust_region_clipped/online"], rel=1e-6)
        assert a["trust_region_clipped/online"] > 0


def test_packed_micro_batches_train_like_padded_ones(tmp_path, hf):
    """batch.pack_sequences (the default: whole sequences back to back, THD) against padded rows, with one
    micro-batch per step so both cut the step alike: SPO (policy log-probs and the gap pass) and PPO (the value
    model's outputs too) take the same two steps."""
    runs = []
    for algo in ("spo", "ppo"):
        for pack in (True, False):
            c = trainer_config(tmp_path, hf, f"{algo}-{'packed' if pack else 'padded'}", algo)
            c["batch"] = dict(c["batch"], max_tokens_per_micro_batch=512, pack_sequences=pack)
            runs.append((c, str(tmp_path / f"{c['run_dir'].rsplit('/', 1)[1]}.pt")))
    run_spawned(runs, 1)
    for algo in ("spo", "ppo"):
        _assert_trains_alike(tmp_path, f"{algo}-padded", f"{algo}-packed", algo)


def test_centred_spo_keeps_prompt_groups_whole_where_they_fit_the_budget():
    """Whole groups spare the centred coefficient its step-wide forward (cuts_a_group false); a budget no group
    fits cuts them (and the trainer runs that forward)."""
    from megatron_spo.training.algos.spo import cuts_a_group

    trajs = DeterministicSource().take(8)  # 2 prompt groups of 4, ~40 tokens each

    def cut(budget):
        cfg = TrainConfig.model_validate(trainer_config(Path("/nonexistent"), "/nonexistent", "x", batch={
            "sequences_per_step": 8, "max_tokens_per_micro_batch": budget, "max_seq_length": 64}))
        mbs = micro_batches(trajs, cfg, keep_groups=False, prefer_groups=True, pad_id=0, dp_rank=0)
        return len(mbs), cuts_a_group(mbs, frozenset({"online"}))

    assert cut(48) == (2, False)
    assert cut(24)[1] is True
    assert cut(512) == (1, False)


@pytest.mark.megatron
def test_activation_recompute_trains_exactly_like_keeping_activations(tmp_path, hf):
    """parallel.recompute_*: megatron-core recomputes whole layers (full, uniform) or the core attention
    (selective) in the backward; the gradients, and so the two steps, are the same as with every activation kept."""
    variants = {"kept": {}, "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                                     "recompute_num_layers": 1},
                "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]}}
    runs = []
    for name, fields in variants.items():
        c = trainer_config(tmp_path, hf, f"recompute-{name}")
        c["parallel"] = dict(c["parallel"], **fields)
        runs.append((c, str(tmp_path / f"recompute-{name}.pt")))
    run_spawned(runs, 1)
    for name in ("full", "selective"):
        _assert_trains_alike(tmp_path, "recompute-kept", f"recompute-{name}", "spo")


def test_a_reference_refresh_copies_the_policy_and_a_resume_keeps_it(tmp_path, hf):
    """reference_refresh_interval 2: step 3's reference is step 2's policy, so log(pi / pi_ref) on step 3's batch
    is exactly 0 (without the refresh it is not); online groups then take Q0 from their own rewards. A run of 2
    steps, its checkpoint, and a resumed third step train exactly as 3 steps straight (the reference is saved)."""
    online = {"online": {"loss": "squared"}}  # centred by default: what a refresh needs

    def cfg(name, steps=3, **kw):
        return trainer_config(tmp_path, hf, name, steps=steps, sources=online, **kw), str(tmp_path / f"{name}.pt")

    # "late": 2 steps without refreshes, then resumed with them on (its checkpoint holds no reference: the init's)
    late = [cfg("late", 2), cfg("late", 3, reference_refresh_interval=2,
                                checkpoint={"interval": 100, "allow_config_change": True})]
    run_spawned([cfg("fixed"), cfg("refresh", reference_refresh_interval=2)]
                + [cfg("resumed", steps, reference_refresh_interval=2) for steps in (2, 3)] + late, 1)
    fixed, refresh = _metrics(tmp_path, "fixed"), _metrics(tmp_path, "refresh")
    ratio = "mean_seq_log_ratio/online"
    assert [m["reference_step"] for m in refresh] == [0, 2, 2] and "reference_step" not in fixed[0]
    assert refresh[0][ratio] == fixed[0][ratio] == 0 and refresh[1][ratio] == fixed[1][ratio] != 0
    assert refresh[2][ratio] == 0 and abs(fixed[2][ratio]) > 1e-3
    # step 3's Q0 is each group's soft value of its rewards (here above the table's -0.5 where a group succeeds)
    assert refresh[2]["residual_mean/online"] != pytest.approx(fixed[2]["residual_mean/online"], abs=1e-3)
    assert [m["step"] for m in _metrics(tmp_path, "resumed")] == [1, 2, 3]
    late_metrics = _metrics(tmp_path, "late")
    assert [m["step"] for m in late_metrics] == [1, 2, 3] and late_metrics[2]["reference_step"] == 0
    assert late_metrics[2][ratio] == pytest.approx(fixed[2][ratio], rel=1e-6)  # still against the init weights
    straight, resumed = torch.load(tmp_path / "refresh.pt"), torch.load(tmp_path / "resumed.pt")
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=1e-7, msg=k)
    # TP=2: each rank copies its own shards
    run_spawned([cfg("tp2-refresh", tp=2, reference_refresh_interval=2)], 2)
    tp2 = _metrics(tmp_path, "tp2-refresh")
    assert tp2[2][ratio] == 0 and tp2[2]["loss"] == pytest.approx(refresh[2]["loss"], rel=1e-5, abs=1e-6)
    for k, w in torch.load(tmp_path / "tp2-refresh.pt").items():
        torch.testing.assert_close(w, straight[k], rtol=1e-4, atol=1e-5, msg=k)


def _vpp_cfg(root, hf, name, algo, budget, **kw):
    cfg = trainer_config(root, hf, name, algo, parallel={"pipeline_model_parallel_size": 2,
                                               "virtual_pipeline_model_parallel_size": 2}, **kw)
    cfg["batch"] = dict(cfg["batch"], max_tokens_per_micro_batch=budget)
    return cfg


@pytest.fixture(scope="module")
def hf4(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("hf4") / "tiny"), num_layers=4)


@pytest.fixture(scope="module")
def trained_vpp(request, tmp_path_factory, hf4):
    """2 steps of each selected VPP_RUNS entry at PP=2 x VPP=2 (2 ranks) and of its algorithm in one process; plus
    the 'spo' run again as 1 step, a checkpoint, and a resumed second step; 'ppo' for the conversion."""
    names = selected_params(request, "test_virtual_pipeline_trains_like_one_process", "name")
    if is_selected(request, "test_virtual_pipeline_checkpoint_resumes_exactly"):
        names.add("spo")
    if is_selected(request, "test_virtual_pipeline_checkpoint_converts_to_the_final_policy"):
        names.add("ppo")
    algos = sorted({VPP_RUNS[name][0] for name in names})
    root = tmp_path_factory.mktemp("vpp")
    run_spawned([(trainer_config(root, hf4, f"single-{algo}", algo), str(root / f"single-{algo}.pt")) for algo in algos], 1)
    runs = [(_vpp_cfg(root, hf4, f"vpp-{name}", algo, budget), str(root / f"vpp-{name}.pt"))
            for name, (algo, budget) in VPP_RUNS.items() if name in names]
    if is_selected(request, "test_virtual_pipeline_checkpoint_resumes_exactly"):
        runs += [(_vpp_cfg(root, hf4, "vpp-resumed", "spo", 48, steps=steps), str(root / "vpp-resumed.pt"))
                 for steps in (1, 2)]
    run_spawned(runs, 2)
    return root


@pytest.mark.megatron
@pytest.mark.parametrize("name", list(VPP_RUNS))
def test_virtual_pipeline_trains_like_one_process(trained_vpp, name):
    algo = VPP_RUNS[name][0]
    _assert_trains_alike(trained_vpp, f"single-{algo}", f"vpp-{name}", algo)


@pytest.mark.megatron
def test_virtual_pipeline_checkpoint_resumes_exactly(trained_vpp):
    """1 step, checkpoint (all chunks under 'policy.model0.'), resume, 1 step == 2 steps straight."""
    assert [m["step"] for m in _metrics(trained_vpp, "vpp-resumed")] == [1, 2]
    # the 1-step run left a complete checkpoint, which the 2-step run (same run_dir) must have resumed from
    assert (trained_vpp / "vpp-resumed" / "checkpoints" / "iter_0000001" / "COMPLETE").is_file()
    straight, resumed = torch.load(trained_vpp / "vpp-spo.pt"), torch.load(trained_vpp / "vpp-resumed.pt")
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=1e-7, msg=k)


def _packing(algo, budget, trajs, pack=False, **parallel):
    """Padded rows: each micro-batch's [rows, width]; packed: (rows, tokens)."""
    cfg = _vpp_cfg(Path("/nonexistent"), "/nonexistent", "x", algo, budget)
    cfg = TrainConfig.model_validate(dict(cfg, parallel=dict(cfg["parallel"], **parallel),
                                          batch=dict(cfg["batch"], pack_sequences=pack)))
    mbs = micro_batches(trajs, cfg, keep_groups=algo == "agro", pad_id=0, dp_rank=0)
    if pack:
        return [(mb.num_sequences, int(mb.lengths.sum())) for mb in mbs]
    return [tuple(mb.input_ids.shape) for mb in mbs]


@pytest.mark.megatron
def test_virtual_pipeline_packing():
    trajs = DeterministicSource().take(8)  # the first step of every run above: longest input 11 tokens
    assert _packing("spo", 48, trajs) == [(4, 11), (4, 11)]
    assert _packing("spo", 36, trajs) == [(3, 11), (3, 11), (2, 11)]
    assert _packing("spo", 100, trajs) == [(4, 11), (4, 11)]
    assert _packing("agro", 128, trajs) == [(4, 11), (4, 11)]
    # sequence parallelism (GPU only) splits the sequence over TP ranks: widths round up to a multiple of TP
    assert _packing("spo", 48, trajs, tensor_model_parallel_size=4, sequence_parallel=True) == [(4, 12), (4, 12)]
    no_vpp = dict(virtual_pipeline_model_parallel_size=None)
    assert _packing("spo", 36, trajs, **no_vpp) == [(3, 11), (4, 9), (1, 11)]
    assert _packing("spo", 36, trajs, **no_vpp, tensor_model_parallel_size=4, sequence_parallel=True) == [
        (3, 12), (4, 12), (1, 12)]
    # packed (the default): the budget counts the tokens themselves, so fuller micro-batches; lengths 11 9 11 10 ...
    lengths = [len(t.prompt_tokens) + len(t.response_tokens) - 1 for t in trajs]
    assert _packing("spo", 48, trajs, pack=True) == [(5, sum(lengths[:5])), (3, sum(lengths[5:]))]
    assert all(n <= 36 for _, n in _packing("spo", 36, trajs, pack=True, **no_vpp))
    assert sum(r for r, _ in _packing("spo", 36, trajs, pack=True, **no_vpp)) == 8
    with pytest.raises(ConfigError, match=r"^batch: the interleaved pipeline schedule \(parallel.virtual_pipeline_"
                       r"model_parallel_size\) needs at least 2 micro-batches per step, but data-parallel rank 0 "
                       r"has only 1 sequences; raise batch.sequences_per_step$"):
        _packing("spo", 48, [Traj("p0", [1, 2], [3, 4], reward=0.0)])


@pytest.mark.megatron
def test_interleaved_schedule_helpers():
    # megatron accepts N contiguous micro-batches per virtual stage when PP <= N <= M and M % N is 0 or >= PP
    assert [microbatch_group_size(m, 2) for m in (2, 3, 4, 5, 6, 7)] == [2, 3, 2, 3, 2, 4]
    assert [microbatch_group_size(m, 4) for m in (4, 5, 7, 8, 9)] == [4, 5, 7, 4, 5]
    with pytest.raises(ValueError, match="1 micro-batches, fewer than PP=2"):
        microbatch_group_size(1, 2)
    assert split_to_count([[0, 1, 2, 3, 4]], 2, None) == [[0, 1], [2, 3, 4]]
    assert split_to_count([[0], [1, 2, 3]], 3, None) == [[0], [1], [2, 3]]
    groups = ["a", "a", "b", "b", "b"]
    assert split_to_count([[0, 1, 2, 3, 4]], 2, groups) == [[0, 1], [2, 3, 4]]
    assert split_to_count([[0, 1, 2, 3, 4]], 3, groups) == [[0, 1], [2, 3, 4]]  # groups stay whole


@pytest.mark.megatron
def test_virtual_pipeline_checkpoint_converts_to_the_final_policy(trained_vpp, tmp_path):
    """`megatron-spo convert megatron-to-hf` reads a PP=2 x VPP=2 PPO checkpoint (policy + value model +
    optimizer state) bit for bit (in a subprocess: megatron's CPU shims stay out of the pytest process)."""
    step_dir = trained_vpp / "vpp-ppo" / "checkpoints" / "iter_0000002"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "convert", "megatron-to-hf", "--megatron",
                           str(step_dir), "--out", str(tmp_path / "hf")], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    converted = {}
    for f in sorted(glob.glob(str(tmp_path / "hf" / "*.safetensors"))):
        converted.update(load_file(f))
    final = torch.load(trained_vpp / "vpp-ppo.pt")
    assert converted.keys() == final.keys()
    assert all(torch.equal(converted[k], final[k]) for k in final)


@pytest.mark.parametrize("failures", [2, 5])
def test_a_push_that_reached_no_engine_is_sent_again_then_stops_the_run(hf, tmp_path, failures):
    """Every engine missed the push (all paused, none serving): both ranks gather and send it again at once,
    up to rollout.weight_sync_attempts (3), then stop together with the reason instead of starving."""
    from megatron_spo.models.parallel import spawn_local

    out = tmp_path / "result.json"
    spawn_local(train_with_failing_pushes, 2, trainer_config(tmp_path, hf, "run", tp=2, steps=2), failures, str(out))
    result = json.loads(out.read_text())
    n_tensors = result["pushes"][0][1]
    if failures == 2:
        assert result["error"] is None and result["step"] == 2
        assert result["pushes"] == [[1, n_tensors]] * 3 + [[2, n_tensors]]  # step 1's push took 3 attempts
    else:
        assert result["pushes"] == [[1, n_tensors]] * 3 and result["step"] == 1
        assert result["error"] == ("weight sync to version 1 reached no engine in 3 attempts "
                                   "(rollout.weight_sync_attempts): weight sync to version 1 reached no engine: "
                                   "{'http://e0': 'OOM'}")


def test_train_deterministic_turns_on_torchs_deterministic_algorithms_for_the_run_only(hf, tmp_path):
    """train.deterministic: every step runs under torch's deterministic algorithms with cuBLAS's fixed workspace
    (what made an H100 rerun of PPO bitwise, docs/gpu), and close() gives the process its flag back."""
    from trainer_helpers import train_recording_determinism

    from megatron_spo.models.parallel import spawn_local

    out = tmp_path / "seen.json"
    spawn_local(train_recording_determinism, 1, trainer_config(tmp_path, hf, "det", steps=2, deterministic=True), str(out))
    seen = json.loads(out.read_text())
    assert seen == {"during": [[True, ":4096:8"]] * 2, "after": False}
    with pytest.raises(ConfigError, match="^deterministic: Input should be a valid boolean"):
        build_config(TrainConfig, trainer_config(tmp_path, hf, "bad", deterministic="sometimes"))
