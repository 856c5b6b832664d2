"""Hostile configs and command lines (issue 28): each is refused with one line on stderr naming the field or
flag, exit code 2 (1 for plot), no traceback, and before any process is spawned or any rollout started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_spo import cli
from megatron_spo.training import launch

REPO = Path(__file__).resolve().parents[1]

# a tiny Llama config.json: preflight reads it, nothing loads weights
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 61,
             "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 8,
             "tie_word_embeddings": False}


def run(argv: list[str], capsys) -> tuple[int, str]:
    """megatron-spo ARGV in this process -> (exit code, stderr); argparse's SystemExit is an exit code."""
    try:
        rc = cli.main(argv)
    except SystemExit as done:
        rc = done.code
    return rc, capsys.readouterr().err


def last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def train_yaml(tmp_path, hf_dir, monkeypatch):
    """A train config that passes every preflight; launching it fails the test (nothing may be spawned)."""

    def no_launch(cfg_data):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "run", no_launch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    q0 = tmp_path / "q0.jsonl"
    q0.write_text("")
    path = tmp_path / "train.yaml"
    path.write_text(f"init: {{hf: {hf_dir}}}\nfleet: {{router_url: 'http://127.0.0.1:9'}}\ntask: {{q0_path: {q0}}}\n"
                    f"run_dir: {tmp_path / 'run'}\n")
    return path


def test_the_base_config_reaches_the_launch(train_yaml, capsys):
    with pytest.raises(AssertionError, match="a rank was started"):
        cli.main(["train", str(train_yaml)])


@pytest.mark.parametrize("override, field, says", [
    ("optimizer.lr=.inf", "optimizer.lr", "finite number"),
    ("beta=.inf", "beta", "finite number"),
    ("beta=-.inf", "beta", "finite number"),
    ("rollout.top_p=.nan", "rollout.top_p", "finite number"),
    ("steps=true", "steps", "boolean"),
    ("nproc=false", "nproc", "boolean"),
    ("optimizer.lr=true", "optimizer.lr", "boolean"),
])
def test_non_finite_numbers_and_bools_for_numbers_are_refused(train_yaml, capsys, override, field, says):
    rc, err = run(["train", str(train_yaml), override], capsys)
    line = last_line(err)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert line.startswith(f"megatron-spo train: config error: {train_yaml}: {field}: ") and says in line, line


def test_a_bool_field_still_takes_a_bool(tmp_path, hf_dir):
    from megatron_spo.config import load_config
    from megatron_spo.training.config import TrainConfig

    cfg = load_config(TrainConfig, None, [f"init.hf={hf_dir}", "parallel.sequence_parallel=true"])
    assert cfg.parallel.sequence_parallel is True


@pytest.mark.parametrize("name, text, line, key", [
    ("dup.yaml", "steps: 5\nbeta: 0.1\nsteps: 7\n", 3, "steps"),
    ("nested.yaml", "optimizer:\n  lr: 1.0e-6\n  lr: 1.0\n", 3, "lr"),
    ("dup.json", '{"steps": 5,\n "seed": 1,\n "steps": 7}\n', 3, "steps"),
])
def test_duplicate_keys_are_refused_with_their_line(tmp_path, capsys, name, text, line, key):
    path = tmp_path / name
    path.write_text(text)
    rc, err = run(["train", str(path)], capsys)
    first = text.splitlines().index(next(ln for ln in text.splitlines() if f"{key}" in ln)) + 1
    assert rc == 2 and last_line(err) == (f"megatron-spo train: config error: {path} line {line}: duplicate key "
                                          f"'{key}' (first on line {first})"), err


def test_a_duplicate_key_in_an_override_is_refused(train_yaml, capsys):
    rc, err = run(["train", str(train_yaml), "optimizer={lr: 1, lr: 2}"], capsys)
    assert rc == 2 and "duplicate key 'lr'" in last_line(err), err


def alias_bomb(levels: int = 9) -> str:
    """The billion laughs: 9 levels of 9 aliases, ~9^9 strings once expanded (about 560 bytes)."""
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    prev = "a"
    for name in "bcdefghijk"[: levels - 1]:
        text += f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]\n"
        prev = name
    return text + f"steps: *{prev}\n"


def test_an_alias_bomb_is_refused_in_bounded_memory(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert len(alias_bomb()) < 600
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            "from megatron_spo.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "train", str(path)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert last_line(proc.stderr) == (f"megatron-spo train: config error: {path}: more than 100000 values once its "
                                      "aliases (*name) are expanded")


def test_anchors_within_the_limit_still_work(tmp_path):
    from megatron_spo.config import read_yaml

    path = tmp_path / "anchors.yaml"
    path.write_text("base: &b {lr: 1.0e-6, weight_decay: 0.0}\noptimizer:\n  <<: *b\n  lr: 2.0e-6\n")
    assert read_yaml(path)["optimizer"] == {"lr": 2e-6, "weight_decay": 0.0}


def test_error_lines_quote_values_shortened(tmp_path, capsys):
    path = tmp_path / "long.yaml"
    path.write_text("steps: '" + "x" * 100_000 + "'\nseed: [" + ", ".join(["1"] * 50_000) + "]\n")
    rc, err = run(["train", str(path)], capsys)
    line = last_line(err)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "steps: " in line and "seed: " in line, line[:500]
    assert len(line) < 600, len(line)


