"""The experience store: provenance on records and in the store (old stores still read), and
`offline build | stats` (exact filter / dedup / cap counts on a constructed case, streaming, atomic output)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from megatron_spo.cli import main as cli
from megatron_spo.data.experience import (
    BuildOptions,
    HashSet64,
    ProvenanceFilter,
    build_store,
    normalise_text,
    select_records,
    store_stats,
)
from megatron_spo.data.offline_store import (
    OfflineStore,
    OfflineStoreWriter,
    iter_records,
    load_trajectories,
    write_store,
)
from megatron_spo.data.trajectory import (
    Provenance,
    RecordError,
    Trajectory,
    read_jsonl,
    write_jsonl,
)
from megatron_spo.fsutil import sha256_file

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
            files[f"{col}.npy"] = sha256_file(path / name / f"{col}.npy")
        (path / name / "strings.json").write_text(json.dumps({"prompt_id": [r["prompt_id"] for r in chunk],
                                                              "source": [r["source"] for r in chunk]}))
        files["strings.json"] = sha256_file(path / name / "strings.json")
        shards.append({"name": name, "rows": len(chunk), "files": files})
    (path / "index.json").write_text(json.dumps({"format": "megatron-spo-offline-store", "version": 1,
                                                 "shards": shards}))


def test_a_store_written_before_provenance_still_reads_and_takes_appends(tmp_path, capsys):
    old = [{k: v for k, v in r.items() if k != "provenance"} for r in make_records(11)]
    write_v1_store(old, tmp_path / "s", rows_per_shard=4)
    store = OfflineStore(tmp_path / "s")
    assert [s.version for s in store.shards] == [1, 1, 1]
    assert as_dicts(store.trajectories()) == old and all(r.provenance is None for r in store.trajectories())
    assert as_dicts(load_trajectories(tmp_path / "s")) == old

    new = make_records(6, seed=1)
    with OfflineStoreWriter(tmp_path / "s", rows_per_shard=4) as writer:  # append: version 2 shards
        for rec in new:
            writer.add(rec)
    assert json.loads((tmp_path / "s" / "index.json").read_text())["version"] == 2
    store = OfflineStore(tmp_path / "s")
    assert [s.version for s in store.shards] == [1, 1, 1, 2, 2]
    assert as_dicts(store.trajectories()) == old + new
    assert as_dicts(iter_records(tmp_path / "s")) == old + new

    assert cli(["offline", "stats", str(tmp_path / "s"), "--json"]) == 0
    counts = {row["kind"]: row["rows"] for row in json.loads(capsys.readouterr().out)}
    assert counts == {"unknown": 11 + 2, "online": 1, "human": 1, "other-model": 1, "reference": 1}


def test_a_store_row_with_a_bad_provenance_is_named(tmp_path):
    write_store(make_records(5), tmp_path / "s", rows_per_shard=5)
    shard = tmp_path / "s" / "shard-00000"
    index = json.loads((tmp_path / "s" / "index.json").read_text())  # a consistent but wrong writer:
    for column, row, value in (("created", 0, 5.0), ("top_p", 1, 0.0)):  # row 0 has no provenance, row 1 has one
        values = np.load(shard / f"{column}.npy")
        values[row] = value
        np.save(shard / f"{column}.npy", values)
        index["shards"][0]["files"][f"{column}.npy"] = sha256_file(shard / f"{column}.npy")
    (tmp_path / "s" / "index.json").write_text(json.dumps(index))
    with pytest.raises(RecordError, match=r"shard-00000 row 0: field 'provenance': values without a provenance"):
        OfflineStore(tmp_path / "s")
    store = OfflineStore(tmp_path / "s", skip_invalid=True)
    assert len(store) == 3 and store.report.errors[1].endswith("row 1: field 'provenance': top_p not in (0, 1]")


# ---------------------------------------------------------------------------------------------
# offline build / stats
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from megatron_spo.data.char_tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def rec(tok, prompt, text, reward, kind, *, tokens=None, **prov) -> Trajectory:
    return Trajectory(prompt_id=prompt, prompt_tokens=[1, 9], reward=reward, source="offline", policy_version=0,
                      response_tokens=tokens or tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                      provenance=None if kind is None else Provenance(kind=kind, **prov))


def constructed(tok) -> list[Trajectory]:
    """Prompts a and b. Expected fates (verdict pass, dedup with text, cap human=2):"""
    A = "print(1)\n"
    return [
        rec(tok, "a", A, 0.0, "human"),                                        # 0 kept
        rec(tok, "a", A, 0.0, "online", run_id="r1"),                          # 1 duplicate (same tokens)
        rec(tok, "a", "print(1)   \n\n", 0.0, "reference"),                    # 2 duplicate by normalised text only
        rec(tok, "a", "print(2)\n", -1.0, "online", run_id="r1"),              # 3 verdict: fails
        rec(tok, "b", A, 0.0, "online", run_id="r2"),                          # 4 kept (another prompt)
        rec(tok, "a", "x=1\nprint(x)\n", 0.0, "human"),                        # 5 kept (human 2 of 2)
        rec(tok, "b", "print(3)\n", 0.0, "human"),                             # 6 capped (human 3 > 2)
        rec(tok, "b", "print(3)\n", 0.0, "other-model", model="m70b"),         # 7 kept: its copy was capped, not kept
        rec(tok, "b", "print(3)\n", 0.0, None),                                # 8 duplicate of 7 (unknown kind)
        rec(tok, 1, "print(4)\n", 0.0, None),                                  # 9 kept (unknown kind)
        rec(tok, "1", "print(4)\n", -1.0, None),                               # 10 verdict: fails
        rec(tok, "1", "print(4)\n", 0.0, "pts"),                               # 11 duplicate: prompt ids 1 == "1"
    ]


def test_build_filters_dedups_and_caps_exactly(tok):
    records = constructed(tok)
    decode = lambda batch: tok.batch_decode(batch, skip_special_tokens=True)  # noqa: E731
    for batch in (3, 4096):  # batch boundaries do not change the result
        opts = BuildOptions(cap={"human": 2}, decode=decode, batch=batch)
        kept = list(select_records(iter(constructed(tok)), opts))
        assert [records.index(next(r for r in records if r.to_dict() == k.to_dict())) for k in kept] == [0, 4, 5, 7, 9]

    from megatron_spo.data.experience import BuildStats

    stats = BuildStats()
    kept = list(select_records(iter(records), BuildOptions(cap={"human": 2}, decode=decode), stats))
    c = stats.kinds
    assert (c["human"].read, c["human"].written, c["human"].capped, c["human"].duplicates) == (3, 2, 1, 0)
    assert (c["online"].read, c["online"].verdict_dropped, c["online"].duplicates, c["online"].written) == (3, 1, 1, 1)
    assert (c["reference"].duplicates, c["other-model"].written, c["pts"].duplicates) == (1, 1, 1)
    assert (c["unknown"].read, c["unknown"].verdict_dropped, c["unknown"].duplicates, c["unknown"].written) == (3, 1, 1, 1)
    t = stats.total()
    assert (t.read, t.verdict_dropped, t.duplicates, t.capped, t.written) == (12, 2, 4, 1, 5)
    assert stats.keys == 10  # two keys (tokens, text) per kept record

    # without a tokenizer only token ids count: record 2 (same text, other whitespace) is kept
    kept = list(select_records(iter(constructed(tok)), BuildOptions(cap={"human": 2})))
    assert len(kept) == 6 and kept[1].provenance.kind == "reference"
    # verdict fail keeps the two failing ones; all + no dedup keeps everything but the capped human
    assert len(list(select_records(iter(constructed(tok)), BuildOptions(verdict="fail")))) == 2
    assert len(list(select_records(iter(constructed(tok)), BuildOptions(verdict="all", dedup=False,
                                                                         cap={"human": 2})))) == 11
    # per prompt and kind
    kept = list(select_records(iter(constructed(tok)), BuildOptions(cap_per_prompt=1, decode=decode)))
    assert [(str(r.prompt_id), r.provenance and r.provenance.kind) for r in kept] == [
        ("a", "human"), ("b", "online"), ("b", "human"), ("1", None)]  # 7 is now a copy of the kept 6
    # by provenance
    only = ProvenanceFilter(kinds={"online"}, run_ids={"r2"})
    assert [r.prompt_id for r in select_records(iter(constructed(tok)), BuildOptions(select=only))] == ["b"]


def test_normalised_text():
    assert normalise_text("\r\n  x = 1  \r\n\r\n\tprint(x)\t\n\n") == "x = 1\n\tprint(x)"
    assert normalise_text("a\n b") != normalise_text("a\nb")  # indentation is kept


def test_hash_set_matches_a_python_set():
    rng = np.random.default_rng(0)
    hs, ref = HashSet64(), set()
    for _ in range(40):
        batch = rng.integers(0, 5000, size=int(rng.integers(1, 300)), dtype=np.uint64)
        assert hs.contains(batch).tolist() == [int(k) in ref for k in batch]
        hs.add(batch.tolist())
        ref.update(int(k) for k in batch)
    assert len(hs) == len(ref) and len(hs.runs) <= 12


def test_cli_build_and_stats(tmp_path, tok, capsys):
    records = constructed(tok)
    write_store(records[:6], tmp_path / "run1", rows_per_shard=4)
    write_jsonl(records[6:], tmp_path / "more.jsonl")
    tok.save_pretrained(str(tmp_path / "tok"))
    args = ["offline", "build", str(tmp_path / "run1"), str(tmp_path / "more.jsonl"), "--out", str(tmp_path / "out"),
            "--cap", "human=2", "--tokenizer", str(tmp_path / "tok"), "--rows-per-shard", "2"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "wrote 5 records" in out
    assert out.splitlines()[-2].split() == ["total", "12", "0.833", "2", "0", "4", "1", "5", "1.000"]
    built = OfflineStore(tmp_path / "out")
    assert [s.rows for s in built.shards] == [2, 2, 1]
    assert as_dicts(built.trajectories()) == as_dicts([records[i] for i in (0, 4, 5, 7, 9)])
    assert cli(args) == 1  # never overwrites a store
    assert "exists" in capsys.readouterr().err

    assert cli(["offline", "stats", str(tmp_path / "run1"), str(tmp_path / "more.jsonl"), "--json"]) == 0
    rows = {r["kind"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["online"] == {"kind": "online", "rows": 3, "prompts": 2, "pass": 2, "solved_prompts": 2}
    assert rows["unknown"] == {"kind": "unknown", "rows": 3, "prompts": 2, "pass": 2, "solved_prompts": 2}
    assert cli(["offline", "stats", str(tmp_path / "out"), "--by", "kind,run_id"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["kind", "run_id", "rows", "prompts"]
    assert table[2].split() == ["online", "r2", "1", "1", "1", "1.000", "1", "10.0"]


def test_build_input_error_leaves_no_output(tmp_path, tok, capsys):
    write_jsonl(constructed(tok), tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text((tmp_path / "a.jsonl").read_text() + "{not json\n")
    assert cli(["offline", "build", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--out",
                str(tmp_path / "out"), "--rows-per-shard", "1"]) == 1
    assert capsys.readouterr().err.startswith(f"megatron-spo offline build: {tmp_path / 'b.jsonl'}:13: not valid JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl"]  # no output, no temporary folder
    stats = build_store([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "out", skip_invalid=True)
    assert stats.report.skipped == 1 and stats.total().written == 6  # b is all duplicates of a
    assert store_stats([tmp_path / "out"])[("human",)].rows == 3


def test_build_max_tokens_keeps_what_a_trainer_row_holds(tmp_path, tok, capsys):
    """--max-tokens N keeps records of at most N prompt + response tokens (counted under select-), the batch.
    max_seq_length a trainer refuses longer records at (training/sources.py)."""
    records = constructed(tok)
    write_jsonl(records, tmp_path / "a.jsonl")
    sizes = [len(r.prompt_tokens) + len(r.response_tokens) for r in records]
    limit = sorted(sizes)[len(sizes) // 2]
    assert cli(["offline", "build", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "out"), "--verdict", "all",
                "--no-dedup", "--max-tokens", str(limit)]) == 0
    capsys.readouterr()
    kept = OfflineStore(tmp_path / "out").trajectories()
    assert as_dicts(kept) == as_dicts([r for r, n in zip(records, sizes) if n <= limit])
    assert 0 < len(kept) < len(records)
