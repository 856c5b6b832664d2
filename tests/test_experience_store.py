"""The experience store: provenance on records and in the store (old stores still read)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from megatron_spo.cli import main as cli
from megatron_spo.data import offline_store
from megatron_spo.data.offline_store import OfflineStore, OfflineStoreWriter, iter_records, write_store
from megatron_spo.data.trajectory import Provenance, RecordError, load_trajectories, read_jsonl, write_jsonl

PROVENANCES = [
    None,
    {"kind": "online", "run_id": "run-7", "model": "ckpt/step-40", "temperature": 0.7, "top_p": 0.95,
     "created": 1718000000.25},
    {"kind": "human", "origin": "codecontests", "created": 1718000001.5},
    {"kind": "other-model", "model": "Llama-3.1-70B-Instruct", "temperature": 0.0, "top_p": 1.0},
    {"kind": "reference"},
]


def make_records(n: int, seed: int = 0) -> list[dict]:
    """Records in the JSON form, every optional field present in some, provenance cycling through PROVENANCES."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.randint(1, 6)
        rec = {"prompt_id": f"p{i % 3}" if i % 2 else i % 3, "prompt_tokens": [rng.randrange(1000) for _ in range(3)],
               "response_tokens": [rng.randrange(1000) for _ in range(r)], "reward": -float(i % 2),
               "source": "offline", "policy_version": i % 4}
        if i % 3 == 0:
            rec["behaviour_logprobs"] = [-rng.random() for _ in range(r)]
            rec["mc_targets"] = [{"t": r - 1, "success_prob": 0.5}]
        if i % 4 == 0:
            rec["q0"] = -0.25
        if PROVENANCES[i % len(PROVENANCES)] is not None:
            rec["provenance"] = dict(PROVENANCES[i % len(PROVENANCES)])
        out.append(rec)
    return out


def as_dicts(records) -> list[dict]:
    return [r.to_dict() for r in records]


# ---------------------------------------------------------------------------------------------
# Provenance on records and in the store
# ---------------------------------------------------------------------------------------------
def test_provenance_round_trips_through_jsonl_store_and_export(tmp_path):
    records = make_records(23)
    write_jsonl(records, tmp_path / "in.jsonl")
    assert as_dicts(read_jsonl(tmp_path / "in.jsonl")[0]) == records
    assert cli(["trajectories", "import", str(tmp_path / "in.jsonl"), str(tmp_path / "s"), "--rows-per-shard", "5"]) == 0
    store = OfflineStore(tmp_path / "s")
    assert as_dicts(store.trajectories()) == records
    assert [store.record(i).provenance for i in range(len(store))] == [
        None if p is None else Provenance(**p) for p in (PROVENANCES * 5)[:23]]
    assert as_dicts(iter_records(tmp_path / "s")) == records  # the streaming reader agrees
    # a shard stores each distinct {kind, model, run_id, origin} once
    strings = json.loads((tmp_path / "s" / "shard-00000" / "strings.json").read_text())
    assert strings["provenance"] == [{"kind": "online", "model": "ckpt/step-40", "run_id": "run-7"},
                                     {"kind": "human", "origin": "codecontests"},
                                     {"kind": "other-model", "model": "Llama-3.1-70B-Instruct"},
                                     {"kind": "reference"}]
    assert cli(["trajectories", "export", str(tmp_path / "s"), str(tmp_path / "out.jsonl")]) == 0
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == records


def test_trajectories_import_stamps_provenance_on_records_without_one(tmp_path):
    records = make_records(5)
    write_jsonl(records, tmp_path / "q0_samples.jsonl")
    assert cli(["trajectories", "import", str(tmp_path / "q0_samples.jsonl"), str(tmp_path / "s"), "--kind",
                "reference", "--model", "Qwen2.5-7B", "--temperature", "0.8", "--top-p", "0.95"]) == 0
    got = OfflineStore(tmp_path / "s").trajectories()
    for rec, traj in zip(records, got):
        if "provenance" in rec:  # its own provenance is kept
            assert traj.provenance == Provenance(**rec["provenance"])
        else:
            p = traj.provenance
            assert (p.kind, p.model, p.temperature, p.top_p, p.origin, p.run_id) == (
                "reference", "Qwen2.5-7B", 0.8, 0.95, "q0_samples.jsonl", None)
            assert p.created > 1.7e9
    assert sum(r.provenance.kind == "reference" for r in got) == 2  # records 0 (stamped) and 4 (its own)