def test_an_oversized_config_is_refused_unread(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (5 << 20) + "\n")
    rc, err = run(["train", str(path)], capsys)
    assert rc == 2 and "more than a config may hold" in last_line(err), err


# -- checks that used to fail inside spawned ranks or after rollouts started ---------------------------------
@pytest.mark.parametrize("override, says", [
    ("parallel.tensor_model_parallel_size=3",
     "parallel.tensor_model_parallel_size 3 does not divide model.num_attention_heads 4"),
    ("init.hf=/nonexistent/model", "init.hf: '/nonexistent/model' does not exist"),
    ("sources.off.path=/nonexistent/store", "sources.off.path: '/nonexistent/store' does not exist"),
    ("task.paths=[/nonexistent/train-*.parquet]", "task.paths: '/nonexistent/train-*.parquet' matches no file"),
    ("task.q0_path=null", "task.q0_path: algo spo needs Q0 for every online prompt and none is set"),
    ("fleet.router_url=null", "fleet: no rollout endpoints for the online source"),
])
def test_what_ranks_would_read_is_checked_before_spawning(train_yaml, capsys, monkeypatch, override, says):
    monkeypatch.delenv("SPO_ROUTER_URL", raising=False)
    monkeypatch.delenv("SPO_ENGINE_URLS", raising=False)
    rc, err = run(["train", str(train_yaml), override], capsys)
    assert rc == 2 and last_line(err).startswith(f"megatron-spo train: config error: {says}"), err


def test_an_init_model_without_a_tokenizer_is_refused_before_spawning(train_yaml, hf_dir, capsys):
    (hf_dir / "tokenizer.json").unlink()
    rc, err = run(["train", str(train_yaml)], capsys)
    assert rc == 2 and last_line(err) == (f"megatron-spo train: config error: init.hf: '{hf_dir}' has no tokenizer "
                                          "(none of tokenizer.json, tokenizer.model, vocab.json, tokenizer_config.json)")


def test_a_world_size_the_layout_does_not_divide_is_refused(train_yaml, capsys):
    rc, err = run(["train", str(train_yaml), "nproc=3", "parallel.tensor_model_parallel_size=2"], capsys)
    assert rc == 2 and "parallel: world size 3 is not divisible" in last_line(err), err


# -- command-line flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag, says", [
    (["offline", "stats", "x.jsonl", "--pass-reward", "nan"], "--pass-reward", "'nan' is not a finite number"),
    (["offline", "build", "x.jsonl", "--out", "y", "--pass-reward", "inf"], "--pass-reward", "is not a finite"),
    (["plan", "--tp", "0"], "--tp", "'0' is not a positive integer"),
    (["plan", "--pp", "-1"], "--pp", "is not a positive integer"),
    (["check-conversion", "--hf", "a", "--megatron", "b", "--tol", "-1"], "--tol", "'-1' is not a finite number >= 0"),
    (["check-conversion", "--hf", "a", "--megatron", "b", "--tol", "nan"], "--tol", "'nan' is not a finite number"),
    (["check-conversion", "--hf", "a", "--megatron", "b", "--logprob-tol", "inf"], "--logprob-tol", "finite"),
    (["check-conversion", "--hf", "a", "--megatron", "b", "--seq-len", "0"], "--seq-len", "positive integer"),
    (["plot", "run", "--smooth", "0"], "--smooth", "positive integer"),
    (["eval", "-n", "2", "--task", "toy", "--out", "x.jsonl"], "--ks", "each k must be at most -n 2"),
])
def test_bad_flag_values_are_refused_by_name(capsys, argv, flag, says):
    rc, err = run(argv, capsys)
    line = last_line(err)
    assert rc == 2 and flag in line and says in line, line


def test_an_unknown_subcommand_is_one_line(capsys):
    rc, err = run(["trian", "x.yaml"], capsys)
    assert rc == 2 and err == "megatron-spo: unknown subcommand 'trian' (megatron-spo --help lists them)\n"


def test_plot_errors_go_to_stderr(tmp_path, capsys):
    rc, err = run(["plot", str(tmp_path / "nope")], capsys)
    assert rc == 1 and last_line(err) == f"megatron-spo plot: {tmp_path / 'nope'}: no such metrics file", err


@pytest.mark.parametrize("argv, flags", [
    (["check-conversion", "--help"], ["--batch", "--seq-len", "--seed", "--tol"]),
    (["trajectories", "import", "--help"], ["inputs", "store", "--temperature", "--top-p"]),
    (["eval", "--help"], ["--ks"]),
])
def test_every_flag_has_a_help_text(capsys, argv, flags):
    import re

    with pytest.raises(SystemExit):
        cli.main(argv)
    rows = capsys.readouterr().out.splitlines()
    for flag in flags:  # argparse puts the help after the flag, or on the next line when the flag is long
        i = next(i for i, row in enumerate(rows) if re.match(rf"  (-\w, )?{re.escape(flag)}( |$)", row))
        text = re.split(r"\s{2,}", rows[i].strip(), maxsplit=1)[1:] or [rows[i + 1] if rows[i + 1][:20].isspace() else ""]
        assert text[0].strip(), (flag, rows[i:i + 2])
