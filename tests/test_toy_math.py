"""The second generated task (data/toy_math.py): arithmetic word problems, the teacher's dropped-step slip, the
math reward on it, and the task switch of the reference builder and the quickstart."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from megatron_spo.data import toy_math
from megatron_spo.data.char_tokenizer import ALPHABET
from megatron_spo.rewards.math_answer import last_boxed, math_reward

EXACT = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: Fraction(a, b)}


@pytest.fixture(scope="module")
def task():
    return toy_math.make_task()


def every_problem(task):
    return task.problems + task.sft_only


def test_the_generator_is_deterministic_and_split_by_seed(task):
    again = toy_math.make_task()
    assert again.problems == task.problems and again.heldout == task.heldout and again.sft_only == task.sft_only
    assert toy_math.make_task(seed=1).problems != task.problems
    assert (len(task.problems), len(task.train), len(task.heldout), len(task.sft_only)) == (240, 120, 120, 900)
    assert {p.id for p in task.train}.isdisjoint(p.id for p in task.heldout)
    # SFT never sees a held-out problem's numbers, under any story
    held = {(p.template, p.numbers) for p in task.heldout}
    assert held.isdisjoint((p.template, p.numbers) for p in task.sft_problems)
    assert {p.template for p in task.heldout} == set(toy_math.TEMPLATE_BY_NAME)  # every story in both splits
    assert {p.template for p in task.train} == set(toy_math.TEMPLATE_BY_NAME)


def test_answers_are_the_arithmetic_of_the_prompt(task):
    for p in every_problem(task):
        numbers = [int(n) for n in re.findall(r"\d+", p.prompt)]
        assert tuple(numbers) == p.numbers, p.prompt  # the story tells the numbers in the order they are used
        value = Fraction(numbers[0])
        for op, n in zip(toy_math.TEMPLATE_BY_NAME[p.template].ops, numbers[1:]):
            value = EXACT[op](value, n)  # exact arithmetic, independent of the generator's integer chain
        assert value.denominator == 1 and str(value.numerator) == p.answer, p.prompt


def test_every_solution_is_correct_distinct_and_short(task):
    for p in every_problem(task):
        assert len(set(p.solutions)) == len(p.solutions) >= 2
        for text in p.solutions:
            assert last_boxed(text) == p.answer
            for left, op, right, result in re.findall(r"(\d+)([-+*/])(\d+)=(\d+)", text):
                assert EXACT[op](int(left), int(right)) == int(result), text
            assert len(text) + 1 <= 96  # the quickstart's max_new_tokens, EOS included, one token a character
        assert len(p.prompt) <= 120 and set(p.prompt + "".join(p.solutions)) <= set(ALPHABET)


def test_the_slip_drops_the_last_step_and_is_wrong_on_every_problem(task):
    for p in every_problem(task):
        for text in p.solutions:
            slipped = toy_math.with_slip(p, text)
            assert last_boxed(slipped) == str(p.values[-2]) != p.answer
            steps_before = text.rsplit("\\boxed", 1)[0]
            assert steps_before.startswith(slipped.rsplit("\\boxed", 1)[0])  # the same steps, one fewer
            assert slipped.count("=") == text.count("=") - 1
            assert math_reward(slipped, p.answer)[0] == -1.0 and math_reward(text, p.answer)[0] == 0.0
    with pytest.raises(ValueError, match="not a solution of problem"):
        toy_math.with_slip(task.train[0], "print(1)\n")


def test_the_math_reward_scores_exact_answers_0_and_others_minus_1(task):
    from megatron_spo.rewards.reward import RewardPool

    p = task.train[0]
    a = int(p.answer)
    pool = RewardPool()  # math problems need no sandbox
    try:
        for text, expected in [(f"\\boxed{{{a}}}\n", 0.0), (f"x=1\n\\boxed{{{a}.0}}\n", 0.0),
                               (f"\\boxed{{{a + 1}}}\n", -1.0), (f"\\boxed{{{a - 1}}}\n", -1.0),
                               (f"{a}\n", -1.0), (f"\\boxed{{{a}\n", -1.0)]:
            result = pool(p, text)
            assert (result.reward, result.passed) == (expected, expected == 0.0), text
        assert pool.judge.started == 0  # plain numbers never start a math-verify worker
        assert pool(p, "\\boxed{}\n").info["reason"] == "no_answer"  # an empty box: no answer
    finally:
        pool.close()


def test_the_registry_loads_the_task_and_its_prompts_are_raw(task):
    from megatron_spo.data.config import TaskConfig
    from megatron_spo.data.problems import load_problems, problems_from_task_config
    from megatron_spo.data.prompts import prompt_text
    from megatron_spo.data.tasks import GENERATED_TASKS, TASK_KINDS
    from megatron_spo.rewards.reward import needs_sandbox

    assert GENERATED_TASKS["toy_math"] in TASK_KINDS and not TASK_KINDS["toy_math"].needs_files
    assert load_problems("toy_math", split="heldout") == list(task.heldout)
    assert problems_from_task_config(TaskConfig(kind="toy_math", limit=5)) == list(task.train[:5])
    assert prompt_text(task.train[0]) == task.train[0].prompt
    assert not needs_sandbox(task.train)
    with pytest.raises(ValueError, match="task.toy.kind 'toy_math' is not task.kind 'toy'"):
        TaskConfig(kind="toy", toy={"kind": "toy_math"})


# ---------------------------------------------------------------------------------------------
# The reference builder and the quickstart take the task
# ---------------------------------------------------------------------------------------------
def tiny_math_config(**overrides):
    from megatron_spo.experiments.config import QuickstartModelConfig

    settings = dict(task={"kind": "toy_math", "num_problems": 16, "max_solutions": 4, "num_sft_problems": 24},
                    hidden_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=64, max_position_embeddings=256, sft_steps=3, batch_size=4, warmup_steps=1,
                    num_threads=1)
    settings.update(overrides)
    return QuickstartModelConfig(**settings)


def test_the_sft_sampler_slips_the_configured_fraction_of_math_targets():
    from megatron_spo.experiments import reference_model as rm

    task = rm.task_from_config(tiny_math_config(task="toy_math"))
    assert isinstance(task, toy_math.ToyMathTask) and len(task.heldout) == 120
    sampler = rm.SFTSampler(task, swap_fraction=0.3, seed=0, slip_fraction=0.5)  # no neighbours: no swaps
    by_prompt = {p.prompt: p for p in task.sft_problems}
    slipped = 0
    for _ in range(4000):
        prompt, target = sampler.draw()
        problem = by_prompt[prompt]
        if target not in problem.solutions:
            assert last_boxed(target) == str(problem.values[-2])
            slipped += 1
    assert slipped == sampler.num_slipped and sampler.num_swapped == 0
    assert abs(slipped / 4000 - 0.5) < 0.03


def test_a_tiny_math_reference_builds_through_the_real_path_under_its_own_key(tmp_path, monkeypatch):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from megatron_spo.config import build_config
    from megatron_spo.experiments import reference_model as rm
    from megatron_spo.experiments.config import QuickstartModelConfig

    cfg = tiny_math_config()
    code = cfg.model_copy(update={"task": cfg.task.model_copy(update={"kind": "toy_code"})})
    assert rm.cache_key(cfg) != rm.cache_key(code)
    # `megatron-spo reference task=toy_math`: a bare name is the kind
    assert build_config(QuickstartModelConfig, {"task": "toy_math"}).task.kind == "toy_math"
    path = rm.build_reference(cfg, cache_dir=tmp_path, progress=False)
    info = rm.read_build_info(path)
    assert path.name == f"quickstart-ref-{rm.cache_key(cfg)}" and info["settings"]["task"]["kind"] == "toy_math"
    assert (info["steps"], info["num_train_problems"], info["num_heldout_problems"]) == (3, 8, 8)
    assert 0 < info["slipped_fraction"] < 1
    model, tok = LlamaForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    prompt = rm.task_from_config(cfg).heldout[0].prompt
    logits = model(**tok(prompt, return_tensors="pt")).logits[0, -1]
    assert torch.isfinite(logits).all() and logits.std() > 0

    # `--eval N`: transformers' sampling gives n texts per prompt; each is scored by the math reward
    from megatron_spo.experiments import reference_eval

    heldout = rm.task_from_config(cfg).heldout[:3]
    texts = reference_eval.sample_completions(model, tok, [p.prompt for p in heldout], 2, temperature=1.0,
                                              top_p=1.0, max_new_tokens=5, seed=0, batch_problems=2)
    assert [len(t) for t in texts] == [2, 2, 2] and all(len(x) <= 5 for t in texts for x in t)
    # one right and three slipped answers per problem: pass@1 0.25, pass@2 0.5, exactly
    fake = [[p.solutions[0]] + [toy_math.with_slip(p, p.solutions[0])] * 3 for p in heldout]
    monkeypatch.setattr(reference_eval, "sample_completions", lambda *a, **k: fake)
    result = reference_eval.evaluate_reference(path, heldout, n=4, ks=(1, 2))
    assert result.mean == {1: 0.25, 2: 0.5} and [p.correct for p in result.problems] == [1, 1, 1]


def test_the_quickstart_takes_the_task_and_trains_on_it(tmp_path):
    from megatron_spo.config import apply_overrides, build_config
    from megatron_spo.data.problems import problems_from_task_config
    from megatron_spo.experiments.quickstart import QuickstartConfig, train_config

    default = build_config(QuickstartConfig, {}, "quickstart")
    assert (default.reference.task.kind, default.reference.sft_steps) == ("toy_code", 600)
    # the math reference needs twice the SFT steps, unless they are given
    assert build_config(QuickstartConfig, {"task": "toy_math"}).reference.sft_steps == 1200
    given = build_config(QuickstartConfig, apply_overrides({}, ["task=toy_math", "reference.sft_steps=300"]))
    assert given.reference.sft_steps == 300
    cfg = build_config(QuickstartConfig, apply_overrides({}, ["task=toy_math", "reference.task.seed=2"]), "quickstart")
    assert (cfg.reference.task.kind, cfg.reference.task.seed) == ("toy_math", 2)
    assert build_config(QuickstartConfig, apply_overrides({}, ["task.kind=toy_math"])).reference.task.kind == "toy_math"
    endpoints = type("E", (), {"router_url": "http://127.0.0.1:1", "engine_urls": ["http://127.0.0.1:2"]})()
    tcfg = train_config(cfg, tmp_path, tmp_path / "ref", tmp_path / "init", endpoints, tmp_path / "q0.jsonl", None)
    assert tcfg.task.kind == "toy_math"
    train = problems_from_task_config(tcfg.task)
    assert train == list(toy_math.make_task(seed=2).train)
    with pytest.raises(ValueError, match="unknown generated task 'toy_text'"):
        build_config(QuickstartConfig, {"task": "toy_text"})


def test_the_study_passes_the_task_to_every_run(tmp_path):
    from megatron_spo.config import apply_overrides, build_config
    from megatron_spo.experiments.quickstart import QuickstartConfig
    from megatron_spo.experiments.study import RunSpec, StudyConfig, quickstart_overrides

    study = build_config(StudyConfig, apply_overrides({}, ["quickstart.task=toy_math", "arms=[spo,grpo]"]))
    for spec in (RunSpec("sweep", "grpo", 0, (("train.lr", 1e-4),)), RunSpec("runs", "spo", 1, ())):
        args = quickstart_overrides(study, spec, tmp_path)
        assert build_config(QuickstartConfig, apply_overrides({}, args)).reference.task.kind == "toy_math"
