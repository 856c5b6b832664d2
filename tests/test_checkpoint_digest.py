"""Checkpoints that detect corruption, JSONL that refuses duplicate keys (issue 49).

Every checkpoint, HF export and offline-store shard the project writes lists its files' SHA-256
(megatron_spo/checkpoint_digest.py; the store in its index.json); one flipped byte in any tensor data file is
refused in one line naming the file by every command that reads it, `--no-verify` lets a user's own edit
through, and a checkpoint written before the manifest existed reads with a one-line note. A trajectory, problem
or Q0 line holding a key twice is refused naming file, line and key.

One single-process trainer run (1 step, offline data) writes the trainer checkpoint and the HF export that the
tests here damage copies of; the store is written in-process; the other tests need no model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from models_helpers import REPO, all_tensors  # noqa: E402
from test_hostile_files import cli, refused  # noqa: E402
from trainer_helpers import DeterministicSource, make_tiny_hf  # noqa: E402

from megatron_spo.checkpoint_digest import (  # noqa: E402
    MANIFEST,
    CheckpointDigestError,
    verification,
    verify_checkpoint,
    write_manifest,
)

HINT = "--no-verify (checkpoint.verify=false in a training config) skips the check"


def flip(path: Path, offset: int | None = None) -> int:
    """Flip one bit of the byte at ``offset`` (default: the middle of the file); returns the offset."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset % len(data)
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    return offset


def mismatch(root: Path, name: str) -> str:
    """The start of the one line that refuses ``name`` under ``root``'s manifest."""
    return f"checkpoint {root}: file {name} digest mismatch (expected crc32 "


def listed(root: Path) -> list[str]:
    return sorted(json.loads((root / MANIFEST).read_text())["files"])


# A weight stored with the same bytes in the trainer's checkpoint and its HF export (float32, no vocabulary padding)
EDITED = "model.layers.0.mlp.down_proj.weight"


