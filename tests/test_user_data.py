"""A user's own data: problems JSONL files (globs, lists, extra fields kept as metadata for rewards) in every
tool and in training; Q0 never silently zero (filled from task.q0_path or refused naming the prompt); the push
interval an algorithm needs, set or refused by the config."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from megatron_spo.config import ConfigError  # noqa: E402
from megatron_spo.data.problem import read_problems_jsonl  # noqa: E402
from megatron_spo.data.problems import load_problems, problems_from_task_config  # noqa: E402
from megatron_spo.training.config import TrainConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BETA = 0.5
USER_PROBLEMS = [
    {"id": "add", "prompt": "1+1?", "kind": "math", "answer": "2", "difficulty": 1, "source": "mine"},
    {"id": "mul", "prompt": "2*3?", "kind": "math", "answer": "6", "difficulty": 3, "tags": ["easy"]},
    {"id": "echo", "prompt": "Echo.", "tests": [["a\n", "a\n"]], "metadata": {"difficulty": 2}},
]


def difficulty_reward(problem, completion: str) -> float:
    """A user's reward hook reading the problem's own field: -difficulty / 4 (difficulty from the JSONL)."""
    return -problem.metadata["difficulty"] / 4


def write_user_files(folder: Path) -> list[str]:
    """The user's problems split over two files; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "part-0.jsonl", folder / "part-1.jsonl"]
    paths[0].write_text("".join(json.dumps(p) + "\n" for p in USER_PROBLEMS[:2]))
    paths[1].write_text(json.dumps(USER_PROBLEMS[2]) + "\n")
    return [str(p) for p in paths]


def write_q0(path: Path, counts: dict[str, tuple[int, int]]) -> str:
    """An estimate-q0 output: prompt_id -> (correct, n)."""
    from megatron_spo.data.q0 import q0_from_counts

    rows = []
    for pid, (correct, n) in counts.items():
        est = q0_from_counts(correct, n, BETA)
        rows.append({"prompt_id": pid, "s0": est.s0, "q0": est.q0, "n": n, "correct": correct, "beta": BETA})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_user_jsonl_files_globs_and_extra_fields(tmp_path):
    paths = write_user_files(tmp_path / "mine")
    by_glob = load_problems("jsonl", str(tmp_path / "mine" / "part-*.jsonl"))  # eval --data's glob
    by_list = read_problems_jsonl(paths)
    cfg = TrainConfig.model_validate(dict(init={"hf": "x"}, task={"kind": "jsonl", "paths": paths}))
    by_config = problems_from_task_config(cfg.task)  # the trainer's and estimate-q0's path: a list
    assert [p.id for p in by_glob] == [p.id for p in by_list] == [p.id for p in by_config] == ["add", "mul", "echo"]
    assert [p.metadata for p in by_config] == [{"difficulty": 1}, {"difficulty": 3, "tags": ["easy"]},
                                               {"difficulty": 2}]
    assert [p.source for p in by_config] == ["mine", "jsonl", "jsonl"]
    assert [difficulty_reward(p, "") for p in by_config] == [-0.25, -0.75, -0.5]
    with pytest.raises(FileNotFoundError, match=r"task file\(s\) '.*nope-\*.jsonl' not found"):
        load_problems("jsonl", str(tmp_path / "nope-*.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "prompt": "p", "metadata": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'metadata' must be a JSON object"):
        read_problems_jsonl(tmp_path / "bad.jsonl")


class Rec:
    def __init__(self, prompt_id: str, q0: float | None):
        self.prompt_id, self.q0 = prompt_id, q0


def test_offline_records_without_q0_are_filled_from_the_q0_file_or_refused(tmp_path):
    from megatron_spo.data.q0 import fill_missing_q0, q0_table

    table = q0_table(write_q0(tmp_path / "q0.jsonl", {"a": (1, 4), "b": (0, 4)}), BETA)
    records = [Rec("a", None), Rec("b", -0.3), Rec("b", None)]
    assert fill_missing_q0(records, table, where="sources.offline (x)", q0_path="q0.jsonl") == 2
    assert [r.q0 for r in records] == [table["a"], -0.3, table["b"]]
    # 0 of 4 successes: the lowest values, where 0 (the old default) is the highest; -1 exactly with the plain rate,
    # above it with the default Jeffreys prior (data/q0.py)
    assert table["b"] < table["a"] and table["b"] > -1.0
    assert q0_table(tmp_path / "q0.jsonl", BETA, prior=0)["b"] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match=r"^sources.offline \(x\): 1 of 2 records have no q0 \(first: prompt 'c'\) "
                                         r"and task.q0_path is not set; run `megatron-spo estimate-q0"):
        fill_missing_q0([Rec("a", -0.1), Rec("c", None)], None, where="sources.offline (x)", q0_path=None)
    with pytest.raises(ValueError, match=r"^sources.offline \(x\): 1 prompt\(s\) of records without q0 are not in "
                                         r"task.q0_path q0.jsonl \(first: 'c'\)"):
        fill_missing_q0([Rec("c", None)], table, where="sources.offline (x)", q0_path="q0.jsonl")


