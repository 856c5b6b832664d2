"""The train-vs-rollout log-prob gap (training/logprob_gap.py): near 0 with a correct weight push, a warning
naming the step with a broken one.

The "engine" is the HF model itself (transformers, fp32) receiving the trainer's pushes: it samples at
temperature T and reports log softmax(logits / T) of each token, as SGLang does."""

import json
import math
import re
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path

import pytest
import torch
from trainer_helpers import VOCAB, make_tiny_hf

from megatron_spo.data.batching import collate
from megatron_spo.training import logprob_gap as lg

WRONG_TENSOR = "lm_head.weight"  # pushed with its vocabulary rows rolled by one: a broken conversion


@dataclass
class Sample:
    prompt_id: str
    prompt_tokens: list
    response_tokens: list
    reward: float
    behaviour_logprobs: list | None
    temperature: float | None = 1.0
    top_p: float = 1.0
    policy_version: int = 0
    source: str = "online"
    q0: float = -0.5
    mc_targets: list = field(default_factory=list)


class HFEngine:
    """An online source sampling from an HF copy of the policy that takes the trainer's weight pushes;
    groups of 4 per prompt, alternately at T = 1 and T = 0.7 (top-p 1). corrupt: WRONG_TENSOR's rows rolled."""

    def __init__(self, hf: str, corrupt: bool):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        self.corrupt, self.version, self.drawn = corrupt, 0, 0
        self.gen = torch.Generator().manual_seed(0)

    @torch.no_grad()
    def take(self, k: int, timeout_s: float | None = None) -> list:
        out = []
        for _ in range(k):
            group = self.drawn // 4
            t = 1.0 if group % 2 == 0 else 0.7
            ids = torch.randint(1, VOCAB, (1, 4), generator=self.gen)
            logprobs = []
            for _ in range(6):
                logits = self.model(ids).logits[0, -1].double() / t
                token = torch.multinomial(torch.softmax(logits, -1), 1, generator=self.gen)
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                ids = torch.cat([ids, token[None]], dim=1)
            tokens = ids[0].tolist()
            out.append(Sample(f"p{group}", tokens[:4], tokens[4:], reward=-float(tokens[4] % 2),
                              behaviour_logprobs=logprobs, temperature=t, policy_version=self.version))
            self.drawn += 1
        return out

    def push_weights(self, version: int, named_tensors) -> dict:
        state = {name: t.roll(1, 0) if self.corrupt and name == WRONG_TENSOR else t.clone()
                 for name, t in named_tensors}
        missing, _ = self.model.load_state_dict(state, strict=False)
        assert not [m for m in missing if "rotary" not in m], missing
        self.version = version
        return {"weight_sync/engines_updated": 1.0}


