"""Trajectory records (validation, JSONL) and the offline store (atomic shards, plain vs DALI loaders)."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest

from megatron_spo.data import offline_store
from megatron_spo.data.offline_store import OfflineStore, OfflineStoreWriter, load_trajectories, write_store
from megatron_spo.data.trajectory import RecordError, Trajectory, read_jsonl, write_jsonl
from megatron_spo.fsutil import sha256_file


def make_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        p, r = rng.randint(1, 7), rng.randint(1, 9)
        rec = {"prompt_id": f"p{i % 4}" if i % 2 else i % 4, "prompt_tokens": [rng.randrange(50000) for _ in range(p)],
               "response_tokens": [rng.randrange(50000) for _ in range(r)], "reward": -float(i % 2),
               "source": "offline" if i % 3 else "mc", "policy_version": i % 5}
        if i % 3 == 0:
            rec["behaviour_logprobs"] = [-rng.random() * 3 for _ in range(r)]
        if i % 4 == 0:
            rec["q0"] = -rng.random() / 7
        if i % 3 == 0:
            rec["mc_targets"] = [{"t": 0, "success_prob": 0.1 * rng.randint(0, 10)},
                                 {"t": r - 1, "success_prob": rng.random()}]
        records.append(rec)
    return records


def as_dicts(records) -> list[dict]:
    return [r.to_dict() for r in records]


# ---------------------------------------------------------------------------------------------
# Records and JSONL
# ---------------------------------------------------------------------------------------------
def test_jsonl_round_trip_is_exact(tmp_path):
    records = make_records(30)
    assert write_jsonl(records, tmp_path / "t.jsonl") == 30
    loaded, report = read_jsonl(tmp_path / "t.jsonl")
    assert as_dicts(loaded) == records and (report.read, report.skipped) == (30, 0)
    assert isinstance(loaded[0], Trajectory) and loaded[0].behaviour_logprobs is not None


GOOD = {"prompt_id": "a", "prompt_tokens": [1, 2], "response_tokens": [3, 4, 5], "reward": 0.0, "source": "online",
        "policy_version": 2}


@pytest.mark.parametrize("change, field, message", [
    ({"prompt_tokens": []}, "prompt_tokens", "non-empty list"),
    ({"response_tokens": [1, -2]}, "response_tokens", "item 1 must be a token id"),
    ({"response_tokens": [1, True]}, "response_tokens", "item 1 must be a token id"),
    ({"reward": float("nan")}, "reward", "finite number"),
    ({"reward": None}, "reward", "finite number"),
    ({"source": ""}, "source", "non-empty string"),
    ({"policy_version": -1}, "policy_version", "integer >= 0"),
    ({"behaviour_logprobs": [-0.1, -0.2]}, "behaviour_logprobs", "one log-prob per response token \\(3\\), got 2"),
    ({"behaviour_logprobs": [-0.1, 0.5, -1.0]}, "behaviour_logprobs", "item 1 must be a finite log-prob <= 0"),
    ({"q0": "x"}, "q0", "finite number"),
    ({"mc_targets": [{"t": 3, "success_prob": 0.5}]}, "mc_targets", "t = 3 is not a response position"),
    ({"mc_targets": [{"t": 0, "success_prob": 1.5}]}, "mc_targets", "success_prob = 1.5 is not in"),
    ({"mc_targets": [{"t": 0}]}, "mc_targets", "item 0 must be"),
    ({"extra": 1}, "extra", "unknown field"),
    ({"prompt_id": None}, "prompt_id", "string or an integer"),
])
def test_bad_records_name_file_line_and_field(tmp_path, change, field, message):
    bad = {**GOOD, **change}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match=rf"t\.jsonl:3: field '{field}': .*{message}") as err:
        read_jsonl(path)
    assert err.value.field == field and err.value.where.endswith("t.jsonl:3")


def test_missing_field_and_broken_json(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "reward"}) + "\n")
    with pytest.raises(RecordError, match=r"t\.jsonl:1: field 'reward': missing"):
        read_jsonl(path)
    path.write_text(json.dumps(GOOD) + "\n{\"prompt_id\": \n")
    with pytest.raises(RecordError, match=r"t\.jsonl:2: not valid JSON"):
        read_jsonl(path)


def test_skip_invalid_skips_counts_and_reports(tmp_path, caplog):
    lines = [GOOD, {**GOOD, "reward": "bad"}, GOOD, {**GOOD, "source": 3}, GOOD]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with caplog.at_level(logging.WARNING):
        records, report = read_jsonl(path, skip_invalid=True)
    assert len(records) == 3 and (report.read, report.skipped) == (3, 2)
    assert report.errors[0].endswith("t.jsonl:2: field 'reward': must be a finite number, got 'bad'")
    assert "t.jsonl:4: field 'source'" in report.errors[1]
    assert any("skipped 2 invalid record(s), kept 3" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# The offline store
# ---------------------------------------------------------------------------------------------
def test_store_round_trip_across_shards_and_appends(tmp_path):
    records = make_records(25)
    assert write_store(records[:20], tmp_path / "s", rows_per_shard=8) == 20
    with OfflineStoreWriter(tmp_path / "s", rows_per_shard=8) as writer:  # append to the same store
        for rec in records[20:]:
            writer.add(rec)
    store = OfflineStore(tmp_path / "s")
    assert [s.rows for s in store.shards] == [8, 8, 4, 5]
    assert as_dicts(store.trajectories()) == records  # exact: ints, float64, optional fields
    assert as_dicts(load_trajectories(tmp_path / "s")) == records
    write_jsonl(records, tmp_path / "t.jsonl")
    assert as_dicts(load_trajectories(tmp_path / "t.jsonl")) == records


def test_an_unindexed_shard_is_ignored_and_reported(tmp_path, monkeypatch, caplog):
    records = make_records(12)
    write_store(records[:6], tmp_path / "s", rows_per_shard=6)

    def crash(*_):  # the process dies after the shard folder is renamed, before the index lists it
        raise KeyboardInterrupt

    monkeypatch.setattr(offline_store, "_write_json_atomic", crash)
    writer = OfflineStoreWriter(tmp_path / "s", rows_per_shard=6)
    with pytest.raises(KeyboardInterrupt):
        for rec in records[6:]:
            writer.add(rec)
    monkeypatch.undo()
    assert (tmp_path / "s" / "shard-00001").is_dir()
    with caplog.at_level(logging.WARNING):
        store = OfflineStore(tmp_path / "s")
    assert as_dicts(store.trajectories()) == records[:6]
    assert any("ignoring folder 'shard-00001'" in r.getMessage() for r in caplog.records)
    write_store(records[6:], tmp_path / "s", rows_per_shard=6)  # a later append does not overwrite it
    assert as_dicts(OfflineStore(tmp_path / "s").trajectories()) == records


def test_a_truncated_shard_is_detected_not_read(tmp_path):
    records = make_records(12)
    write_store(records, tmp_path / "s", rows_per_shard=6)
    target = tmp_path / "s" / "shard-00001" / "response_tokens.npy"
    target.write_bytes(target.read_bytes()[:-7])
    with pytest.raises(RecordError, match=r"shard-00001: field 'response_tokens\.npy': checksum mismatch"):
        OfflineStore(tmp_path / "s")
    store = OfflineStore(tmp_path / "s", skip_invalid=True)
    assert as_dicts(store.trajectories()) == records[:6]
    assert store.report.skipped == 6 and "6 rows skipped" in store.report.errors[0]


def test_bad_rows_in_a_shard_name_shard_row_and_field(tmp_path):
    records = make_records(6)
    write_store(records, tmp_path / "s", rows_per_shard=6)
    shard = tmp_path / "s" / "shard-00000"
    reward = np.load(shard / "reward.npy")
    reward[4] = np.inf
    np.save(shard / "reward.npy", reward)
    index = json.loads((tmp_path / "s" / "index.json").read_text())  # a consistent but wrong writer
    index["shards"][0]["files"]["reward.npy"] = sha256_file(shard / "reward.npy")
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(RecordError, match=r"shard-00000 row 4: field 'reward': not finite"):
        OfflineStore(tmp_path / "s")
    store = OfflineStore(tmp_path / "s", skip_invalid=True)
    assert as_dicts(store.trajectories()) == records[:4] + records[5:]
    assert store.report.skipped == 1


def test_cli_import_export_check(tmp_path, capsys):
    from megatron_spo.cli import main

    records = make_records(9)
    lines = [json.dumps(r) for r in records] + ['{"prompt_id": 1}']
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["trajectories", "import", str(tmp_path / "in.jsonl"), str(tmp_path / "s")]) == 1
    assert "in.jsonl:10: field 'prompt_tokens': missing" in capsys.readouterr().err
    assert main(["trajectories", "import", str(tmp_path / "in.jsonl"), str(tmp_path / "s"), "--skip-invalid",
                 "--rows-per-shard", "4"]) == 0
    out = capsys.readouterr()
    assert "imported 9 records" in out.out and "skipped 1 invalid record(s)" in out.err
    assert main(["trajectories", "export", str(tmp_path / "s"), str(tmp_path / "out.jsonl")]) == 0
    assert as_dicts(read_jsonl(tmp_path / "out.jsonl")[0]) == records
    assert main(["trajectories", "check", str(tmp_path / "s")]) == 0
    assert "9 valid records" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Invalid UTF-8 in a trajectory JSONL (issue 19)
# ---------------------------------------------------------------------------------------------
def test_a_line_of_invalid_utf8_is_a_record_error_and_skipping_keeps_every_good_record(tmp_path, capsys):
    from megatron_spo.cli import main as cli

    records = make_records(4)
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    bad = b'{"prompt_id": "caf\xe9", "prompt_tokens": [1]}\n'  # latin-1, not UTF-8
    path = tmp_path / "t.jsonl"
    path.write_bytes(lines[0] + lines[1] + bad + lines[2] + lines[3])
    expected = f"{path}:3: not valid UTF-8 (byte offset 18: invalid continuation byte)"
    with pytest.raises(RecordError) as err:
        read_jsonl(path)
    assert str(err.value) == expected
    loaded, report = read_jsonl(path, skip_invalid=True)
    assert as_dicts(loaded) == records and (report.read, report.skipped) == (4, 1)
    assert report.errors == [expected]

    assert cli(["trajectories", "check", str(path)]) == 1
    assert capsys.readouterr().err == f"megatron-spo trajectories: {expected}\n"
    assert cli(["trajectories", "import", str(path), str(tmp_path / "s")]) == 1
    assert capsys.readouterr().err == f"megatron-spo trajectories: {expected}\n"
    assert not (tmp_path / "s" / "index.json").exists()
    assert cli(["trajectories", "import", str(path), str(tmp_path / "s"), "--skip-invalid"]) == 0
    out = capsys.readouterr()
    assert "imported 4 records" in out.out and f"  {expected}\n" in out.err
    assert as_dicts(OfflineStore(tmp_path / "s").trajectories()) == records
