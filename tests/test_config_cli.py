"""Config loading, validation messages and the CLI dispatcher."""

import subprocess
import sys

import pytest

from megatron_spo.cli import SUBCOMMANDS
from megatron_spo.cli import main as cli_main
from megatron_spo.config import (
    ConfigError,
    StrictModel,
    apply_overrides,
    build_config,
    load_config,
    parse_override,
)
from megatron_spo.models.config import ModelConfig, ParallelConfig


class Inner(StrictModel):
    lr: float = 1e-3
    steps: int = 10


class Outer(StrictModel):
    name: str = "run"
    inner: Inner = Inner()


def tiny_model(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
                num_query_groups=4, vocab_size=1000)
    base.update(kw)
    return ModelConfig(**base)


def test_overrides_are_typed_and_nested():
    data = apply_overrides({"inner": {"lr": 1.0}}, ["inner.steps=7", "name=abc", "inner.lr=2e-5"])
    assert data == {"inner": {"lr": 2e-5, "steps": 7}, "name": "abc"}


def test_exponent_floats_without_a_dot_are_numbers_everywhere(tmp_path):
    """YAML 1.1 reads 3e-05 as a string; inside a mapping no typed field turned it back, and `megatron-spo
    compare settings={"spo-online":{"train.lr":3e-05}}` crashed with "Unknown format code 'g' for str"."""
    from megatron_spo.config import parse_yaml

    path, value = parse_override('settings={"spo-online": {"train.lr": 3e-05, "grid": [1e5, -4E+2, .5e-3]}}')
    assert value == {"spo-online": {"train.lr": 3e-05, "grid": [1e5, -400.0, 5e-4]}}
    assert all(isinstance(v, float) for v in value["spo-online"]["grid"])
    assert parse_yaml("lr: 3e-5\nid: 1e3x\nsteps: 10\nquoted: '2e-5'") == {"lr": 3e-5, "id": "1e3x", "steps": 10,
                                                                            "quoted": "2e-5"}
    from megatron_spo.experiments import study as st

    study = build_config(st.StudyConfig, apply_overrides({}, ['settings={"spo": {"train.lr": 3e-05}}']))
    assert st.RunSpec("runs", "spo", 0, tuple(study.settings["spo"].items())).tag == "lr3e-05"


def test_yaml_plus_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ninner:\n  steps: 3\n")
    cfg = load_config(Outer, p, ["inner.lr=0.5"])
    assert (cfg.name, cfg.inner.steps, cfg.inner.lr) == ("x", 3, 0.5)


def test_unknown_field_is_named_with_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  stesp: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml: inner.stesp: unknown field"):
        load_config(Outer, p)


def test_wrong_type_names_field_and_value():
    with pytest.raises(ConfigError, match=r"inner.steps: .*integer.*\(got 'many'\)"):
        load_config(Outer, None, ["inner.steps=many"])


def test_bad_yaml_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("a: 1\nb: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line \d+: invalid YAML"):
        load_config(Outer, p)


def test_missing_file_and_malformed_override(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Outer, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not of the form key.path=value"):
        load_config(Outer, None, ["inner.steps"])
    with pytest.raises(ConfigError, match="'name' is a value, not a section"):
        apply_overrides({"name": "run"}, ["name.x=1"])


def test_model_config_shapes_and_vocab_padding():
    m = tiny_model(vocab_size=1000, make_vocab_size_divisible_by=128)
    assert m.head_dim == 8
    assert m.padded_vocab_size(1) == 1024
    assert m.padded_vocab_size(3) == 1152  # multiple of 384
    with pytest.raises(ValueError, match="not divisible by num_query_groups 3"):
        tiny_model(num_query_groups=3)


def test_llama_8b_parameter_count():
    llama8b = ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                          num_query_groups=8, vocab_size=128256)
    assert llama8b.num_parameters() == 8_030_261_248  # the published Llama-3.1-8B count


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        (dict(tensor_model_parallel_size=3), None, "tensor_model_parallel_size 3 does not divide model.num_attention_heads 8"),
        (dict(tensor_model_parallel_size=8), None, "tensor_model_parallel_size 8 does not divide model.num_query_groups 4"),
        (dict(pipeline_model_parallel_size=3), None, "= 3 does not divide model.num_layers 4"),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4), None, "= 8 does not divide"),
        (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 6, "world size 6 is not divisible"),
    ],
)
def test_parallel_layout_refused_with_numbers(parallel, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**parallel).check(tiny_model(), world)


