"""What a run checks before its first sample (issue 64): fp32 as one override (model.params_dtype merged into the init
model's config), the engines' dtype against the trainer's in one line, engines holding other weights than the
trainer's (a fleet left from an earlier run: the trainer pushes its own first), and the task's instruction."""

from types import SimpleNamespace

import pytest
from rollout_helpers import ServerThread
from trainer_helpers import make_tiny_hf

from megatron_spo.config import ConfigError, build_config
from megatron_spo.training.config import TrainConfig
from megatron_spo.training.online import OnlineSource, dtype_line, engine_dtype


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny"))


def test_a_partial_model_section_overrides_the_init_models_config(hf):
    cfg = build_config(TrainConfig, {"init": {"hf": hf}, "model": {"params_dtype": "bfloat16"}})
    assert cfg.model.params_dtype == "bfloat16" and cfg.model.num_layers == 2 and cfg.model.vocab_size == 61
    with pytest.raises(ConfigError) as err:
        build_config(TrainConfig, {"init": {"megatron": None}, "model": {"params_dtype": "float32"}})
    assert str(err.value).startswith("model: a partial section (params_dtype) overrides the init model's config, "
                                     "and init names none; give init.hf") and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^model: a partial section overrides init.hf's model config, which cannot "
                                          r"be read: .*config.json not found$"):
        build_config(TrainConfig, {"init": {"hf": hf + "-missing"}, "model": {"params_dtype": "float32"}})


def test_the_dtype_line_says_when_engines_and_trainer_differ(hf):
    assert dtype_line({}, "float32") is None
    assert dtype_line({"u": "float32"}, "float32") == ("dtype: the engines serve float32, as the trainer trains "
                                                       "(model.params_dtype)")
    line = dtype_line({"u": "float32", "v": "float32"}, "bfloat16")
    assert line.startswith("dtype: the engines serve float32, the trainer trains bfloat16 (model.params_dtype)")
    assert line.endswith("start the engines with --dtype bfloat16, or set model.params_dtype=float32")
    assert engine_dtype("torch.bfloat16", None) == "bfloat16"
    assert engine_dtype("auto", hf) == "float16"  # SGLang's auto serves a float32 checkpoint in float16


def _source(url: str, init: dict, lora=None) -> OnlineSource:
    """An OnlineSource's engine check alone (no rollout manager started): the engines at ``url``."""
    source = OnlineSource.__new__(OnlineSource)
    source.broadcaster = SimpleNamespace(engine_urls=[url])
    source.manager = SimpleNamespace(cfg=SimpleNamespace(engine_wait_s=30.0))
    source.init, source.lora = SimpleNamespace(**{"hf": None, "megatron": None, **init}), lora
    return source


def test_engines_holding_other_weights_are_found_before_the_first_sample(hf, tmp_path):
    from megatron_spo.rollout.local_engine import LocalEngine

    engine = LocalEngine(hf)
    with ServerThread(engine) as srv:
        reason, dtypes = _source(srv.url, {"hf": hf}).check_engines("float32")
        assert reason is None and dtypes == "dtype: the engines serve float32, as the trainer trains (model.params_dtype)"
        reason, _ = _source(srv.url, {"hf": hf, "megatron": str(tmp_path / "m")}).check_engines("float32")
        assert reason == f"the trainer starts from init.megatron {tmp_path / 'm'}, the engines from init.hf"
        assert _source(srv.url, {"hf": hf, "megatron": "m"}, lora=object()).check_engines("float32")[0] is None
        other = make_tiny_hf(str(tmp_path / "other"), seed=1)
        reason, _ = _source(srv.url, {"hf": other}).check_engines("float32")
        assert reason == f"{srv.url} serves {engine.model_path}, not init.hf {other}"
        srv.server.scheduler.weight_version = "7"  # an earlier run's last push
        reason, dtypes = _source(srv.url, {"hf": hf}).check_engines("bfloat16")
        assert reason == f"{srv.url} holds weight_version '7' (weights pushed since it loaded)"
        assert dtypes.startswith("dtype: the engines serve float32, the trainer trains bfloat16")


