"""The experience archive: a run keeps every online trajectory it trains on (with provenance), the archive
survives SIGKILL with only complete shards counted, and a second run trains on the first run's experience
through an offline source selected by provenance."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import DeterministicSource, make_tiny_hf, run_spawned  # noqa: E402

from megatron_spo.config import ConfigError  # noqa: E402
from megatron_spo.data.offline_store import OfflineStore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _cfg(run_dir: Path, hf: str, **kw) -> dict:
    cfg = dict(run_dir=str(run_dir), steps=2, beta=0.5, init={"hf": hf}, optimizer={"lr": 1e-3, "warmup_steps": 2},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               model_update_interval=1, checkpoint={"interval": 1, "export_hf": False}, logging={"progress": False})
    cfg.update(kw)
    return cfg


@pytest.mark.multiproc
def test_a_run_archives_its_online_trajectories_and_the_next_run_learns_from_them(tmp_path):
    hf = make_tiny_hf(str(tmp_path / "hf"))
    first = tmp_path / "run1"
    run_spawned([(_cfg(first, hf), str(tmp_path / "w1.pt"))], 1)
    store = OfflineStore(first / "experience")
    records = store.trajectories()
    drawn = DeterministicSource().take(16)  # what the two steps trained on
    assert len(records) == 16
    assert [(r.prompt_id, r.response_tokens, r.reward, r.behaviour_logprobs) for r in records] == [
        (t.prompt_id, t.response_tokens, t.reward, t.behaviour_logprobs) for t in drawn]
    assert {(r.provenance.kind, r.provenance.run_id, r.provenance.model) for r in records} == {("online", "run1", hf)}
    assert all(r.source == "online" and r.q0 == -0.5 and r.provenance.created > 0 for r in records)

    second = tmp_path / "run2"  # half online, half the first run's experience, picked by run id
    cfg = _cfg(second, hf, sources={"online": {"weight": 0.5}, "previous": {
        "weight": 0.5, "path": str(first / "experience"), "select": {"run_ids": ["run1"], "kinds": ["online"]}}})
    run_spawned([(cfg, str(tmp_path / "w2.pt"))], 1)
    metrics = [json.loads(x) for x in (second / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("loss/previous" in m for m in metrics)
    assert len(OfflineStore(second / "experience")) == 8  # it archives only its own online half


def test_a_selection_matching_nothing_is_refused_in_one_line(tmp_path):
    from megatron_spo.data.archive import ExperienceArchive
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.sources import build_sampler

    archive = ExperienceArchive(tmp_path / "exp", run_id="r7", model="m")
    archive.add(DeterministicSource().take(4))
    archive.close()
    cfg = TrainConfig.model_validate(dict(init={"hf": "x"}, sources={
        "old": {"path": str(tmp_path / "exp"), "select": {"run_ids": ["r8"]}}}))
    with pytest.raises(ConfigError) as info:
        build_sampler(cfg)
    assert str(info.value) == f"sources.old.select: none of the 4 records of {tmp_path / 'exp'} match {{'run_ids': ['r8']}}"
    cfg = TrainConfig.model_validate(dict(init={"hf": "x"}, sources={
        "old": {"path": str(tmp_path / "exp"), "select": {"run_ids": ["r7"], "models": ["m"]}}}))
    sampler, online = build_sampler(cfg)
    assert online is None and len(sampler.sources["old"].records) == 4


_KILLED_WRITER = """
import os, signal, sys
import numpy as np
sys.path.insert(0, {tests!r})
from trainer_helpers import DeterministicSource
from megatron_spo.data.archive import ExperienceArchive

archive = ExperienceArchive(sys.argv[1], run_id="killed", rows_per_shard=5)
source = DeterministicSource()
archive.add(source.take(5))          # a full shard: written and listed
archive.add(source.take(3))          # buffered
save = np.save
calls = []
def dying_save(*args, **kwargs):     # the machine dies half-way through writing the next shard
    calls.append(1)
    if len(calls) == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return save(*args, **kwargs)
np.save = dying_save
archive.flush()
"""


def test_the_archive_survives_sigkill_mid_shard(tmp_path):
    store = tmp_path / "exp"
    code = _KILLED_WRITER.format(tests=str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code, str(store)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert any(p.name.endswith(".tmp") for p in store.iterdir())  # the half-written shard is there...
    records = OfflineStore(store).trajectories()  # ...and not counted: only the complete shard reads
    assert [r.prompt_id for r in records] == [t.prompt_id for t in DeterministicSource().take(5)]
    from megatron_spo.data.archive import ExperienceArchive

    archive = ExperienceArchive(store, run_id="resumed")  # a resumed run appends after it
    archive.add(DeterministicSource(seed=1).take(2))
    archive.close()
    assert [r.provenance.run_id for r in OfflineStore(store).trajectories()] == ["killed"] * 5 + ["resumed"] * 2
    assert os.path.isdir(store)


def test_compare_runs_pairs_problems(tmp_path):
    """tools/compare_runs.py: B - A per held-out problem, paired (problems only one run has are left out)."""
    for name, rows in (("a", [("p1", 0.2, 0.5), ("p2", 0.4, 0.9), ("p3", 0.0, 0.0)]),
                       ("b", [("p1", 0.3, 0.5), ("p2", 0.6, 1.0), ("p4", 1.0, 1.0)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval_after.jsonl").write_text("".join(
            json.dumps({"prompt_id": p, "pass@1": one, "pass@10": ten}) + "\n" for p, one, ten in rows))
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "compare_runs.py"), str(tmp_path / "a"),
                           str(tmp_path / "b"), "--json"], capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout)
    assert result["problems"] == 2
    assert result["pass@1"]["delta"] == pytest.approx(0.15) and result["pass@10"]["delta"] == pytest.approx(0.05)
    assert result["pass@1"]["ci95"] == pytest.approx([0.1, 0.2])