def test_parallel_layout_accepted():
    p = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    p.check(tiny_model(), 8)
    assert p.data_parallel_size(8) == 2


def test_cli_lists_and_rejects(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUBCOMMANDS)
    assert cli_main(["no-such-thing"]) == 2
    assert "unknown subcommand 'no-such-thing'" in capsys.readouterr().err


def test_cli_entry_point_module_runs():
    proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "subcommands:" in proc.stdout


def test_every_subcommand_target_is_a_module_path():
    for name, (target, help_text) in SUBCOMMANDS.items():
        module, func = target.split(":")
        assert module.startswith("megatron_spo.") and func.isidentifier() and help_text, name


def test_train_config_refuses_bad_combinations(tmp_path):
    from megatron_spo.training.config import TrainConfig

    with pytest.raises(ConfigError, match=r"sources.offline: objective 'advantage' with loss "
                                          r"'cross_entropy' is not supported"):
        load_config(TrainConfig, None, ["init.hf=x", "sources.offline.path=a.jsonl",
                                        "sources.offline.objective=advantage", "sources.offline.loss=cross_entropy"])
    with pytest.raises(ConfigError, match="algo ppo is on-policy: use only the 'online' source"):
        load_config(TrainConfig, None, ["init.hf=x", "algo=ppo", "sources.offline.path=a.jsonl", "rollout.temperature_range=[1,1]", "rollout.top_p=1"])
    with pytest.raises(ConfigError, match="an offline source needs a path"):
        load_config(TrainConfig, None, ["init.hf=x", "sources.mine.weight=1"])
    with pytest.raises(ConfigError, match="give init.hf"):
        load_config(TrainConfig, None, [])
    with pytest.raises(ConfigError, match=r"optimizer.lr: Input should be greater than 0 \(got -1\)"):
        load_config(TrainConfig, None, ["init.hf=x", "optimizer.lr=-1"])


def test_a_lone_process_does_not_collide_on_the_default_master_port():
    """Two single-process trainers on one machine (the quickstart's next to another run) both start: a lone
    process hosts its own store on a port bound as it is chosen (tests/test_held_ports.py), not torch's 29500."""
    import os
    import socket

    code = (
        "from megatron_spo.models.config import ModelConfig, ParallelConfig\n"
        "from megatron_spo.models.parallel import destroy_parallel, init_parallel\n"
        "init_parallel(ParallelConfig(), ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128,"
        " num_attention_heads=4, num_query_groups=2, vocab_size=100))\n"
        "import os; print('port', os.environ.get('MASTER_PORT')); destroy_parallel()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE", "RANK")}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        except OSError:
            pass  # already taken by someone else: the same situation
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "port None" in proc.stdout  # nothing set for a later launch in this process to mistake for its own


def test_logprobs_settings_reach_the_op_and_are_checked_before_any_model(monkeypatch):
    """train.logprobs: typed, passed to token_logprobs as keyword arguments (unset sizes left to the op's
    defaults), and refused at trainer start, with the field named, where this machine cannot run them."""
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    cfg = load_config(TrainConfig, None, ["init.hf=x", "logprobs.chunk_size=512", "logprobs.backend=torch"])
    assert cfg.logprobs.op_kwargs() == {"backend": "torch", "fp8": False, "chunk_size": 512}
    with pytest.raises(ConfigError, match=r"logprobs.max_block_bytes: Input should be greater than or equal to 4096"):
        load_config(TrainConfig, None, ["init.hf=x", "logprobs.max_block_bytes=100"])
    with pytest.raises(ConfigError, match="logprobs.backend: Input should be 'auto', 'torch' or 'triton'"):
        load_config(TrainConfig, None, ["init.hf=x", "logprobs.backend=cuda"])
    # init.hf=x does not exist: the check must come first, before anything reads the model
    fp8 = load_config(TrainConfig, None, ["init.hf=x", "logprobs.fp8=true"])
    with pytest.raises(ConfigError, match=r"logprobs.fp8: the FP8 LM-head GEMM needs a GPU of compute capability"):
        Trainer(fp8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton = load_config(TrainConfig, None, ["init.hf=x", "logprobs.backend=triton"])
    with pytest.raises(ConfigError, match=r"logprobs.backend: 'triton' needs"):
        Trainer(triton)