def test_offline_source_fills_q0_for_spo_and_refuses_without_a_file(tmp_path):
    from megatron_spo.training.sources import build_sampler

    store = tmp_path / "offline.jsonl"
    rows = [{"prompt_id": pid, "prompt_tokens": [1, 2], "response_tokens": [3, 4], "reward": -1.0,
             "source": "offline", "policy_version": 0, **extra}
            for pid, extra in (("a", {}), ("b", {"q0": -0.25}))]
    store.write_text("".join(json.dumps(r) + "\n" for r in rows))
    q0_path = write_q0(tmp_path / "q0.jsonl", {"a": (3, 4)})
    base = dict(init={"hf": "x"}, sources={"offline": {"path": str(store)}})
    sampler, _ = build_sampler(TrainConfig.model_validate({**base, "beta": BETA, "task": {"q0_path": q0_path}}))
    from megatron_spo.data.q0 import q0_table

    assert [r.q0 for r in sampler.sources["offline"].records] == [q0_table(q0_path, BETA)["a"], -0.25]
    with pytest.raises(ConfigError, match=rf"^sources.offline \({store}\): 1 of 2 records have no q0 \(first: "
                                          r"prompt 'a'\) and task.q0_path is not set"):
        build_sampler(TrainConfig.model_validate(base))
    grpo = TrainConfig.model_validate({**base, "algo": "agro"})  # AGRO's loss reads no Q0: nothing to fill
    assert [r.q0 for r in build_sampler(grpo)[0].sources["offline"].records] == [None, -0.25]


def test_online_prompts_need_their_q0_for_spo(tmp_path):
    from megatron_spo.data.prompts import Prompt
    from megatron_spo.training.online import OnlineSource, online_q0_table

    prompts = [Prompt("add", [1]), Prompt("mul", [2])]
    q0_path = write_q0(tmp_path / "q0.jsonl", {"add": (1, 2)})
    spo = dict(init={"hf": "x"}, beta=BETA)
    with pytest.raises(ConfigError, match=r"^task.q0_path: algo spo needs Q0 for every online prompt and none is "
                                          r"set; run `megatron-spo estimate-q0 CONFIG --out q0.jsonl`"):
        online_q0_table(TrainConfig.model_validate(spo), prompts)
    with pytest.raises(ConfigError, match=r"^task.q0_path: 1 of 2 training prompts have no Q0 in .*q0.jsonl "
                                          r"\(first: 'mul'\)"):
        online_q0_table(TrainConfig.model_validate({**spo, "task": {"q0_path": q0_path}}), prompts)
    assert online_q0_table(TrainConfig.model_validate({**spo, "algo": "agro"}), prompts) is None
    source = OnlineSource.__new__(OnlineSource)  # take()'s Q0 lookup alone: a prompt the table lacks is an error
    source.q0 = {"add": -0.5}

    class Manager:
        class cfg:  # noqa: N801
            samples_per_prompt, wait_timeout_s = 1, 1.0

    class T:
        def __init__(self, pid):
            self.prompt_id, self.q0 = pid, None

    source.manager = Manager()
    source._wait = lambda coro, waiting_for: (coro.close(), [[T("add")], [T("mul")]])[1]
    source.manager.get_groups = lambda n, t: _noop()
    with pytest.raises(RuntimeError, match="online source: prompt 'mul' has no Q0 in the Q0 table"):
        source.take(2)
    assert [t.q0 for t in source.take(1)] == [-0.5]


async def _noop():
    return None


def test_on_policy_algorithms_get_a_push_every_step(caplog):
    at_t1 = {"temperature_range": [1.0, 1.0], "top_p": 1.0}
    base = dict(init={"hf": "x"}, rollout=at_t1)
    with caplog.at_level(logging.WARNING, logger="megatron_spo.algos"):
        cfg = TrainConfig.model_validate({**base, "algo": "ppo"})
    assert cfg.model_update_interval == 1
    assert [r.getMessage() for r in caplog.records] == [
        "model_update_interval: 1 for algo ppo (it needs a weight push every 1 step(s); the default was 10)"]
    assert TrainConfig.model_validate(cfg.model_dump(mode="json")).model_update_interval == 1  # ranks re-validate
    assert TrainConfig.model_validate({**base, "algo": "spo"}).model_update_interval == 10  # any interval
    with pytest.raises(ValueError, match=r"model_update_interval: algo grpo needs a weight push every 1 step\(s\) "
                                         r"\(it samples from the policy it trains\), got 4"):
        TrainConfig.model_validate({**base, "algo": "grpo", "model_update_interval": 4})


@pytest.mark.multiproc
def test_trains_two_steps_on_a_user_jsonl_with_its_metadata_in_the_reward(tmp_path, monkeypatch):
    """A real engine serves the user's three problems (two files); the reward hook reads each problem's
    'difficulty' from its metadata; SPO takes Q0 from the user's q0 file; two steps train."""
    import rollout_helpers as rh
    from test_extensions import _cfg, _train_and_record

    from megatron_spo.models.parallel import spawn_local

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    paths = write_user_files(tmp_path / "mine")
    q0_path = write_q0(tmp_path / "q0.jsonl", {"add": (1, 4), "mul": (0, 4), "echo": (2, 4)})
    model = rh.make_tiny_llama(str(tmp_path / "engine_model"))
    with rh.serving_engine(model) as url:
        cfg = _cfg(tmp_path, model, "user", batch={"sequences_per_step": 4, "max_tokens_per_micro_batch": 1024,
                                                    "max_seq_length": 256},
                   task={"kind": "jsonl", "paths": paths, "reward": "test_user_data:difficulty_reward",
                         "q0_path": q0_path, "max_prompt_tokens": 240},
                   fleet={"engine_urls": [url]},
                   rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "buffer_groups": 4,
                            "max_inflight_requests": 2})
        spawn_local(_train_and_record, 1, cfg, str(tmp_path / "rewards.json"))
    seen = json.loads((tmp_path / "rewards.json").read_text())
    assert seen["sandbox"] is None  # a custom reward runs no programs
    assert len(seen["rewards"]) == 8 and set(seen["rewards"]) <= {-0.25, -0.75, -0.5}
    metrics = [json.loads(x) for x in (tmp_path / "user" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
