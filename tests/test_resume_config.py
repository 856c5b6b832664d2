"""Resume compares the config with the checkpoint's: a change is refused, listing each changed field old -> new,
unless allowed (--allow-config-change); config.yaml keeps the run's first config and config-history/ every
start's, with the changes it was allowed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_resume import _config  # noqa: E402
from trainer_helpers import DeterministicSource, make_tiny_hf  # noqa: E402

from megatron_spo.training.checkpoint import config_changes  # noqa: E402


def test_config_changes_lists_fields_old_to_new_and_ignores_free_ones():
    old = {"steps": 4, "optimizer": {"lr": 0.002, "warmup_steps": 0}, "fleet": {"engine_urls": ["a"]},
           "sources": {"offline": {"path": "x"}}}
    new = {"steps": 8, "optimizer": {"lr": 0.001, "warmup_steps": 0}, "fleet": {"engine_urls": ["b"]},
           "sources": {"offline": {"path": "x"}, "online": {"weight": 1.0}}}
    assert config_changes(old, new) == ["optimizer.lr: 0.002 -> 0.001", "sources.online.weight: '(absent)' -> 1.0"]


def test_a_config_written_by_another_version_is_compared_on_what_the_user_set(tmp_path, capsys):
    """An old checkpoint's config that today's class refuses (here a field since removed, and a default that
    moved): differences at today's defaults are reported, not refused; a changed lr still is."""
    from megatron_spo.config import ConfigError
    from megatron_spo.training.checkpoint import check_resume_config
    from megatron_spo.training.config import TrainConfig

    cfg = TrainConfig.model_validate({"init": {"hf": "x"}, "optimizer": {"lr": 1e-3}})
    old = cfg.model_dump(mode="json")
    old["removed_field"] = 1
    old["optimizer"]["warmup_steps"] = 100  # the old default; today's is 200
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert check_resume_config(cfg, tmp_path, tmp_path) == []
    assert ("not compared, at today's defaults: optimizer.warmup_steps: 100 -> 200; removed_field: 1 -> "
            "'(absent)'") in capsys.readouterr().out
    changed = TrainConfig.model_validate({"init": {"hf": "x"}, "optimizer": {"lr": 2e-3}})
    with pytest.raises(ConfigError, match=r"\(optimizer.lr: 0.001 -> 0.002\); to resume with it"):
        check_resume_config(changed, tmp_path, tmp_path)


def _write(root: Path, hf: str, steps: int, lr: float) -> Path:
    path = _config(root, hf, "run", steps)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(nproc=1, parallel={"tensor_model_parallel_size": 1})
    cfg["optimizer"]["lr"] = lr
    cfg["checkpoint"]["export_hf"] = False
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_resume_refuses_a_changed_config_unless_allowed_and_keeps_a_history(tmp_path):
    from megatron_spo.data.trajectory import Trajectory, write_jsonl

    hf = make_tiny_hf(str(tmp_path / "hf"))
    records = [Trajectory(prompt_id=t.prompt_id, prompt_tokens=t.prompt_tokens, response_tokens=t.response_tokens,
                          reward=t.reward, source="offline", policy_version=0, q0=-0.4)
               for t in DeterministicSource(seed=7).take(48)]
    write_jsonl(records, tmp_path / "offline.jsonl")
    run = tmp_path / "run"

    def train_with(steps: int, lr: float, *flags: str) -> tuple[int, str]:
        out = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "train", str(_write(tmp_path, hf, steps, lr)),
                              *flags], capture_output=True, text=True, timeout=600)
        return out.returncode, out.stdout + out.stderr

    assert train_with(2, 2e-3)[0] == 0
    rc, out = train_with(4, 1e-3)
    assert rc == 2, out[-2000:]
    assert (f"megatron-spo train: config error: resume: the config differs from the one "
            f"{run / 'checkpoints' / 'iter_0000002'} was written with (optimizer.lr: 0.002 -> 0.001); to resume "
            "with it pass checkpoint.allow_config_change=true") in out
    rc, out = train_with(4, 1e-3, "--allow-config-change")
    assert rc == 0, out[-2000:]
    assert "resumed with a changed config (optimizer.lr: 0.002 -> 0.001)" in out
    rc, out = train_with(6, 1e-3)  # the step-4 checkpoint was written with lr 0.001: no change to allow
    assert rc == 0, out[-2000:]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == 2e-3  # the first, kept
    history = sorted((run / "config-history").iterdir())
    assert [p.name for p in history] == ["000-step0.yaml", "001-step2.yaml", "002-step4.yaml"]
    lines = history[1].read_text().splitlines()
    assert lines[0].startswith("# started ") and lines[0].endswith(" at step 2")
    assert lines[1] == "# changed on resume: optimizer.lr: 0.002 -> 0.001"
    assert yaml.safe_load(history[2].read_text())["steps"] == 6
