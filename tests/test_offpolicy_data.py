"""Issue 48's data sources and baseline stages: expert solutions (data/expert.py) and their import, another
policy's / exploration samples into a store (engine_tools/sample_store.py), the SFT stage (experiments/
sft_stage.py), and the study arms that use the study's data (experiments/study.py)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import sys
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_spo.data import toy_code, toy_math
from megatron_spo.data.expert import expert_solution
from megatron_spo.rewards.math_answer import last_boxed
from megatron_spo.rewards.reward import RewardResult


def run_program(program: str, stdin: str) -> str:
    """The printed output of a (trusted, generated) program fed ``stdin``."""
    out = io.StringIO()
    old = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(program, "<expert>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdin = old
    return out.getvalue()


def passes(problem, text: str) -> bool:
    if getattr(problem, "kind", "code") == "math":
        return last_boxed(text) == problem.answer
    return all(run_program(text, i) == o for i, o in problem.tests + problem.hidden_tests)


class StubRewards:
    """A RewardPool's interface (submit -> Future, async score) with the tasks' own verdicts, in process."""

    sandbox = None

    def _result(self, problem, text: str) -> RewardResult:
        ok = passes(problem, text)
        return RewardResult(0.0 if ok else -1.0, ok)

    def submit(self, problem, text: str) -> Future:
        f: Future = Future()
        f.set_result(self._result(problem, text))
        return f

    async def score(self, problem, text: str) -> RewardResult:
        return self._result(problem, text)


@pytest.fixture(scope="module")
def tasks():
    return toy_code.make_task(), toy_math.make_task()


def test_expert_solutions_are_correct_and_in_a_style_pi0_never_saw(tasks):
    code, math = tasks
    p, q = code.train[0], math.train[0]
    assert p.prompt == "# num: div 2, mul 9, div 6\n"
    assert expert_solution(p) == "import sys\n\n\ndef solve():\n    print(int(input())//2*9//6)\n\n\nsolve()\n"
    assert q.prompt == "Cal has 5 boxes of 4 pens and gives away 5. How many pens are left?\n"
    assert expert_solution(q) == "Step 1: 5 * 4 = 20.\nStep 2: 20 - 5 = 15.\nAnswer: \\boxed{15}\n"
    for task in (code, math):  # every training and held-out problem, reward and hidden tests
        assert all(passes(p, expert_solution(p)) for p in task.problems)
    # pi_0's SFT targets (train + SFT-only, any of their solutions) never hold the expert's markers
    assert not any("def " in s or "    " in s or "import" in s for p in code.sft_problems for s in p.solutions)
    assert not any("Step" in s or " = " in s or "Answer" in s for p in math.sft_problems for s in p.solutions)
    with pytest.raises(ValueError, match="not of a generated task"):
        expert_solution(SimpleNamespace(id="x"))


def test_import_expert_writes_scored_records_with_provenance(tmp_path, tasks):
    from megatron_spo.data.char_tokenizer import build_char_tokenizer
    from megatron_spo.data.experience import store_stats
    from megatron_spo.data.importers import expert_candidates, run_import
    from megatron_spo.data.offline_store import iter_records

    tok = build_char_tokenizer()
    problems = list(tasks[1].train[:5])
    summary = run_import(lambda: expert_candidates(problems), tmp_path / "s", tokenizer=tok, rewards=StubRewards(),
                         run_id="expert-math")
    assert (summary.imported, summary.passed) == (5, 5)
    records = list(iter_records(tmp_path / "s"))
    r = records[0]
    assert r.prompt_id == problems[0].id and r.reward == 0.0
    assert tok.decode(r.response_tokens, skip_special_tokens=True) == expert_solution(problems[0])
    assert r.response_tokens[-1] == tok.eos_token_id
    assert (r.provenance.kind, r.provenance.model, r.provenance.origin, r.provenance.run_id) == (
        "human", "expert-generator", "megatron_spo.data.expert", "expert-math")
    stats = store_stats([tmp_path / "s"], by=("kind", "model"))
    assert {k: (g.rows, g.passing) for k, g in stats.items()} == {("human", "expert-generator"): (5, 5)}


def test_sample_to_store_keeps_failures_with_provenance(tmp_path, tasks):
    from megatron_spo.data.char_tokenizer import build_char_tokenizer
    from megatron_spo.data.offline_store import OfflineStoreWriter, iter_records
    from megatron_spo.data.prompts import make_prompts
    from megatron_spo.engine_tools.config import ToolSamplingConfig
    from megatron_spo.engine_tools.sample_store import sample_to_store
    from megatron_spo.rollout.protocol import Completion

    tok = build_char_tokenizer()
    problems = list(tasks[1].train[:2])
    prompts = make_prompts(problems, tok)
    texts = {p.prompt_id: [p.problem.solutions[0], "\\boxed{0}\n", expert_solution(p.problem)] for p in prompts}
    asked = []

    class FakeClient:  # answers each request with the prompt's three texts, as an engine would (n = 3)
        async def generate(self, prompts_, params, return_logprob=False):
            asked.append((params.temperature, params.n))
            pid = next(p.prompt_id for p in prompts if list(p.tokens) == prompts_[0])
            return [[Completion("r", tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], t, "stop",
                                len(prompts_[0]), len(t), None, None) for t in texts[pid]]]

    with OfflineStoreWriter(tmp_path / "s") as w:
        got = asyncio.run(sample_to_store(prompts, FakeClient(), StubRewards(), w, n=3, kind="other-model",
                                          model="ckpt-B", sampling=ToolSamplingConfig(temperature=1.6)))
    assert got == (6, 4) and asked == [(1.6, 3), (1.6, 3)]
    records = list(iter_records(tmp_path / "s"))
    assert [r.reward for r in records] == [0.0, -1.0, 0.0] * 2
    p = records[1].provenance
    assert (p.kind, p.model, p.temperature, p.top_p, p.origin) == ("other-model", "ckpt-B", 1.6, 1.0,
                                                                    "megatron-spo sample")


def _tiny_hf(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from megatron_spo.data.char_tokenizer import build_char_tokenizer
    from megatron_spo.experiments.config import QuickstartModelConfig
    from megatron_spo.experiments.reference_model import reference_hf_config

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    cfg = QuickstartModelConfig(hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                intermediate_size=64)
    model = AutoModelForCausalLM.from_config(reference_hf_config(cfg, tok))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_sft_stage_masks_prompts_and_trains_on_passing_records_only(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_spo.data.trajectory import Trajectory
    from megatron_spo.experiments.sft_stage import (
        SFTStageConfig,
        response_nll,
        sft_batch,
        sft_on_trajectories,
    )

    good = Trajectory(prompt_id="a", prompt_tokens=[1, 10, 11], response_tokens=[20, 21, 2], reward=0.0,
                      source="offline", policy_version=0)
    bad = Trajectory(prompt_id="a", prompt_tokens=[1, 10], response_tokens=[30, 2], reward=-1.0,
                     source="offline", policy_version=0)
    batch = sft_batch([good, bad], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 20, 21, 2], [1, 10, 30, 2, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 20, 21, 2], [-100, -100, 30, 2, -100, -100]]
    ref = _tiny_hf(tmp_path / "ref")
    model = AutoModelForCausalLM.from_pretrained(ref)
    with torch.no_grad():  # the loss is the mean of -log p(response token) over the 5 response tokens
        lp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float(), -1)
        want = -torch.stack([lp[0, 2, 20], lp[0, 3, 21], lp[0, 4, 2], lp[1, 1, 30], lp[1, 2, 2]]).mean()
        assert torch.allclose(response_nll(model, batch), want, atol=1e-6)
    out = sft_on_trajectories(ref, [good, bad], tmp_path / "sft", SFTStageConfig(steps=8, batch_size=2, lr=3e-2,
                                                                               warmup_steps=0, num_threads=1))
    info = json.loads((out / "sft_info.json").read_text())
    assert (info["trajectories"], info["dropped_failing"]) == (1, 1)
    with torch.no_grad():  # step 1 saw the passing record twice: the reference's loss on it
        assert info["first_loss"] == pytest.approx(response_nll(model, sft_batch([good, good], 0)).item(), abs=1e-5)
    assert info["final_loss"] < info["first_loss"] - 2.0  # 4.60 -> 1.78 (mean of the 8 steps) here
    assert (out / "digests.json").is_file() and (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="none of the 1 trajectories passes"):
        sft_on_trajectories(ref, [bad], tmp_path / "sft2", SFTStageConfig(steps=1))


def test_study_data_arms_and_the_quickstart_data_source():
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.experiments.quickstart import QuickstartConfig, train_config
    from megatron_spo.experiments.study import RunSpec, StudyConfig, quickstart_overrides

    with pytest.raises(ConfigError, match=r"data: arms \['sft-grpo'\] learn from the study's data"):
        build_config(StudyConfig, {"arms": ["grpo", "sft-grpo"]}, "compare")
    study = build_config(StudyConfig, {"arms": ["sft-grpo", "grpo", "spo-data", "sft-spo"], "data": ["/d/expert"],
                                       "sft_steps": 40}, "compare")
    over = {a: quickstart_overrides(study, RunSpec("runs", a, 0, ()), Path("/r")) for a in study.arms}
    assert [o for o in over["sft-grpo"] if o.startswith(("offline_data", "sft"))] == [
        'offline_data=["/d/expert"]', "sft.steps=40", "sft.eval_every=25"]
    assert not [o for o in over["grpo"] if o.startswith(("offline_data", "sft"))]
    assert [o for o in over["spo-data"] if o.startswith(("offline_data", "sft"))] == ['offline_data=["/d/expert"]']
    assert [o for o in over["sft-spo"] if o.startswith(("offline_data", "sft"))] == [
        "offline_data_fraction=0", 'offline_data=["/d/expert"]', "sft.steps=40", "sft.eval_every=25"]
    with pytest.raises(ConfigError, match="sft.steps 5: the SFT stage trains on offline_data, which is empty"):
        build_config(QuickstartConfig, {"sft": {"steps": 5}}, "quickstart")
    cfg = build_config(QuickstartConfig, {"offline_data": ["/d/expert"]}, "quickstart")
    w = Path("/w")
    ends = SimpleNamespace(router_url="http://127.0.0.1:1", engine_urls=["http://127.0.0.1:2"] * 2)
    t = train_config(cfg, w, w / "ref", w / "init", ends, w / "q0.jsonl", w / "offline.jsonl",
                     data_path=w / "data.jsonl")
    assert {k: (s.weight, s.path) for k, s in t.sources.items()} == {
        "online": (0.5, None), "offline": (0.25, "/w/offline.jsonl"), "data": (0.25, "/w/data.jsonl")}
    assert t.sources["data"].transform_specs("data") == []
    cfg1 = build_config(QuickstartConfig, {"offline_data": ["/d"], "offline_data_max_coefficient": 1.0}, "quickstart")
    t1 = train_config(cfg1, w, w / "ref", w / "init", ends, w / "q0.jsonl", w / "offline.jsonl",
                      data_path=w / "data.jsonl")
    assert t1.sources["data"].transform_specs("data") == [("coefficient_clip", {"limit": 1.0})]
    cfg2 = build_config(QuickstartConfig, {"offline_data": ["/d"], "train": {"loss": "cross_entropy"},
                                           "offline_data_loss": "squared"}, "quickstart")
    t2 = train_config(cfg2, w, w / "ref", w / "init", ends, w / "q0.jsonl", w / "offline.jsonl",
                      data_path=w / "data.jsonl")
    assert {k: s.loss for k, s in t2.sources.items()} == {"online": "cross_entropy", "offline": "cross_entropy",
                                                           "data": "squared"}
    cfg0 = build_config(QuickstartConfig, {"offline_data": ["/d"], "offline_data_fraction": 0.0}, "quickstart")
    t0 = train_config(cfg0, w, w / "ref", w / "init", ends, w / "q0.jsonl", w / "offline.jsonl",
                      data_path=w / "data.jsonl")
    assert sorted(t0.sources) == ["offline", "online"] and t0.sources["offline"].weight == 0.5


def test_coefficient_clip_bounds_the_cross_entropy_push_of_a_success():
    """A success under the cross-entropy loss has c = dL/dQ_T = -1/beta until Q_T reaches 0; clipped to 1 its
    gradient is exactly beta times the unclipped one and the loss value is unchanged; a squared-loss row already
    inside the limit is untouched."""
    from functools import partial

    from megatron_spo.algorithms.spo import SPOInputs, spo_loss
    from megatron_spo.algorithms.spo_transforms import coefficient_clip
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.training.config import SourceConfig

    beta = 1 / math.log(1e5)
    ref = torch.tensor([[-4.0, -3.0, -5.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)

    def grad(loss, transforms=()):
        logp = ref.clone().requires_grad_(True)
        inputs = SPOInputs(logp, ref, mask, torch.tensor([0.0]), torch.tensor([-0.181]))
        value, metrics = spo_loss(inputs, beta=beta, objective="terminal", loss=loss, transforms=transforms)
        value.backward()
        return value.item(), logp.grad, metrics

    clip = partial(coefficient_clip, limit=1.0)
    v0, g0, _ = grad("cross_entropy")
    v1, g1, m1 = grad("cross_entropy", [clip])
    assert v1 == v0 and m1["coefficient_clipped"] == 1.0
    assert torch.allclose(g0, torch.full_like(g0, -1.0)) and torch.allclose(g1, beta * g0, rtol=1e-12)
    s0, sq0, _ = grad("squared")  # c = 2 (Q0 - 0) = -0.362: inside the limit
    s1, sq1, ms = grad("squared", [clip])
    assert (s1, ms["coefficient_clipped"]) == (s0, 0.0) and torch.equal(sq0, sq1)
    with pytest.raises(ConfigError, match="max_coefficient: needs objective terminal or advantage, not 'reverse_q'"):
        build_config(SourceConfig, {"path": "x", "objective": "reverse_q", "max_coefficient": 1.0}, "cfg")


def test_sft_early_stopping_keeps_the_step_with_the_lowest_validation_nll(tmp_path):
    """Training on one response and validating on another: the validation NLL first falls (shared tokens) then
    rises (the training response is memorised); the saved model is the best evaluated step's, exactly."""
    from transformers import AutoModelForCausalLM

    from megatron_spo.data.trajectory import Trajectory
    from megatron_spo.experiments.sft_stage import (
        SFTStageConfig,
        sft_on_trajectories,
        validation_nll,
    )

    def rec(pid, response, reward=0.0):
        return Trajectory(prompt_id=pid, prompt_tokens=[1, 10, 11], response_tokens=response, reward=reward,
                          source="expert", policy_version=0)

    train = [rec("a", [20, 21, 22, 23, 2])]
    held = [rec("v", [20, 21, 30, 31, 2]), rec("v", [40, 2], reward=-1.0)]  # the failing one is not scored
    ref = _tiny_hf(tmp_path / "ref")
    cfg = SFTStageConfig(steps=24, batch_size=2, lr=3e-2, warmup_steps=0, num_threads=1, eval_every=4)
    out = sft_on_trajectories(ref, train, tmp_path / "sft", cfg, validation=held)
    info = json.loads((out / "sft_info.json").read_text())
    curve = [(c["step"], c["nll"]) for c in info["validation_nll"]]
    assert [s for s, _ in curve] == [0, 4, 8, 12, 16, 20, 24] and info["validation_trajectories"] == 1
    best_step, best_nll = min(curve, key=lambda c: c[1])
    assert info["chosen_step"] == best_step and 0 < best_step < 24  # it fell, then rose: neither end
    assert curve[-1][1] > best_nll + 0.5
    with torch.no_grad():
        saved = validation_nll(AutoModelForCausalLM.from_pretrained(out), held[:1], 0, 2)
        start = validation_nll(AutoModelForCausalLM.from_pretrained(ref), held[:1], 0, 2)
    assert saved == pytest.approx(best_nll, abs=1e-5) and start == pytest.approx(curve[0][1], abs=1e-5)
    with pytest.raises(ValueError, match=r"sft.eval_every 4: early stopping needs passing trajectories of the "
                                         r"validation problems \(1 given, none passing\)"):
        sft_on_trajectories(ref, train, tmp_path / "sft2", cfg, validation=held[1:])