def flip_in_tensor(file: Path, tensor) -> int:
    """Flip a bit inside ``tensor``'s bytes where ``file`` stores them (found by content: exactly once)."""
    raw, data = tensor.contiguous().numpy().tobytes(), file.read_bytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0
    return flip(file, at + len(raw) // 2 + 1)


# ---------------------------------------------------------------------------------------------
# The manifest itself (no model)
# ---------------------------------------------------------------------------------------------
def _tree(root: Path) -> Path:
    (root / "dist").mkdir(parents=True)
    (root / "dist" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (root / "dist" / ".metadata").write_bytes(b"meta")
    (root / "config.yaml").write_text("steps: 1\n")
    return root


def test_manifest_lists_every_file_and_names_the_one_that_differs(tmp_path):
    root = _tree(tmp_path / "ckpt")
    write_manifest(root)
    assert listed(root) == ["config.yaml", "dist/.metadata", "dist/__0_0.distcp"]
    assert verify_checkpoint(root) == "verified"
    for name in listed(root):
        bad = tmp_path / f"bad-{name.replace('/', '_')}"
        shutil.copytree(root, bad)
        flip(bad / name)
        with pytest.raises(CheckpointDigestError) as err:
            verify_checkpoint(bad)
        line = str(err.value)
        assert "\n" not in line and line.startswith(mismatch(bad, name)) and line.endswith(
            f"): the file is corrupt or was edited; {HINT}"), line
        assert verify_checkpoint(bad, verify=False) == "skipped"
        with verification(False):
            assert verify_checkpoint(bad) == "skipped"
    truncated = shutil.copytree(root, tmp_path / "truncated")
    (truncated / "config.yaml").write_text("steps")
    with pytest.raises(CheckpointDigestError, match=r"file config\.yaml has 5 bytes, digests\.json lists 9: the file "
                                                    r"is truncated, corrupt or was edited; --no-verify"):
        verify_checkpoint(truncated)
    missing = shutil.copytree(root, tmp_path / "missing")
    (missing / "dist" / ".metadata").unlink()
    with pytest.raises(CheckpointDigestError, match=rf"^checkpoint {missing}: file dist/\.metadata is listed in "
                                                    r"digests\.json but missing: the checkpoint is incomplete"):
        verify_checkpoint(missing)


def test_a_large_file_read_as_blocks_gets_the_crc32_of_its_bytes(tmp_path, monkeypatch):
    import random
    import zlib

    import megatron_spo.checkpoint_digest as cd

    rng = random.Random(0)
    for _ in range(50):
        a, b = rng.randbytes(rng.randint(0, 300)), rng.randbytes(rng.randint(0, 300))
        assert cd.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    monkeypatch.setattr(cd, "BLOCK", 1000)  # 0 to 8 blocks a file
    sizes = [0, 1, 999, 1000, 1001, 7777]
    for size in sizes:
        (tmp_path / f"f{size}").write_bytes(rng.randbytes(size))
    found = cd.digest_files(tmp_path, [f"f{size}" for size in sizes])
    assert found == {f"f{n}": (n, f"{zlib.crc32((tmp_path / f'f{n}').read_bytes()):08x}") for n in sizes}


def test_a_step_manifest_covers_its_dist_folder_and_a_crafted_manifest_is_refused(tmp_path):
    root = _tree(tmp_path / "iter_0000001")
    write_manifest(root)
    assert verify_checkpoint(root / "dist") == "verified"  # what load_megatron is given
    flip(root / "config.yaml")
    assert verify_checkpoint(root / "dist") == "verified"  # only dist/'s files are read there
    flip(root / "dist" / ".metadata", 0)
    with pytest.raises(CheckpointDigestError, match=rf"checkpoint {root}: file dist/\.metadata digest mismatch"):
        verify_checkpoint(root / "dist")
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["files"]["../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
    (root / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointDigestError, match=r"entry '\.\./\.\./etc/passwd' is not a file name inside"):
        verify_checkpoint(root)


def test_a_checkpoint_without_a_manifest_reads_with_one_note(tmp_path, caplog):
    root = _tree(tmp_path / "old")
    with caplog.at_level(logging.WARNING, logger="megatron_spo.checkpoint_digest"):
        assert verify_checkpoint(root) == "unverified"
        assert verify_checkpoint(root) == "unverified"
    assert [r.getMessage() for r in caplog.records] == [
        f"note: {root} has no digests.json (written before checkpoints carried digests, or not by megatron-spo): "
        "its files are not verified"]


_RANKS = """
import json, sys, torch.distributed as dist, torch.multiprocessing as mp
from pathlib import Path

def work(rank, root, port):
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)  # the parent hosts it (no port race)
    dist.init_process_group("gloo", rank=rank, world_size=2, store=store)
    from megatron_spo.checkpoint_digest import CheckpointDigestError, verify_checkpoint, write_manifest
    root = Path(root)
    if rank == 0:
        (root / "dist").mkdir(parents=True)
        (root / "trainer_state.json").write_text("{}")
    dist.barrier()
    (root / "dist" / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * 5000)
    dist.barrier()
    write_manifest(root, collective=True)
    out = [verify_checkpoint(root, collective=True), verify_checkpoint(root / "dist", collective=True)]
    dist.barrier()
    if rank == 0:
        data = bytearray((root / "dist" / "__1_0.distcp").read_bytes())
        data[2500] ^= 1
        (root / "dist" / "__1_0.distcp").write_bytes(bytes(data))
    dist.barrier()
    try:
        verify_checkpoint(root, collective=True)
    except CheckpointDigestError as err:
        out.append(str(err))
    (root.parent / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()

if __name__ == "__main__":
    from datetime import timedelta
    from megatron_spo.net import hosted_store
    store = hosted_store(2, timedelta(minutes=5))
    mp.start_processes(work, args=(sys.argv[1], store.port), nprocs=2, start_method="spawn")
"""


def test_ranks_share_the_digests_and_raise_the_same_line(tmp_path):
    """A multi-rank save: each rank digests its share and rank 0 writes one manifest; a resume: each rank checks its
    share and every rank raises the same line, naming the file rank 1 checked."""
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    root = tmp_path / "ckpt"
    assert listed(root) == ["dist/__0_0.distcp", "dist/__1_0.distcp", "trainer_state.json"]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero[:2] == one[:2] == ["verified", "verified"]
    assert zero[2] == one[2] and zero[2].startswith(mismatch(root, "dist/__1_0.distcp"))


# ---------------------------------------------------------------------------------------------
# The offline store: its index is its manifest
# ---------------------------------------------------------------------------------------------
def offline_records(seed: int, n: int) -> list:
    from megatron_spo.data.trajectory import Trajectory

    return [Trajectory(prompt_id=t.prompt_id, prompt_tokens=t.prompt_tokens, response_tokens=t.response_tokens,
                       reward=t.reward, source="offline", policy_version=0, q0=-0.4)
            for t in DeterministicSource(seed=seed).take(n)]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    from megatron_spo.data.offline_store import write_store

    path = tmp_path_factory.mktemp("digest_store") / "store"
    write_store(offline_records(3, 6), path)
    return path


def test_every_store_shard_file_with_a_flipped_byte_is_refused_naming_it(store, tmp_path, capsys):
    files = sorted(p.name for p in (store / "shard-00000").iterdir())
    assert len(files) == 19
    for name in files:
        bad = shutil.copytree(store, tmp_path / f"bad-{name}")
        flip(bad / "shard-00000" / name)
        why = (f"{bad}/shard-00000: field '{name}': checksum mismatch (expected sha256 ", "the file is corrupt or "
               f"was edited; {HINT}")
        line = refused(capsys, "trajectories", "check", bad, inputs=(bad,), names=why)
        assert line.startswith(f"megatron-spo trajectories: {bad}/shard-00000: field '{name}'")
        refused(capsys, "offline", "stats", bad, inputs=(bad,), names=why)
        refused(capsys, "trajectories", "export", bad, tmp_path / f"{name}.jsonl", inputs=(bad,), names=why)
        assert not (tmp_path / f"{name}.jsonl").exists()


def test_no_verify_reads_a_store_edited_by_hand(store, tmp_path, capsys):
    from megatron_spo.data.offline_store import OfflineStore, iter_records

    bad = shutil.copytree(store, tmp_path / "edited")
    flip(bad / "shard-00000" / "reward.npy", -8)  # the low byte of the last reward: still a valid reward
    rc, out, err = cli(capsys, "trajectories", "check", bad, "--no-verify")
    assert (rc, out.strip(), err) == (0, f"{bad}: 6 valid records", [])
    rc, out, err = cli(capsys, "offline", "stats", bad, "--no-verify", "--json")
    assert rc == 0 and sum(g["rows"] for g in json.loads(out)) == 6
    assert OfflineStore(bad, verify=False).record(5).reward != OfflineStore(store).record(5).reward
    with verification(False):  # what a trainer with checkpoint.verify=false reads its offline sources with
        assert len(list(iter_records(bad))) == 6
    with pytest.raises(ValueError, match="field 'reward.npy': checksum mismatch"):
        list(iter_records(bad))


# ---------------------------------------------------------------------------------------------
# The trainer's checkpoint and HF export, convert, check-conversion and resume
# ---------------------------------------------------------------------------------------------
def _config(root: Path, run_dir: Path, steps: int) -> Path:
    cfg = dict(run_dir=str(run_dir), steps=steps, beta=0.5, init={"hf": str(root / "init_hf")}, nproc=1,
               sources={"offline": {"path": str(root / "offline.jsonl"), "objective": "reverse_q",
                                    "loss": "squared"}},
               optimizer={"lr": 2e-3, "warmup_steps": 0},
               batch={"sequences_per_step": 4, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               checkpoint={"interval": 1}, logging={"progress": False})
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(config: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_spo.cli", "train", str(config), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _train(config: Path, *flags: str) -> subprocess.CompletedProcess:
    return _finish(_start(config, *flags))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from megatron_spo.data.trajectory import write_jsonl

    root = tmp_path_factory.mktemp("digest_run")
    make_tiny_hf(str(root / "init_hf"))
    write_jsonl(offline_records(7, 8), root / "offline.jsonl")
    proc = _train(_config(root, root / "run", steps=1))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    step = root / "run" / "checkpoints" / "iter_0000001"
    return {"root": root, "run_dir": root / "run", "step": step, "hf": root / "run" / "hf"}


def test_the_trainer_checkpoint_and_its_export_list_every_file(run):
    step, hf = run["step"], run["hf"]
    names = listed(step)
    assert {"dist/.metadata", "dist/common.pt", "dist/metadata.json", "rng_rank00000.pt", "trainer_state.json",
            "config.yaml", "model_config.json"} <= set(names)
    assert [n for n in names if n.endswith(".distcp")] == ["dist/__0_0.distcp"]
    assert "COMPLETE" not in names and sorted(names + ["COMPLETE", MANIFEST]) == sorted(
        p.relative_to(step).as_posix() for p in step.rglob("*") if p.is_file())
    assert {"config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"} <= set(listed(hf))
    assert sorted(listed(hf) + [MANIFEST]) == sorted(p.name for p in hf.iterdir())
    assert verify_checkpoint(step) == verify_checkpoint(hf) == "verified"


def test_a_flipped_byte_in_a_trainer_checkpoint_is_refused_by_convert_and_check_conversion(run, tmp_path, capsys):
    for name in [n for n in listed(run["step"]) if n.endswith(".distcp")]:  # every tensor data file
        bad = shutil.copytree(run["step"], tmp_path / "iter_0000001")
        flip(bad / name)
        why = (mismatch(bad, name), f"): the file is corrupt or was edited; {HINT}")
        line = refused(capsys, "convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out",
                       inputs=(bad,), names=why)
        assert line.startswith(f"megatron-spo convert: error: {mismatch(bad, name)}")
        refused(capsys, "check-conversion", "--hf", run["hf"], "--megatron", bad, "--no-progress", inputs=(bad,),
                names=why)
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
        shutil.rmtree(bad)


def test_a_flipped_byte_in_an_hf_export_is_refused_by_convert_and_check_conversion(run, tmp_path, capsys):
    for name in [n for n in listed(run["hf"]) if n.endswith(".safetensors")]:
        bad = shutil.copytree(run["hf"], tmp_path / "hf")
        flip(bad / name)
        why = (mismatch(bad, name),)
        refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "out", inputs=(bad,),
                names=why)
        refused(capsys, "check-conversion", "--hf", bad, "--megatron", run["step"], "--no-progress", inputs=(bad,),
                names=why)
        assert not (tmp_path / "out").exists()
        shutil.rmtree(bad)


def test_no_verify_converts_a_hand_edited_checkpoint_and_the_edit_shows(run, tmp_path, capsys):
    """The issue's finding, now on purpose: with --no-verify the flipped byte converts (exit 0) and exactly the
    tensor it lies in differs from the trainer's own export; check-conversion names it."""
    bad = shutil.copytree(run["step"], tmp_path / "iter_0000001")
    export = all_tensors(run["hf"])
    flip_in_tensor(bad / "dist" / "__0_0.distcp", export[EDITED])
    rc, out, err = cli(capsys, "convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out",
                       "--no-verify")
    assert rc == 0 and out.strip().splitlines()[-1] == f"wrote {tmp_path / 'out'}", err  # after the warnings' line
    ours = all_tensors(tmp_path / "out")
    assert ours.keys() == export.keys() and [k for k in export if not ours[k].equal(export[k])] == [EDITED]
    assert verify_checkpoint(tmp_path / "out") == "verified"  # the output lists its own (edited) bytes
    rc, out, _ = cli(capsys, "check-conversion", "--hf", run["hf"], "--megatron", bad, "--no-progress",
                     "--no-verify")
    assert rc == 1 and out.strip().splitlines()[-1].startswith(f"FAIL: first disagreement: tensor {EDITED} differs")


def test_a_checkpoint_written_before_the_manifest_converts_with_one_note(run, tmp_path, capsys, caplog):
    old = shutil.copytree(run["step"], tmp_path / "iter_0000001")
    (old / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="megatron_spo.checkpoint_digest"):
        rc, out, err = cli(capsys, "convert", "megatron-to-hf", "--megatron", old, "--out", tmp_path / "out")
    assert (rc, err) == (0, [])
    assert [r.getMessage() for r in caplog.records] == [
        f"note: {old} has no digests.json (written before checkpoints carried digests, or not by megatron-spo): "
        "its files are not verified"]
    ours, export = all_tensors(tmp_path / "out"), all_tensors(run["hf"])
    assert ours.keys() == export.keys() and all(ours[k].equal(export[k]) for k in export)


def test_resume_refuses_a_flipped_byte_and_train_no_verify_resumes(run, tmp_path):
    """`megatron-spo train` resuming a run whose checkpoint has a flipped byte in its tensor data: refused in one
    line naming the file; with --no-verify it resumes; with no manifest at all (an older run) it resumes with the
    note. (The copies live elsewhere: --allow-config-change lets run_dir differ from the checkpoint's.)"""
    runs = {}
    for case in ("flipped", "no-verify", "legacy"):  # a copy each: the three run at once
        runs[case] = shutil.copytree(run["run_dir"], tmp_path / case)
        step = runs[case] / "checkpoints" / "iter_0000001"
        flip_in_tensor(step / "dist" / "__0_0.distcp", all_tensors(run["hf"])[EDITED])
        if case == "legacy":
            (step / MANIFEST).unlink()
    flipped, edited, legacy = (runs[case] / "checkpoints" / "iter_0000001" for case in runs)
    started = [_start(_config(run["root"], runs["flipped"], steps=1), "--allow-config-change"),
               _start(_config(run["root"], runs["no-verify"], steps=1), "--allow-config-change", "--no-verify"),
               _start(_config(run["root"], runs["legacy"], steps=1), "--allow-config-change")]
    proc, no_verify, old = (_finish(p) for p in started)
    lines = [ln for ln in proc.stderr.splitlines() if "digest mismatch" in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == proc.stderr.strip().splitlines()[-1]
    assert lines[0].startswith(f"megatron-spo train: error: {mismatch(flipped, 'dist/__0_0.distcp')}")
    assert lines[0].endswith(f"): the file is corrupt or was edited; {HINT}")
    assert "resumed from" not in proc.stdout

    assert no_verify.returncode == 0, no_verify.stdout[-2000:] + no_verify.stderr[-2000:]
    assert f"resumed from {edited} at step 1" in no_verify.stdout

    assert old.returncode == 0, old.stdout[-2000:] + old.stderr[-2000:]
    assert f"resumed from {legacy} at step 1" in old.stdout
    assert old.stderr.count(f"note: {legacy} has no digests.json") == 1, old.stderr[-2000:]