def train_against_engines(runs: list[tuple[dict, bool, str]]) -> None:
    """One rank: for each (config, corrupt, out_file) train against an HFEngine; write the metrics and what
    the run printed."""
    from megatron_spo.training.trainer import TrainConfig, Trainer  # TrainConfig: where the trainer takes it

    for i, (cfg_data, corrupt, out_file) in enumerate(runs):
        printed = StringIO()
        with redirect_stdout(printed):  # not a terminal: progress lines, as under SLURM
            trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=HFEngine(cfg_data["init"]["hf"], corrupt))
            try:
                trainer.train()
            finally:
                trainer.close(keep_process_group=i < len(runs) - 1)
        metrics = [json.loads(line) for line in open(f"{cfg_data['run_dir']}/metrics.jsonl")]
        with open(out_file, "w") as f:
            json.dump({"metrics": metrics, "printed": printed.getvalue(), "run_dir": cfg_data["run_dir"]}, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_spo.models.parallel import spawn_local

    root = tmp_path_factory.mktemp("gap")
    hf = make_tiny_hf(str(root / "hf"))
    cfg = dict(steps=3, algo="spo", beta=0.5, init={"hf": hf}, optimizer={"lr": 1e-2, "warmup_steps": 1},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               model_update_interval=1, checkpoint={"interval": 100}, logging={"progress": True})
    todo = [(dict(cfg, run_dir=str(root / name)), name == "wrong", str(root / f"{name}.json"))
            for name in ("right", "wrong")]
    spawn_local(train_against_engines, 1, todo)
    return {name: json.loads((root / f"{name}.json").read_text()) for name in ("right", "wrong")}


@pytest.mark.multiproc
def test_a_correct_push_keeps_the_gap_at_fp32_noise(runs):
    metrics = runs["right"]["metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:  # every step's samples come from the weights pushed after the step before
        assert m["logprob_gap/current"] == 1.0 and m["logprob_gap/sequences"] == 8.0
        assert m["logprob_gap/mean_abs"] < 1e-5 and m["logprob_gap/max_abs"] < 1e-4
        assert abs(m["logprob_gap/mismatch_kl"]) < 1e-8
    assert metrics[-1]["grad_norm"] > 0  # the policy moved: the pushes carried new weights each step
    assert "log-prob gap" not in runs["right"]["printed"]


@pytest.mark.multiproc
def test_what_a_run_prints_off_a_terminal(runs, tmp_path_factory):
    """The start banner, one progress line per step with elapsed time, s/step and ETA, and megatron-core's
    warnings counted in one line instead of printed (RUN_DIR/warnings.log keeps them)."""
    lines = runs["right"]["printed"].splitlines()
    assert lines[0].startswith("[megatron-spo] train: algo spo, 3 steps (from step 0), run dir /")
    assert lines[1].startswith("[megatron-spo] model: llama, 2 layers, hidden 32, ") and "parameters, float32" in lines[1]
    assert lines[2] == "[megatron-spo] layout: 1 rank(s) = TP 1 x PP 1 x DP 1, sequence parallel off, distributed optimizer off"
    assert re.match(r"\[megatron-spo\] versions: megatron-core \d[\w.]*, torch \d", lines[3])
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all(re.search(r"logprob_gap [\d.e-]+ \| elapsed \d+:\d\d, \d+\.\d\d s/step, ETA \d+:\d\d$", line)
               for line in steps), steps
    assert steps[-1].endswith("ETA 0:00")
    summary = [line for line in lines if "library warning" in line]  # after the model build, and at the end
    run_dir = runs["right"]["run_dir"]
    logged = (Path(run_dir) / "warnings.log").read_text().count("Warning: ") if summary else 0
    assert sum(int(re.match(r"\[megatron-spo\] (\d+) ", line).group(1)) for line in summary) == logged
    assert all(line.endswith(f"suppressed, see {run_dir}/warnings.log") for line in summary)


@pytest.mark.multiproc
def test_a_wrong_push_makes_the_gap_warn_naming_the_step(runs):
    metrics = runs["wrong"]["metrics"]
    assert metrics[0]["logprob_gap/mean_abs"] < 1e-5  # step 1: the engine still holds the initial weights
    for m in metrics[1:]:
        assert m["logprob_gap/mean_abs"] > 0.1 and m["logprob_gap/mismatch_kl"] > 1e-2
    lines = [line for line in runs["wrong"]["printed"].splitlines() if "log-prob gap" in line]
    assert [line.split(":")[0] for line in lines] == ["[megatron-spo] step 2", "[megatron-spo] step 3"]
    assert "exceeds logging.max_logprob_gap 0.1" in lines[0]


def _batch(versions, temperatures, top_ps, sources=None):
    trajs = [Sample(f"p{i}", [1, 2], [3, 4, 5], 0.0, [-1.0, -2.0, -3.0], temperature=t, top_p=p, policy_version=v,
                    source=(sources or ["online"] * len(versions))[i])
             for i, (v, t, p) in enumerate(zip(versions, temperatures, top_ps))]
    return collate(trajs, pad_id=0)


def test_rows_measured_are_online_with_known_sampling_and_current_by_version():
    batch = _batch([3, 2, 3, 3], [1.0, 0.7, None, 0.0], [1.0, 0.95, 1.0, 1.0], ["online", "online", "online", "offline"])
    rows, current, kl = lg.measured_rows(batch, 3)
    assert rows.tolist() == [True, True, False, False]  # unknown temperature; not online
    assert current.tolist() == [True, False, False, False]
    assert kl.tolist() == [True, False, False, False]  # top-p 0.95 samples are not of the engine's distribution
    assert lg.measured_rows(batch, None)[1].tolist() == [False] * 4  # the trainer moved since the push
    assert batch.behaviour_temperature[3] == 1.0  # greedy rows report raw log-probs (T = 1)


def test_tally_and_metrics_exact():
    batch = _batch([0, 0], [1.0, 1.0], [1.0, 1.0])
    trainer = batch.behaviour_logp.clone()
    trainer[0, 1:4] += torch.tensor([0.5, -0.25, 0.0])  # row 0's response tokens sit at positions 1..3
    rows = torch.tensor([True, True])
    t = lg.tally(trainer, batch.behaviour_logp, batch.loss_mask, rows, rows)
    assert (t.tokens, t.sequences) == (6, 2) and t.abs_sum == pytest.approx(0.75) and t.max_abs == 0.5
    k3 = (math.exp(0.5) - 1 - 0.5) + (math.exp(-0.25) - 1 + 0.25)
    m = lg.gap_metrics(lg.GapTally(), t)  # no current sample: all of them, marked not current
    assert m == pytest.approx({"logprob_gap/mean_abs": 0.125, "logprob_gap/max_abs": 0.5, "logprob_gap/sequences": 2.0,
                               "logprob_gap/current": 0.0, "logprob_gap/mismatch_kl": k3 / 6})
    assert lg.gap_warning(7, m, 0.1) is None  # stale samples differ legitimately
    m = lg.gap_metrics(t, t)
    assert lg.gap_warning(7, m, 0.2) is None and lg.gap_warning(7, m, None) is None
    assert lg.gap_warning(7, m, 0.1).startswith("[megatron-spo] step 7: engine vs trainer log-prob gap 0.125 per token")
    assert lg.gap_metrics(lg.GapTally(), lg.GapTally()) == {} and lg.GapPass(None).current == lg.GapTally()