def test_sft_cached_trains_once_per_reference_data_and_settings(tmp_path):
    """A study's sft-grpo and sft-spo of a seed share one SFT: the second call reuses the first's folder (the same
    bytes as training anew), another record, setting or reference trains apart, a stopped stage's .partial folder
    is not taken for done, and a corrupted cached file is an error naming it."""
    from megatron_spo.checkpoint_digest import CheckpointDigestError
    from megatron_spo.data.trajectory import Trajectory
    from megatron_spo.experiments.sft_stage import SFTStageConfig, sft_cached, sft_on_trajectories

    def rec(response, reward=0.0):
        return Trajectory(prompt_id="a", prompt_tokens=[1, 10, 11], response_tokens=response, reward=reward,
                          source="expert", policy_version=0)

    ref = _tiny_hf(tmp_path / "ref")
    data = [rec([20, 21, 2]), rec([22, 2]), rec([30, 2], reward=-1.0)]
    cfg = SFTStageConfig(steps=3, batch_size=2, lr=3e-2, warmup_steps=0, num_threads=1)
    cache = tmp_path / "shared"
    (cache / "sft-0000000000000000.partial").mkdir(parents=True)  # an unrelated stopped stage stays where it is
    first, reused = sft_cached(ref, data, cache, cfg, "ab" * 32)
    assert not reused and first.parent == cache and first.name.startswith("sft-")
    assert not first.with_name(first.name + ".partial").exists()
    again, reused = sft_cached(ref, data, cache, cfg, "ab" * 32)
    assert (again, reused) == (first, True)
    fresh = sft_on_trajectories(ref, data, tmp_path / "fresh", cfg)
    assert (fresh / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()  # deterministic
    others = {sft_cached(ref, d, cache, c, sha)[0] for d, c, sha in [
        (data[:2] + [rec([30, 2], reward=0.0)], cfg, "ab" * 32),  # a record's reward
        (data[::-1], cfg, "ab" * 32),  # the order (the draws index the records)
        (data, cfg.model_copy(update={"lr": 1e-2}), "ab" * 32),  # a setting
        (data, cfg, "cd" * 32)]}  # the reference's weights
    assert len(others) == 4 and first not in others
    with open(first / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointDigestError, match="config.json"):
        sft_cached(ref, data, cache, cfg, "ab" * 32)


def test_offline_data_split_and_the_generation_budget_warning(tmp_path, caplog):
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.data.trajectory import Trajectory, write_jsonl
    from megatron_spo.experiments.quickstart import QuickstartConfig, training_data
    from megatron_spo.experiments.study import RunSpec, StudyConfig, quickstart_overrides
    from megatron_spo.training.sources import long_response_warning

    rows = [Trajectory(prompt_id=pid, prompt_tokens=[1] * 4, response_tokens=[5] * n, reward=0.0, source="expert",
                       policy_version=0) for pid, n in (("t1", 3), ("t2", 10), ("t2", 30), ("v1", 4), ("v1", 40),
                                                        ("h1", 2))]
    write_jsonl(rows, tmp_path / "d.jsonl")
    kept, validation, dropped, too_long = training_data([str(tmp_path / "d.jsonl")], {"t1", "t2"}, 20,
                                                        validation_ids={"v1"})
    assert [len(r.response_tokens) for r in kept] == [3, 10] and [len(r.response_tokens) for r in validation] == [4]
    assert (dropped, too_long) == (1, 1)  # h1 is another problem's; t2's 34 tokens do not fit (v1's 44 not counted)
    assert long_response_warning(kept, 10, "train.max_new_tokens") == ""
    assert long_response_warning(kept, 8, "train.max_new_tokens") == (
        "1 of 2 responses (50%) are longer than train.max_new_tokens 8 (up to 10 tokens): rollouts and evaluations "
        "stop there, so a policy that learns to write like them (SFT, or SPO on them) is cut off; raise "
        "train.max_new_tokens to 10 or more")
    # the trainer's sources say it too (megatron-spo train with such a store: rollout.max_new_tokens)
    import logging

    from megatron_spo.training.sources import GuideSource, OfflineSource

    with caplog.at_level(logging.WARNING, logger="megatron_spo.training.sources"):
        OfflineSource("expert", str(tmp_path / "d.jsonl"), seed=0, max_new_tokens=30)
        GuideSource(str(tmp_path / "d.jsonl"), per_prompt=1, max_new_tokens=40)
        OfflineSource("quiet", str(tmp_path / "d.jsonl"), seed=0)
    assert [r.getMessage() for r in caplog.records] == [
        f"sources.expert ({tmp_path / 'd.jsonl'}): 1 of 6 responses (17%) are longer than rollout.max_new_tokens 30 "
        "(up to 40 tokens): rollouts and evaluations stop there, so a policy that learns to write like them (SFT, or "
        "SPO on them) is cut off; raise rollout.max_new_tokens to 40 or more"]
    with pytest.raises(ConfigError, match="sft.eval_every 5: early stopping reads the validation problems' "
                                          "offline_data, and validation_problems is 0"):
        build_config(QuickstartConfig, {"offline_data": ["/d"], "sft": {"steps": 10, "eval_every": 5}}, "quickstart")
    arms = {"arms": ["sft-grpo", "spo-data"], "data": ["/d"], "sft_eval_every": 5, "sweep": {"enabled": False}}
    with pytest.raises(ConfigError, match="sft_eval_every 5: early stopping reads the validation problems' data, "
                                          "which these runs train on; set validation_held_out=true"):
        build_config(StudyConfig, arms, "compare")
    study = build_config(StudyConfig, {**arms, "validation_held_out": True}, "compare")
    over = quickstart_overrides(study, RunSpec("runs", "sft-grpo", 0, ()), Path("/r"))
    assert {"validation_problems=30", "sft.steps=600", "sft.eval_every=5"} <= set(over)
    assert not [o for o in quickstart_overrides(study, RunSpec("runs", "spo-data", 0, ()), Path("/r"))
                if o.startswith("sft")]


def test_a_source_weight_schedule_anneals_the_data_share_and_bad_schedules_are_refused(tmp_path):
    """sources.NAME.weight_final / weight_steps: the weight goes linearly from `weight` (step 1) to weight_final
    (step weight_steps), then stays; the batch's counts follow it, step by step; the quickstart's
    offline_data_anneal_steps makes its data source such a schedule, refused where there is no data source."""
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.data.trajectory import Trajectory, write_jsonl
    from megatron_spo.experiments.quickstart import QuickstartConfig, train_config
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.sources import build_sampler

    for name in ("own", "data"):
        write_jsonl([Trajectory(prompt_id=f"{name}{i}", prompt_tokens=[1, 2], response_tokens=[3], reward=0.0,
                                source=name, policy_version=0) for i in range(4)], tmp_path / f"{name}.jsonl")
    base = dict(init={"hf": "x"}, algo="agro", sources={
        "own": {"path": str(tmp_path / "own.jsonl")},
        "data": {"path": str(tmp_path / "data.jsonl"), "weight": 1.0, "weight_final": 0.0, "weight_steps": 5}})
    cfg = build_config(TrainConfig, base)
    assert [cfg.sources["data"].weight_at(s) for s in (1, 2, 3, 5, 9)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    sampler, _ = build_sampler(cfg)
    counts = []
    for step in (1, 2, 3, 4, 5, 9):
        batch = sampler.next(8, step)
        counts.append(sum(r.source == "data" for r in batch))
        assert len(batch) == 8
    assert counts == [4, 3, 3, 2, 0, 0]  # 8 x w / (1 + w), largest remainder: w 1, .75, .5, .25, 0, 0
    # a run resumed from step 2's checkpoint draws what an unstopped one draws (cursors in the state, the step given)
    unstopped, _ = build_sampler(cfg)
    drawn = [[r.prompt_id for r in unstopped.next(8, step)] for step in (1, 2, 3, 4)]
    stopped, _ = build_sampler(cfg)
    first = [[r.prompt_id for r in stopped.next(8, step)] for step in (1, 2)]
    resumed, _ = build_sampler(cfg)
    resumed.load_state_dict(json.loads(json.dumps(stopped.state_dict())))
    assert first + [[r.prompt_id for r in resumed.next(8, step)] for step in (3, 4)] == drawn
    from megatron_spo.training.metrics import PANELS, panel_names
    from megatron_spo.training.step_metrics import trajectory_metrics

    logged = trajectory_metrics(sampler.next(8, 3), 0)  # the step's mix is logged, and plotted
    assert (logged["batch_share/data"], logged["batch_share/own"]) == (3 / 8, 5 / 8)
    assert any(panel_names(title, logged) == ["batch_share/data", "batch_share/own"] for title in PANELS)
    assert not any(k.startswith("batch_share/") for k in trajectory_metrics(sampler.next(8, 9), 0))  # one source
    guided = [Trajectory(prompt_id="p", prompt_tokens=[1], response_tokens=[3], reward=0.0, source=source,
                         policy_version=0) for source in ("online", "online", "guide")]
    assert not any(k.startswith("batch_share/") for k in trajectory_metrics(guided, 0))  # GRPO's guide_share says it

    def refused(sources: dict, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            build_config(TrainConfig, {**base, "sources": sources}, "train")

    refused({"own": {"path": "o", "weight_final": 0.5}},
            r"sources.own: .*weight_final 0.5 with weight_steps 0: a schedule needs both")
    refused({"own": {"path": "o", "weight_final": 0.5, "weight_steps": 1}},
            r"sources.own: .*weight_final 0.5 with weight_steps 1: a schedule needs both .* 2 or later")
    refused({"own": {"path": "o", "weight_final": 0.0, "weight_steps": 3}},
            r"sources: the weights at the end of their schedules \{'own': 0.0\} must have a positive sum")

    def quick(**kw):
        return build_config(QuickstartConfig, {"offline_data": [str(tmp_path / "data.jsonl")], **kw}, "quickstart")

    where = tmp_path / "run"
    fleet = SimpleNamespace(router_url="http://127.0.0.1:1", engine_urls=["http://127.0.0.1:2"] * 2)
    made = train_config(quick(offline_data_anneal_steps=30), where, where / "ref", where / "init", fleet,
                        where / "q0.jsonl", where / "offline.jsonl", data_path=where / "data.jsonl")
    data = made.sources["data"]
    assert (data.weight, data.weight_final, data.weight_steps) == (0.25, 0.0, 30)
    assert made.sources["offline"].weight_final is None
    with pytest.raises(ConfigError, match=r"offline_data_anneal_steps 30: this run has no `offline_data` source to "
                                          r"anneal .* not 'grpo'\)"):
        quick(offline_data_anneal_steps=30, algo="grpo")