def test_the_task_instruction_replaces_the_math_instruction(tmp_path):
    from megatron_spo.data.problem import Problem
    from megatron_spo.data.problems import problems_from_task_config
    from megatron_spo.data.tasks import MATH_INSTRUCTION, build_prompt

    p = Problem(id="a", prompt="What is 2 + 3?", kind="math", answer="5")
    assert build_prompt(p) == f"Problem:\nWhat is 2 + 3?\n\n{MATH_INSTRUCTION}\n\nSolution:\n"
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "What is 2 + 3?", "kind": "math", "answer": "5"}\n'
                    '{"id": "b", "prompt": "What is 4 + 4?", "kind": "math", "answer": "8", "instruction": "Be brief."}\n')
    task = build_config(TrainConfig, {"init": {"hf": "x"}, "task": {"kind": "jsonl", "paths": [str(path)]}}).task
    a, b = problems_from_task_config(task)
    assert MATH_INSTRUCTION in build_prompt(a) and build_prompt(b) == "Problem:\nWhat is 4 + 4?\n\nBe brief.\n\nSolution:\n"
    for instruction, expected in (("Answer with a number.", "Answer with a number."), ("", None)):
        task = task.model_copy(update={"instruction": instruction})
        for q in problems_from_task_config(task):
            text = build_prompt(q)
            assert MATH_INSTRUCTION not in text and (expected is None or expected in text)
            assert expected is not None or text == f"Problem:\n{q.prompt}\n\nSolution:\n"


def _train_runs(runs: list[tuple[dict, str]]) -> None:
    """One rank: each config trained in turn (the real OnlineSource over its fleet); what it printed and its metrics
    written to out_file."""
    import json
    from contextlib import redirect_stdout
    from io import StringIO

    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, out_file) in enumerate(runs):
        printed = StringIO()
        with redirect_stdout(printed):
            trainer = Trainer(TrainConfig.model_validate(cfg_data))
            try:
                trainer.train()
            finally:
                trainer.close(keep_process_group=i < len(runs) - 1)
        metrics = [json.loads(line) for line in open(f"{cfg_data['run_dir']}/metrics.jsonl")]
        with open(out_file, "w") as f:
            json.dump({"printed": printed.getvalue(), "metrics": metrics}, f)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_run_on_an_earlier_runs_engines_pushes_its_own_weights_before_its_first_sample(tmp_path, monkeypatch):
    """Two runs from the same init.hf on one engine: the first finds it as loaded (no push before sampling); the
    second finds the first's last push (weight_version '2') and pushes its own weights first, so its step 1 samples
    are of the weights it holds (logprob_gap/current 1, the gap fp32 noise), not the first run's."""
    import json
    import os

    import rollout_helpers as rh
    from test_extensions import _cfg
    from test_held_out_eval import REPO, TOY_MATH

    from megatron_spo.models.parallel import spawn_local

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    model = rh.make_tiny_llama(str(tmp_path / "engine_model"))
    with rh.serving_engine(model) as url:
        def cfg(name):
            return _cfg(tmp_path, model, name, steps=2, algo="agro",
                        batch={"sequences_per_step": 4, "max_tokens_per_micro_batch": 1024, "max_seq_length": 256},
                        task={**TOY_MATH, "reward": "test_held_out_eval:parity_reward", "max_prompt_tokens": 240},
                        fleet={"engine_urls": [url]},
                        rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "buffer_groups": 2,
                                 "max_inflight_requests": 2, "max_staleness": 0})
        spawn_local(_train_runs, 1, [(cfg(name), str(tmp_path / f"{name}.json")) for name in ("first", "second")])
    first, second = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("first", "second"))
    dtype = "[megatron-spo] dtype: the engines serve float32, as the trainer trains (model.params_dtype)"
    assert dtype in first["printed"] and "before the first sample" not in first["printed"]
    assert dtype in second["printed"]
    assert (f"[megatron-spo] fleet: {url} holds weight_version '2' (weights pushed since it loaded): pushing this "
            "run's weights (version 0) before the first sample") in second["printed"]
    for run in (first, second):
        step1 = run["metrics"][0]
        assert step1["logprob_gap/current"] == 1.0 and step1["logprob_gap/mean_abs"] < 1e-5, step1