@pytest.mark.parametrize("provenance, message", [
    ({"kind": "robot"}, "kind must be one of reference, online, pts, human, other-model, offline-import, got 'robot'"),
    ({"kind": "online", "top_p": 0}, r"top_p must be a number in \(0, 1\], got 0"),
    ({"kind": "online", "temperature": -1}, "temperature must be a finite number >= 0, got -1"),
    ({"kind": "online", "created": "yesterday"}, "created must be Unix seconds >= 0, got 'yesterday'"),
    ({"kind": "online", "model": ""}, "model must be a non-empty string, got ''"),
    ({"kind": "online", "seed": 3}, "unknown key 'seed'"),
    ("online", "must be an object"),
])
def test_bad_provenance_names_file_line_and_field(tmp_path, provenance, message):
    good = {"prompt_id": "a", "prompt_tokens": [1], "response_tokens": [2], "reward": 0.0, "source": "offline",
            "policy_version": 0}
    (tmp_path / "t.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({**good, "provenance": provenance}) + "\n")
    with pytest.raises(RecordError, match=rf"t\.jsonl:2: field 'provenance': {message}"):
        read_jsonl(tmp_path / "t.jsonl")


def write_v1_store(records: list[dict], path, rows_per_shard: int) -> None:
    """A store exactly as the code before provenance wrote it: format version 1, 14 columns, strings.json with
    prompt_id and source only (written here with numpy, independently of the current writer)."""
    path.mkdir()
    shards = []
    for start in range(0, len(records), rows_per_shard):
        chunk = records[start : start + rows_per_shard]
        name = f"shard-{len(shards):05d}"
        (path / name).mkdir()

        def ragged(lists):
            return [x for xs in lists for x in xs], np.cumsum([0] + [len(x) for x in lists])

        cols = {}
        cols["prompt_tokens"], cols["prompt_offsets"] = ragged([r["prompt_tokens"] for r in chunk])
        cols["response_tokens"], cols["response_offsets"] = ragged([r["response_tokens"] for r in chunk])
        cols["behaviour_logprobs"], cols["behaviour_offsets"] = ragged([r.get("behaviour_logprobs") or [] for r in chunk])
        cols["has_behaviour"] = [r.get("behaviour_logprobs") is not None for r in chunk]
        cols["reward"] = [r["reward"] for r in chunk]
        cols["policy_version"] = [r["policy_version"] for r in chunk]
        cols["q0"] = [r.get("q0", np.nan) for r in chunk]
        mc = [r.get("mc_targets") or [] for r in chunk]
        cols["mc_t"], cols["mc_offsets"] = ragged([[m["t"] for m in x] for x in mc])
        cols["mc_p"], _ = ragged([[m["success_prob"] for m in x] for x in mc])
        cols["has_mc"] = [r.get("mc_targets") is not None for r in chunk]
        dtypes = {"prompt_tokens": np.int32, "response_tokens": np.int32, "behaviour_logprobs": np.float64,
                  "has_behaviour": np.uint8, "reward": np.float64, "q0": np.float64, "mc_p": np.float64,
                  "has_mc": np.uint8}
        files = {}
        for col, values in cols.items():
            np.save(path / name / f"{col}.npy", np.asarray(values, dtype=dtypes.get(col, np.int64)))
            files[f"{col}.npy"] = offline_store._sha256(path / name / f"{col}.npy")
        (path / name / "strings.json").write_text(json.dumps({"prompt_id": [r["prompt_id"] for r in chunk],
                                                              "source": [r["source"] for r in chunk]}))
        files["strings.json"] = offline_store._sha256(path / name / "strings.json")
        shards.append({"name": name, "rows": len(chunk), "files": files})
    (path / "index.json").write_text(json.dumps({"format": "megatron-spo-offline-store", "version": 1,
                                                 "shards": shards}))


def test_a_store_written_before_provenance_still_reads_and_takes_appends(tmp_path):
    old = [{k: v for k, v in r.items() if k != "provenance"} for r in make_records(11)]
    write_v1_store(old, tmp_path / "s", rows_per_shard=4)
    store = OfflineStore(tmp_path / "s")
    assert [s.version for s in store.shards] == [1, 1, 1]
    assert as_dicts(store.trajectories()) == old and all(r.provenance is None for r in store.trajectories())
    assert as_dicts(load_trajectories(tmp_path / "s")) == old
    batch = next(store.batches(11))  # the loaders are unchanged
    assert batch["reward"].tolist() == [r["reward"] for r in old]

    new = make_records(6, seed=1)
    with OfflineStoreWriter(tmp_path / "s", rows_per_shard=4) as writer:  # append: version 2 shards
        for rec in new:
            writer.add(rec)
    assert json.loads((tmp_path / "s" / "index.json").read_text())["version"] == 2
    store = OfflineStore(tmp_path / "s")
    assert [s.version for s in store.shards] == [1, 1, 1, 2, 2]
    assert as_dicts(store.trajectories()) == old + new
    assert as_dicts(iter_records(tmp_path / "s")) == old + new


def test_a_store_row_with_a_bad_provenance_is_named(tmp_path):
    write_store(make_records(5), tmp_path / "s", rows_per_shard=5)
    shard = tmp_path / "s" / "shard-00000"
    index = json.loads((tmp_path / "s" / "index.json").read_text())  # a consistent but wrong writer:
    for column, row, value in (("created", 0, 5.0), ("top_p", 1, 0.0)):  # row 0 has no provenance, row 1 has one
        values = np.load(shard / f"{column}.npy")
        values[row] = value
        np.save(shard / f"{column}.npy", values)
        index["shards"][0]["files"][f"{column}.npy"] = offline_store._sha256(shard / f"{column}.npy")
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(RecordError, match=r"shard-00000 row 0: field 'provenance': values without a provenance"):
        OfflineStore(tmp_path / "s")
    store = OfflineStore(tmp_path / "s", skip_invalid=True)
    assert len(store) == 3 and store.report.errors[1].endswith("row 1: field 'provenance': top_p not in (0, 1]")
