"""Data from other frameworks end to end (issue 64): a verl parquet, a slime JSONL and a TRL save_to_disk folder of
chat prompts each train one GRPO step through the trainer (the real online source over a local engine, prompts through
the tokenizer's chat template, each row's reward by data_source or the task's) and evaluate with `megatron-spo eval
CONFIG` on the same rows."""

import json
import os

import pytest
import yaml
from test_frameworks import CHATML, trl_rows, verl_rows, write_jsonl, write_parquet
from trainer_helpers import train_configs

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_verl_slime_and_trl_chat_prompts_each_train_a_step_and_evaluate(tmp_path, monkeypatch):
    import datasets
    import rollout_helpers as rh
    from test_extensions import _cfg
    from test_held_out_eval import REPO

    from megatron_spo.data.config import TaskConfig
    from megatron_spo.data.problems import problems_from_task_config
    from megatron_spo.engine_tools import eval as eval_tool
    from megatron_spo.engine_tools.eval import completions_path
    from megatron_spo.models.parallel import spawn_local
    from megatron_spo.rewards.reward import RewardPool

    judge = RewardPool()  # math rows: the answer judge, no sandbox

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    model = rh.make_tiny_llama(str(tmp_path / "model"))
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    math_rows = [r for r in verl_rows() if r["ability"] == "math"]  # the code rows would need the sandbox
    slime = [{"question": "Ann has 3 pens and buys 15 more. How many pens?", "answer": "#### 18"},
             {"question": [{"role": "user", "content": "2^10?"}], "answer": "1024"}]
    trl = tmp_path / "trl"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(trl_rows())}).save_to_disk(str(trl))
    tasks = {
        "verl": {"kind": "verl", "paths": [write_parquet(math_rows, tmp_path / "verl.parquet")]},
        "slime": {"kind": "slime", "paths": [write_jsonl(slime, tmp_path / "slime.jsonl")], "input_key": "question",
                  "label_key": "answer"},
        "trl": {"kind": "trl", "paths": [str(trl)]},
    }
    with rh.serving_engine(model) as url:
        runs = []
        for name, task in tasks.items():
            cfg = _cfg(tmp_path, model, name, steps=1, algo="grpo",
                       batch={"sequences_per_step": 4, "max_tokens_per_micro_batch": 1024, "max_seq_length": 256},
                       task={**task, "max_prompt_tokens": 200}, fleet={"engine_urls": [url]},
                       eval={"paths": task["paths"]},
                       rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "temperature_range": [1.0, 1.0],
                                "top_p": 1.0})
            runs.append(cfg)
            (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        spawn_local(train_configs, 1, runs)
        for name in tasks:
            [step] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            assert step["step"] == 1 and step["samples/online"] == 4.0, (name, step)
            assert step["reward"] in (-1.0, -0.75, -0.5, -0.25, 0.0)  # this model's answers, scored by the row's reward
            out = tmp_path / f"{name}-eval.jsonl"
            assert eval_tool.main([str(tmp_path / f"{name}.yaml"), "--engine-url", url, "-n", "2", "--ks", "1",
                                   "--max-new-tokens", "8", "--out", str(out), "--json", str(out) + ".json",
                                   "--no-progress"]) == 0
            summary = json.loads((tmp_path / f"{name}-eval.jsonl.json").read_text())
            problems = {p.id: p for p in problems_from_task_config(TaskConfig(**tasks[name]))}
            samples = [json.loads(x) for x in completions_path(out).read_text().splitlines()]
            # every row of the dataset evaluated twice, each sample scored by the row's own reward
            assert sorted((s["prompt_id"], s["sample"]) for s in samples) == sorted(
                (pid, i) for pid in problems for i in range(2)), name
            for s in samples:
                assert s["reward"] == judge(problems[s["prompt_id"]], s["text"]).reward, (name, s)
            passed = sum(s["passed"] for s in samples) / len(samples)
            assert summary["num_problems"] == len(problems) == 2, name
            assert summary["mean"]["pass@1"] == pytest.approx(passed), (name, summary)
