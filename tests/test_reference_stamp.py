"""Which reference a run started from: the reference's identity is its weights' content (the same SFT recipe on
another CPU can give other weights), a folder of shared reference evaluations and Q0 is claimed by the reference
that made them, and `megatron-spo compare` refuses, before any run, to resume a study from another reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_spo.config import ConfigError, build_config
from megatron_spo.experiments import reference_model as rm
from megatron_spo.experiments import study as st
from megatron_spo.experiments.quickstart import REFERENCE_STAMP, claim_reuse_dir


def _reference(path: Path, bump: float = 0.0) -> Path:
    """A built reference's files: weights and build_info.json (cache key 'abc')."""
    path.mkdir(parents=True, exist_ok=True)
    weights = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    weights["b"][2] += bump
    save_file(weights, str(path / "model.safetensors"))
    (path / rm.BUILD_INFO).write_text(json.dumps({"cache_key": "abc"}))
    return path


def test_the_identity_is_the_weights_content(tmp_path):
    one = rm.reference_identity(_reference(tmp_path / "one"))
    again = rm.reference_identity(_reference(tmp_path / "again"))  # the same weights written again elsewhere
    other = rm.reference_identity(_reference(tmp_path / "other", bump=2.0 ** -20))  # one float moved by 2^-20
    assert one == again and one["cache_key"] == "abc" and len(one["sha256"]) == 64
    assert other["sha256"] != one["sha256"] and other["cache_key"] == "abc"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no \*\.safetensors weights \(not a built reference\)"):
        rm.reference_identity(tmp_path / "empty")


def test_a_reuse_dir_belongs_to_the_reference_that_filled_it(tmp_path):
    mine = rm.reference_identity(_reference(tmp_path / "ref"))
    theirs = rm.reference_identity(_reference(tmp_path / "rebuilt", bump=1.0))
    shared = tmp_path / "shared"
    shared.mkdir()
    claim_reuse_dir(shared, mine)  # an empty folder: claimed
    assert json.loads((shared / REFERENCE_STAMP).read_text()) == mine
    (shared / "eval_before.jsonl").write_text("{}\n")
    claim_reuse_dir(shared, mine)  # the same reference again: its files are reused
    with pytest.raises(ConfigError) as info:
        claim_reuse_dir(shared, theirs)
    msg = str(info.value)
    assert "\n" not in msg and f"reference {mine['sha256'][:12]}" in msg and f"weights {theirs['sha256'][:12]}" in msg
    assert msg.startswith(f"quickstart: {shared} holds the evaluations and Q0 of reference")
    # files from before stamps: nobody can say which reference made them
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "q0.jsonl").write_text("{}\n")
    (legacy / "eval_validation_before.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"holds eval_validation_before.jsonl, q0.jsonl but no reference.json"):
        claim_reuse_dir(legacy, mine)
    assert not (legacy / REFERENCE_STAMP).exists()
    (shared / REFERENCE_STAMP).write_text('{"cache_key": "abc"}')
    with pytest.raises(ConfigError, match=r"reference.json: not a reference stamp with a sha256 \(KeyError"):
        claim_reuse_dir(shared, mine)


def test_compare_refuses_to_resume_from_another_reference_before_any_run(tmp_path, monkeypatch):
    mine = _reference(tmp_path / "cache" / "here")
    root = tmp_path / "study"
    study = build_config(st.StudyConfig, {"out_dir": str(root), "arms": ["spo"], "seeds": [0, 1],
                                          "sweep": {"enabled": False}})
    monkeypatch.setattr(rm, "build_reference", lambda *a, **k: mine)  # this machine's (cached) reference

    def no_run(*a, **k):
        raise AssertionError("a run started")

    monkeypatch.setattr(st.subprocess, "run", no_run)
    for seed in (0, 1):
        (root / "shared" / f"seed{seed}").mkdir(parents=True)
    (root / "shared" / "seed0" / REFERENCE_STAMP).write_text(json.dumps(rm.reference_identity(mine)))
    st._check_reference(study, root)  # made here: the study goes on (seed 1's empty folder is claimed by its run)
    assert not (root / "shared" / "seed1" / REFERENCE_STAMP).exists()
    (root / "shared" / "seed1" / "eval_before.jsonl").write_text("{}\n")  # from before stamps: whose?
    with pytest.raises(ConfigError, match=r"^compare: .*seed1 holds eval_before.jsonl but no reference.json naming"):
        st.run_study(study)
    made_elsewhere = rm.reference_identity(_reference(tmp_path / "elsewhere", bump=1.0))
    (root / "shared" / "seed1" / REFERENCE_STAMP).write_text(json.dumps(made_elsewhere))
    with pytest.raises(ConfigError) as info:
        st.run_study(study)
    msg = str(info.value)
    assert msg.startswith(f"compare: {root / 'shared' / 'seed1'} holds the evaluations and Q0 of reference "
                          f"{made_elsewhere['sha256'][:12]}, but the reference here (cache key abc) has weights "
                          f"{rm.reference_identity(mine)['sha256'][:12]}") and "\n" not in msg
    assert not (root / "runs").exists()
