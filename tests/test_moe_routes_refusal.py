"""A route that cannot be the model's in an offline source (issue 61): `megatron-spo validate` names it, and
`megatron-spo train` refuses it before any rank is spawned (training/launch.py preflight_data), in one line naming the
source's path, the record and its prompt_id, and the field, at 1 and 2 ranks; the check (training/sources.py
check_source_routes over data/offline_store.py iter_routed) streams, honours the source's select and stops at the
first bad record. The model is a tiny odd Qwen3-MoE: 5 experts, top-3."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import moe_helpers as moe  # noqa: E402

from megatron_spo.data.offline_store import iter_routed, write_store  # noqa: E402
from megatron_spo.data.routes import RoutedExperts, RoutesError  # noqa: E402
from megatron_spo.data.trajectory import Provenance, RecordError, Trajectory, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXPERTS, TOP_K, LAYERS = 5, 3, moe.SHAPE["num_hidden_layers"]
BAD = "field 'routed_experts': expert id 5 at token 2, layer 1 is outside [0, 5)"


def record(i: int, bad: bool = False, model: str | None = None, routed: bool = True) -> Trajectory:
    """Prompt 3 + response 2 tokens: routes for 4 positions x LAYERS x top-3 (distinct ids; id 5 where ``bad``)."""
    ids = np.tile(np.arange(TOP_K, dtype=np.int32), (4, LAYERS, 1)) + i % 2
    if bad:
        ids[2, 1, 0] = EXPERTS
    return Trajectory(prompt_id=f"p{i}", prompt_tokens=[1, 2, 3], response_tokens=[4, 5], reward=0.0,
                      source="offline", policy_version=0, q0=0.0,
                      provenance=None if model is None else Provenance(kind="online", model=model),
                      routed_experts=RoutedExperts.from_array(ids) if routed else None)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return moe.make_tiny_moe(tmp_path_factory.mktemp("moe5") / "hf", num_experts=EXPERTS, num_experts_per_tok=TOP_K)


def train_yaml(root: Path, hf: Path, store: Path) -> Path:
    cfg = dict(run_dir=str(root / "run"), steps=1, algo="spo", beta=0.5, init={"hf": str(hf)},
               sources={"offline": {"path": str(store)}}, optimizer={"lr": 1e-3, "warmup_steps": 0},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 64, "max_seq_length": 64},
               checkpoint={"interval": 100}, logging={"progress": False, "wandb_mode": "disabled"})
    path = root / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "megatron_spo.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)


def test_a_bad_expert_id_is_one_line_from_validate_and_from_train_at_1_and_2_ranks(hf, tmp_path):
    """8 records over 3 shards, record 5 (shard 1, row 2) routes a token to expert 5 of 5: validate reports that one
    line (exit 1); train and train nproc=2 exit 2 with exactly that line on stderr, no traceback, and no run dir."""
    store = tmp_path / "store"
    write_store([record(i, bad=i == 5) for i in range(8)], store, rows_per_shard=3)
    config = train_yaml(tmp_path, hf, store)
    line = f"sources.offline.path {store} record 5 (prompt_id 'p5'): {BAD}"

    checked = cli("validate", str(config))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert checked.stderr.splitlines() == [f"megatron-spo validate: 1 problem(s) in {config}:", f"  {line}"]
    for extra in ([], ["nproc=2"]):
        proc = cli("train", str(config), *extra)
        assert proc.returncode == 2, (extra, proc.stderr[-3000:])
        assert proc.stderr.splitlines() == [f"megatron-spo train: config error: {line}"], extra
        assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists(), extra


def test_the_check_streams_honours_select_and_stops_at_the_first_bad_record(hf, tmp_path):
    """check_source_routes: a good store passes (and preflight_data with it); a bad record another model made is
    skipped by a select of this model's; the first bad record stops the check before a later shard is read (that
    shard's files deleted); a shard without routes is never opened (its files deleted too); a JSONL source names its
    line; routes on a dense model are refused; what does not read is one line naming the source."""
    from megatron_spo.config import ConfigError, load_config
    from megatron_spo.data.config import ProvenanceSelect
    from megatron_spo.models.hf_checkpoint import read_hf_config
    from megatron_spo.training.config import SourceConfig, TrainConfig
    from megatron_spo.training.launch import preflight_data
    from megatron_spo.training.sources import check_source_routes

    model = read_hf_config(hf)
    good = tmp_path / "good"
    write_store([record(i, model="b") for i in range(4)] + [record(4, routed=False)], good, rows_per_shard=2)
    check_source_routes("offline", SourceConfig(path=str(good)), model)
    assert [where for where, _ in iter_routed(good)] == [f"{good} record {i}" for i in range(4)]  # unrouted: not built
    preflight_data(load_config(TrainConfig, str(train_yaml(tmp_path, hf, good))))

    mixed = tmp_path / "mixed"  # record 1: another model's routes, bad for this one; shard 2 (records 4, 5) unread
    write_store([record(0, model="b"), record(1, bad=True, model="a"), record(2, model="b"), record(3, model="b"),
                 record(4, model="b"), record(5, model="b")], mixed, rows_per_shard=2)
    for f in (mixed / "shard-00002").iterdir():
        f.unlink()
    with pytest.raises(RoutesError) as info:
        check_source_routes("mixed", SourceConfig(path=str(mixed)), model)
    assert str(info.value) == f"sources.mixed.path {mixed} record 1 (prompt_id 'p1'): {BAD}"
    with pytest.raises(RecordError, match="shard-00002"):  # with record 1 selected away, the check reads on to shard 2
        check_source_routes("mixed", SourceConfig(path=str(mixed), select=ProvenanceSelect(models=["b"])), model)

    dense_shards = tmp_path / "dense-shards"  # shard 0 has no route columns: deleting its files changes nothing
    write_store([record(0, routed=False), record(1, routed=False), record(2, bad=True)], dense_shards, rows_per_shard=2)
    for f in (dense_shards / "shard-00000").iterdir():
        f.unlink()
    with pytest.raises(RoutesError, match=rf"^sources.s.path {dense_shards} record 2 \(prompt_id 'p2'\): "):
        check_source_routes("s", SourceConfig(path=str(dense_shards)), model)

    jsonl = tmp_path / "t.jsonl"
    write_jsonl([record(0, routed=False), record(1), record(2, bad=True)], jsonl)
    with pytest.raises(RoutesError) as info:
        check_source_routes("offline", SourceConfig(path=str(jsonl)), model)
    assert str(info.value) == f"sources.offline.path {jsonl}:3 (prompt_id 'p2'): {BAD}"
    dense = model.model_copy(update={"moe": None})
    with pytest.raises(RoutesError, match=r"record 0 \(prompt_id 'p0'\): field 'routed_experts': routes for a model "
                                          r"without experts \(routes from another model\?\)$"):
        check_source_routes("offline", SourceConfig(path=str(good)), dense)
    cfg = load_config(TrainConfig, str(train_yaml(tmp_path, hf, mixed)), ["sources.offline.select.models=[b]"])
    with pytest.raises(ConfigError) as info:  # the RecordError of a store that does not read: the source's field
        preflight_data(cfg)
    assert str(info.value).startswith(f"sources.offline.path: {mixed / 'shard-00002'}")
