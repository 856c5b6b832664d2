"""Files we did not write, corrupted or crafted on purpose (issue 28): every reader refuses them with one line
naming the file (and the tensor or field), exits non-zero, changes no input, leaves no temporary file, and a
checkpoint never runs code (a crafted pickle's marker file is never created)."""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
import models_helpers as mh  # noqa: E402

pytestmark = [pytest.mark.megatron]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def tree_hash(path: Path) -> str:
    """Names and bytes of every file under ``path`` (dotfiles included), or of the one file."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def cli(capsys, *argv: str) -> tuple[int, str, list[str]]:
    from megatron_spo.cli import main

    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err.splitlines()


def refused(capsys, *argv, inputs: tuple[Path, ...] = (), names: tuple[str, ...] = ()) -> str:
    """Run the CLI in-process on a hostile input: non-zero exit, exactly one stderr line naming ``names``,
    the inputs byte-identical afterwards. Returns the line."""
    before = [tree_hash(p) for p in inputs]
    rc, _, lines = cli(capsys, *argv)
    assert rc != 0, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    assert [tree_hash(p) for p in inputs] == before
    return lines[0]


def no_leftovers(*dirs: Path) -> None:
    for d in dirs:
        assert not d.exists(), d
        assert not d.with_name(d.name + ".tmp").exists(), d


class Reduce:
    """An object whose unpickling calls fn(*args): what an attacker puts in a checkpoint."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def payloads(marker: Path) -> dict[str, Reduce]:
    return {
        "os.system": Reduce(os.system, f"touch {marker}"),
        "subprocess": Reduce(subprocess.call, ["touch", str(marker)]),
        "exec": Reduce(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny 2-layer sharded HF Llama and its Megatron conversion (read-only: tests corrupt copies)."""
    root = tmp_path_factory.mktemp("hostile")
    hf = mh.make_tiny_llama(root / "hf", num_layers=2)
    meg = root / "meg"
    from megatron_spo.models.convert import hf_to_megatron

    hf_to_megatron(hf, meg)
    return hf, meg


def copy(src: Path, dst: Path) -> Path:
    """A copy to damage, without the digest manifest conversion wrote: a checkpoint crafted elsewhere carries none
    of ours (or one made to match), so these tests meet the checks that stand behind the digests
    (tests/test_checkpoint_digest.py: a damaged file under its manifest is refused by the digest itself)."""
    shutil.copytree(src, dst)
    (dst / "digests.json").unlink(missing_ok=True)
    return dst


# ---------------------------------------------------------------------------------------------
# 1. checkpoints are data, never code
# ---------------------------------------------------------------------------------------------
def test_crafted_metadata_pickle_runs_nothing_in_a_real_cli_process(ckpts, tmp_path):
    """The attack of issue 28 end to end: `megatron-spo convert megatron-to-hf` on a checkpoint whose .metadata
    calls os.system; a subprocess, so exit code and stderr are exactly what a user sees."""
    _, meg = ckpts
    marker = tmp_path / "PWNED"
    bad = copy(meg, tmp_path / "meg")
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(payloads(marker)["os.system"], f)
    before = tree_hash(bad)
    # --no-verify: neither input has a digest manifest, and the one-line note saying so is not under test here
    for argv in (("convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out", "--no-verify"),
                 ("check-conversion", "--hf", ckpts[0], "--megatron", bad, "--no-progress", "--no-verify")):
        proc = mh.run_cli(*map(str, argv), check=False)
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"{bad}/.metadata: refused: its pickle asks for global 'posix.system'" in lines[0]
        assert not marker.exists()
    assert tree_hash(bad) == before
    no_leftovers(tmp_path / "out")


def test_crafted_pickle_in_a_trainer_run_dir_runs_nothing(ckpts, tmp_path, capsys):
    """convert megatron-to-hf of RUN_DIR (latest complete step's dist/): refused before any key is looked up."""
    _, meg = ckpts
    marker = tmp_path / "PWNED"
    step = tmp_path / "run" / "checkpoints" / "iter_0000003"
    copy(meg, step / "dist")
    shutil.copy(meg / "model_config.json", step / "model_config.json")
    (step / "COMPLETE").write_text("{}")
    with open(step / "dist" / ".metadata", "wb") as f:
        pickle.dump(payloads(marker)["subprocess"], f)
    for path in (tmp_path / "run", step):
        refused(capsys, "convert", "megatron-to-hf", "--megatron", path, "--out", tmp_path / "out",
                inputs=(tmp_path / "run",), names=(f"{step}/dist/.metadata: refused", "'subprocess.call'"))
    assert not marker.exists()
    no_leftovers(tmp_path / "out")


@pytest.mark.parametrize("how", ["os.system", "subprocess", "exec", "nested"])
def test_crafted_metadata_is_refused_naming_the_global(ckpts, tmp_path, capsys, how):
    _, meg = ckpts
    marker = tmp_path / "PWNED"
    bad = copy(meg, tmp_path / "meg")
    if how == "nested":  # a real Metadata with the payload hidden in one of its fields
        from megatron_spo.models.dcp_metadata import read_dcp_metadata

        md = read_dcp_metadata(meg)
        md.planner_data = {"x": payloads(marker)["os.system"]}
        evil, forbidden = md, "posix.system"
    else:
        evil = payloads(marker)[how]
        forbidden = {"os.system": "posix.system", "subprocess": "subprocess.call", "exec": "builtins.exec"}[how]
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(evil, f)
    line = refused(capsys, "convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out",
                   inputs=(bad,), names=(f"{bad}/.metadata", f"'{forbidden}'"))
    assert line.startswith("megatron-spo convert: error: ")
    assert not marker.exists()
    no_leftovers(tmp_path / "out")


def test_byte_item_that_unpickles_code_is_refused(ckpts, tmp_path, capsys):
    """megatron's _extra_state items are read by torch with weights_only=False: a blob calling os.system,
    appended to the .distcp and pointed at by an otherwise valid .metadata."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from megatron_spo.models.dcp_metadata import read_dcp_metadata

    _, meg = ckpts
    marker = tmp_path / "PWNED"
    bad = copy(meg, tmp_path / "meg")
    md = read_dcp_metadata(bad)
    index, info = next((i, s) for i, s in md.storage_data.items()
                       if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata))
    buf = io.BytesIO()
    torch.save(payloads(marker)["os.system"], buf)
    distcp = bad / info.relative_path
    start = distcp.stat().st_size
    with open(distcp, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[index] = _StorageInfo(info.relative_path, start, len(buf.getvalue()))
    md.storage_meta = None
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(md, f)
    refused(capsys, "convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out", inputs=(bad,),
            names=(str(distcp), f"byte item '{index.fqn}'", "refused", "posix.system"))
    assert not marker.exists()
    no_leftovers(tmp_path / "out")


def test_rng_state_file_that_unpickles_code_is_refused(tmp_path):
    from megatron_spo.models.dcp_metadata import CheckpointFileError
    from megatron_spo.run_layout import rng_state
    from megatron_spo.training.checkpoint import load_rng_file

    good = tmp_path / "rng_rank00000.pt"
    torch.save(rng_state(), good)
    assert torch.equal(load_rng_file(good)["torch"], rng_state()["torch"])  # the real state loads
    marker = tmp_path / "PWNED"
    bad = tmp_path / "rng_rank00001.pt"
    torch.save({"python": payloads(marker)["os.system"]}, bad)
    with pytest.raises(CheckpointFileError) as info:
        load_rng_file(bad)
    assert str(info.value) == (f"{bad}: refused: it asks for global 'posix.system' "
                               f"(an RNG state file is data, never code)")
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated-distcp", "outside", "chunk-outside", "common",
                                    "record-header", "no-metadata", "metadata-json", "int8"])
def test_damaged_dist_checkpoint_is_one_line_naming_the_file(ckpts, tmp_path, capsys, damage):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from megatron_spo.models.dcp_metadata import read_dcp_metadata

    _, meg = ckpts
    bad = copy(meg, tmp_path / "meg")
    md = read_dcp_metadata(bad)
    distcp = bad / next(iter(md.storage_data.values())).relative_path
    if damage == "garbage":
        (bad / ".metadata").write_bytes(os.urandom(300))
        names = (f"{bad}/.metadata",)
    elif damage == "empty":
        (bad / ".metadata").write_bytes(b"")
        names = (f"{bad}/.metadata: not a torch.distributed.checkpoint metadata file",)
    elif damage == "truncated-distcp":
        with open(distcp, "r+b") as f:
            f.truncate(distcp.stat().st_size // 2)
        names = (f"{distcp}: truncated: item '",)
    elif damage in ("outside", "chunk-outside"):
        index, info = next(iter((i, s) for i, s in md.storage_data.items() if i.offset is not None))
        if damage == "outside":
            md.storage_data[index] = _StorageInfo("../../etc/passwd", 0, 10)
            names = (f"{bad}/.metadata", f"item '{index.fqn}' points outside the checkpoint")
        else:
            md.state_dict_metadata[index.fqn].chunks[0].offsets = torch.Size([5] * len(index.offset))
            names = (f"{bad}/.metadata", f"tensor '{index.fqn}' has a chunk at", "outside its size")
        md.storage_meta = None
        with open(bad / ".metadata", "wb") as f:
            pickle.dump(md, f)
    elif damage == "common":
        marker = tmp_path / "PWNED"
        torch.save(payloads(marker)["exec"], bad / "common.pt")
        names = (f"{bad}/common.pt: refused: it asks for global 'exec'",)
    elif damage == "record-header":  # bit rot in one tensor's torch.save record, inside the file's range
        index, info = next((i, s) for i, s in md.storage_data.items() if "linear_fc2.weight" in i.fqn)
        with open(distcp, "r+b") as f:
            f.seek(info.offset)
            f.write(b"A" * 200)
        names = (f"{bad}: reading tensor 'decoder.layers.mlp.linear_fc2.weight' failed: unreadable",)
    elif damage == "int8":  # a quantized checkpoint: never cast to float silently
        md.state_dict_metadata["decoder.final_layernorm.weight"].properties.dtype = torch.int8
        md.storage_meta = None
        with open(bad / ".metadata", "wb") as f:
            pickle.dump(md, f)
        names = (f"{bad}: tensor 'decoder.final_layernorm.weight' is stored as torch.int8: quantized",)
    elif damage == "no-metadata":
        (bad / ".metadata").unlink()
        names = (f"{bad}/.metadata: missing",)
    else:
        (bad / "metadata.json").write_text('{"sharded_backend": ')
        names = (f"{bad}/metadata.json: invalid JSON",)
    refused(capsys, "convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out", inputs=(bad,),
            names=names)
    no_leftovers(tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# 2. conversion checks the whole correspondence, finite float weights only
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, names", [
    ("num_layers", 1, ("field 'num_layers' says 1", "holds 2 layers", "decoder.layers.")),
    ("tie_word_embeddings", True, ("stored tensor 'output_layer.weight'", "field 'tie_word_embeddings'")),
    ("ffn_hidden_size", 128, ("'decoder.layers.mlp.linear_fc1.weight' of shape [2, 256, 64]", "[2, 192, 64]",
                              "field 'ffn_hidden_size'")),
    ("num_attention_heads", 0, ("model_config.json: field 'num_attention_heads': Input should be greater than 0",)),
    ("norm_epsilon", -1.0, ("model_config.json: field 'norm_epsilon'",)),
])
def test_model_config_that_disagrees_with_the_tensors_names_tensor_and_field(ckpts, tmp_path, capsys, field, value,
                                                                           names):
    _, meg = ckpts
    bad = copy(meg, tmp_path / "meg")
    cfg = json.loads((bad / "model_config.json").read_text())
    cfg[field] = value
    (bad / "model_config.json").write_text(json.dumps(cfg))
    refused(capsys, "convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out", inputs=(bad,),
            names=(str(bad),) + names)
    no_leftovers(tmp_path / "out")


def test_model_config_that_is_not_json_or_not_an_object(ckpts, tmp_path, capsys):
    _, meg = ckpts
    bad = copy(meg, tmp_path / "meg")
    for text, what in (("{", "invalid JSON"), ("[1, 2]", "not a JSON object"), ("[" * 100000, "invalid JSON")):
        (bad / "model_config.json").write_text(text)
        refused(capsys, "convert", "megatron-to-hf", "--megatron", bad, "--out", tmp_path / "out", inputs=(bad,),
                names=(f"{bad}/model_config.json: {what}",))
    no_leftovers(tmp_path / "out")


def _single_file_hf(hf: Path, dst: Path, tensors: dict) -> Path:
    dst.mkdir()
    shutil.copy(hf / "config.json", dst / "config.json")
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_nonfinite_weights_refused_by_name_both_ways_unless_allowed(ckpts, tmp_path, capsys):
    hf, _ = ckpts
    tensors = mh.all_tensors(hf)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    bad = _single_file_hf(hf, tmp_path / "nan-hf", tensors)
    refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", inputs=(bad,),
            names=(f"{bad}: tensor 'model.layers.1.mlp.down_proj.weight' holds a non-finite value (nan",
                   "--allow-nonfinite"))
    no_leftovers(tmp_path / "meg")
    # forensics: the flag converts it, and the way back refuses the NaN by its HF name
    rc, _, lines = cli(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", "--allow-nonfinite")
    assert rc == 0, lines
    refused(capsys, "check-conversion", "--hf", bad, "--megatron", tmp_path / "meg", "--no-progress",
            inputs=(bad, tmp_path / "meg"),
            names=(f"{bad}: tensor 'model.layers.1.mlp.down_proj.weight' holds a non-finite value",))
    refused(capsys, "convert", "megatron-to-hf", "--megatron", tmp_path / "meg", "--out", tmp_path / "back",
            inputs=(tmp_path / "meg",), names=("tensor 'model.layers.1.mlp.down_proj.weight' holds a non-finite",))
    no_leftovers(tmp_path / "back")


@pytest.mark.parametrize("dtype, name", [(torch.int8, "I8"), (torch.uint8, "U8"), (torch.int32, "I32")])
def test_integer_or_quantized_weights_are_refused_by_name(ckpts, tmp_path, capsys, dtype, name):
    hf, _ = ckpts
    tensors = mh.all_tensors(hf)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].to(dtype)
    bad = _single_file_hf(hf, tmp_path / "int-hf", tensors)
    refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", inputs=(bad,),
            names=(f"{bad}: tensor 'model.layers.0.self_attn.q_proj.weight' is stored as {name}",))
    no_leftovers(tmp_path / "meg")


# ---------------------------------------------------------------------------------------------
# 3. safetensors headers, index files, config.json fields
# ---------------------------------------------------------------------------------------------
def _shard(hf: Path, i: int = 1) -> Path:
    return sorted(hf.glob("*.safetensors"))[i]


@pytest.mark.parametrize("damage", ["header-1e15", "header-json", "header-list", "offsets", "truncated", "dtype",
                                    "shape-vs-bytes"])
def test_corrupt_safetensors_shard_is_one_line_naming_the_file(ckpts, tmp_path, capsys, damage):
    hf, _ = ckpts
    bad = copy(hf, tmp_path / "hf")
    shard = _shard(bad)
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    first = next(k for k in header if k != "__metadata__")

    def with_header(h: dict) -> bytes:
        text = json.dumps(h).encode()
        return struct.pack("<Q", len(text)) + text + raw[8 + n:]

    if damage == "header-1e15":
        data, names = struct.pack("<Q", 10**15) + raw[8:], (f"{shard}: not a safetensors file (header length",)
    elif damage == "header-json":
        data, names = raw[:8] + b"{" * n + raw[8 + n:], (f"{shard}: not a safetensors file (header is not JSON",)
    elif damage == "header-list":
        data, names = with_header([1, 2]), (f"{shard}: not a safetensors file (header is not a JSON object)",)
    elif damage == "offsets":
        header[first]["data_offsets"] = [0, 10**12]
        data, names = with_header(header), (f"{shard}: tensor '{first}' has data_offsets",)
    elif damage == "truncated":
        data, names = raw[:len(raw) - 16], (f"{shard}: tensor '", "outside the data section")
    elif damage == "dtype":
        header[first]["dtype"] = "Q4_K"
        data, names = with_header(header), (f"{shard}: tensor '{first}' has unknown dtype 'Q4_K'",)
    else:
        header[first]["shape"] = [1, 1]
        data, names = with_header(header), (f"{shard}: tensor '{first}' spans",)
    shard.write_bytes(data)
    refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", inputs=(bad,), names=names)
    no_leftovers(tmp_path / "meg")


@pytest.mark.parametrize("cut", [1, 4096, 10**9])
def test_truncated_single_file_checkpoint(ckpts, tmp_path, capsys, cut):
    """model.safetensors without an index, cut short (1 byte: no header length; 4096: inside the data)."""
    hf, _ = ckpts
    bad = _single_file_hf(hf, tmp_path / "hf", mh.all_tensors(hf))
    single = bad / "model.safetensors"
    raw = single.read_bytes()
    single.write_bytes(raw[:1] if cut == 1 else raw[:len(raw) - cut] if cut < len(raw) else b"")
    refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", inputs=(bad,),
            names=(f"{single}: ",))
    no_leftovers(tmp_path / "meg")


@pytest.mark.parametrize("damage", ["wrong-shard", "traversal", "not-json", "weight-map-list", "unlisted"])
def test_index_that_disagrees_with_the_shards(ckpts, tmp_path, capsys, damage):
    hf, _ = ckpts
    bad = copy(hf, tmp_path / "hf")
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    if damage == "wrong-shard":
        other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
        index["weight_map"][name] = other
        names = (f"{bad}: tensor '{name}' is indexed in '{other}', which does not hold it",)
    elif damage == "traversal":
        index["weight_map"][name] = "../hf/" + index["weight_map"][name]
        names = (f"{index_path}: tensor '{name}' is indexed in '../hf/",)
    elif damage == "weight-map-list":
        index["weight_map"] = [name]
        names = (f"{index_path}: 'weight_map' is not an object",)
    elif damage == "unlisted":  # a shard holding a tensor the index does not list: it would be dropped silently
        shard = bad / index["weight_map"][name]
        tensors = {**mh.all_tensors(bad), "model.layers.0.extra.weight": torch.zeros(2)}
        mine = {k: v for k, v in tensors.items() if index["weight_map"].get(k) == shard.name}
        save_file({**mine, "model.layers.0.extra.weight": torch.zeros(2)}, shard)
        names = (f"{bad}: shard '{shard.name}' holds tensor 'model.layers.0.extra.weight', which "
                 f"model.safetensors.index.json does not list in it",)
    if damage == "not-json":
        index_path.write_text("[" * 100000)
        names = (f"{index_path}: not a safetensors index",)
    else:
        index_path.write_text(json.dumps(index))
    refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", inputs=(bad,), names=names)
    no_leftovers(tmp_path / "meg")


@pytest.mark.parametrize("field, value, names", [
    ("num_attention_heads", 0, ("field 'num_attention_heads': Input should be greater than 0 (got 0)",)),
    ("rms_norm_eps", -1, ("field 'rms_norm_eps': Input should be greater than 0 (got -1",)),
    ("num_hidden_layers", -2, ("field 'num_hidden_layers'",)),
    ("intermediate_size", "big", ("field 'intermediate_size'",)),
    ("hidden_size", json.loads("[" * 50 + "]" * 50), ("field 'hidden_size'",)),
])
def test_config_json_fields_that_make_no_sense_are_named(ckpts, tmp_path, capsys, field, value, names):
    hf, _ = ckpts
    bad = copy(hf, tmp_path / "hf")
    cfg = json.loads((bad / "config.json").read_text())
    cfg[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", inputs=(bad,),
            names=(f"{bad}/config.json: ",) + names)
    no_leftovers(tmp_path / "meg")


def test_config_json_that_is_not_json(ckpts, tmp_path, capsys):
    hf, _ = ckpts
    bad = copy(hf, tmp_path / "hf")
    for text, what in (("[" * 100000, "unreadable JSON (RecursionError)"), ("[1]", "not a JSON object"),
                       ("{", "invalid JSON")):
        (bad / "config.json").write_text(text)
        refused(capsys, "convert", "hf-to-megatron", "--hf", bad, "--out", tmp_path / "meg", inputs=(bad,),
                names=(f"{bad}/config.json: {what}",))
    no_leftovers(tmp_path / "meg")


def test_inputs_that_are_files_or_missing(ckpts, tmp_path, capsys):
    hf, meg = ckpts
    a_file = tmp_path / "file"
    a_file.write_text("x")
    refused(capsys, "convert", "hf-to-megatron", "--hf", a_file, "--out", tmp_path / "o1", inputs=(a_file,),
            names=(str(a_file),))
    refused(capsys, "convert", "megatron-to-hf", "--megatron", a_file, "--out", tmp_path / "o2", inputs=(a_file,),
            names=(str(a_file),))
    no_leftovers(tmp_path / "o1", tmp_path / "o2")


def _rehash(store: Path, shard: str, file: str) -> None:
    """Make the index agree with a changed file (an attacker writes both)."""
    index = json.loads((store / "index.json").read_text())
    entry = next(e for e in index["shards"] if e["name"] == shard)
    entry["files"][file] = hashlib.sha256((store / shard / file).read_bytes()).hexdigest()
    (store / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("damage", ["name-outside", "rows-negative", "npy-pickle", "npy-garbage", "strings-deep",
                                    "prompt-id-object", "source-empty"])
def test_store_whose_index_agrees_with_crafted_files_is_refused(tmp_path, capsys, damage):
    """A store we did not write: its checksums match (whoever wrote the files wrote the index), so every
    value is checked before it is trusted; one line naming the shard and file."""
    import numpy as np

    store = _store(tmp_path, capsys)
    shard = store / "shard-00000"
    index = json.loads((store / "index.json").read_text())
    if damage == "name-outside":
        index["shards"][0]["name"] = "../../etc"
        (store / "index.json").write_text(json.dumps(index))
        names = (f"{store}/index.json: field 'shards': entry '../../etc' is not a shard folder name",)
    elif damage == "rows-negative":
        index["shards"][0]["rows"] = -1
        (store / "index.json").write_text(json.dumps(index))
        names = (f"{store}/index.json: field 'shards': entry 'shard-00000' lacks rows",)
    elif damage in ("npy-pickle", "npy-garbage"):
        marker = tmp_path / "PWNED"
        with open(shard / "reward.npy", "wb") as f:
            if damage == "npy-pickle":
                np.save(f, np.array([payloads(marker)["os.system"]] * 2, dtype=object), allow_pickle=True)
            else:
                f.write(b"\x93NUMPY garbage")
        _rehash(store, "shard-00000", "reward.npy")
        names = (f"{shard}: field 'reward.npy': not a plain numpy array file",)
        assert not marker.exists()
    else:
        strings = json.loads((shard / "strings.json").read_text())
        if damage == "strings-deep":
            (shard / "strings.json").write_text("[" * 100000)
            names = (f"{shard}: field 'strings.json': not the strings of a version 2 shard",)
        elif damage == "prompt-id-object":
            strings["prompt_id"][1] = {"$ne": 1}
            (shard / "strings.json").write_text(json.dumps(strings))
            names = (f"{shard}: field 'strings.json': row 1: prompt_id must be a string or an integer, got dict",)
        else:
            strings["source"][0] = ""
            (shard / "strings.json").write_text(json.dumps(strings))
            names = (f"{shard}: field 'strings.json': row 0: source must be a non-empty string",)
        _rehash(store, "shard-00000", "strings.json")
    refused(capsys, "trajectories", "export", store, tmp_path / "o.jsonl", inputs=(store,), names=names)
    assert not (tmp_path / "o.jsonl").exists()
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------------------------------
# 4. writers never overwrite what they did not create
# ---------------------------------------------------------------------------------------------
def test_convert_refuses_an_existing_output_both_directions(ckpts, tmp_path, capsys):
    hf, meg = ckpts
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    for argv in (("convert", "hf-to-megatron", "--hf", hf, "--out", out),
                 ("convert", "megatron-to-hf", "--megatron", meg, "--out", out)):
        refused(capsys, *argv, inputs=(hf, meg, out), names=(f"output directory '{out}' already exists",))
    assert not out.with_name("out.tmp").exists()


# ---------------------------------------------------------------------------------------------
# 3. trajectory files and offline stores (JSON depth, integer ranges, settings, paths)
# ---------------------------------------------------------------------------------------------
GOOD = {"prompt_id": "p1", "prompt_tokens": [1, 2], "response_tokens": [3, 4], "reward": 1.0, "source": "offline",
        "policy_version": 0}


def _jsonl(path: Path, *lines) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _store(tmp_path: Path, capsys, name: str = "store") -> Path:
    src = _jsonl(tmp_path / f"{name}.jsonl", GOOD, {**GOOD, "prompt_id": "p2"})
    rc, _, lines = cli(capsys, "trajectories", "import", src, tmp_path / name)
    assert rc == 0, lines
    return tmp_path / name


def _no_tmp(root: Path) -> None:
    assert not [p for p in root.rglob("*") if p.name.endswith((".tmp", ".building"))], list(root.rglob("*"))


def test_deep_json_line_is_one_line_and_skippable(tmp_path, capsys):
    deep = "[" * 100000 + "]" * 100000
    src = _jsonl(tmp_path / "deep.jsonl", GOOD, deep)
    for op in (("import", src, tmp_path / "s"), ("check", src)):
        refused(capsys, "trajectories", *op, inputs=(src,), names=(f"{src}:2: not a record: JSON nested too deeply",))
    assert not (tmp_path / "s").exists()
    rc, _, lines = cli(capsys, "trajectories", "import", src, tmp_path / "s", "--skip-invalid")
    assert rc == 0 and lines == ["skipped 1 invalid record(s):", f"  {src}:2: not a record: JSON nested too deeply"]
    from megatron_spo.data.offline_store import OfflineStore

    assert [r.prompt_id for r in OfflineStore(tmp_path / "s").trajectories()] == ["p1"]


@pytest.mark.parametrize("field, value, message", [
    ("response_tokens", [3, 2**63], "field 'response_tokens': item 1 must be a token id (int in [0, 2^31)), got 9223"),
    ("prompt_tokens", [2**31], "field 'prompt_tokens': item 0 must be a token id"),
    ("prompt_tokens", [-1], "field 'prompt_tokens': item 0 must be a token id"),
    ("policy_version", 2**64, "field 'policy_version': must be an integer >= 0 (and < 2^63), got 18446744073709551616"),
    ("prompt_id", 2**70, "field 'prompt_id': must be a string or an integer (64-bit)"),
])
def test_integers_out_of_range_name_file_line_and_field(tmp_path, capsys, field, value, message):
    src = _jsonl(tmp_path / "in.jsonl", GOOD, {**GOOD, field: value})
    refused(capsys, "trajectories", "import", src, tmp_path / "s", inputs=(src,), names=(f"{src}:2: {message}",))
    assert not (tmp_path / "s").exists()
    _no_tmp(tmp_path)


def test_a_shard_that_cannot_be_written_leaves_no_temporary_files(tmp_path):
    """Records that bypass validation (a Trajectory built in code with a token id past int32): the writer
    refuses before it creates a file, and the store keeps only what it had."""
    from megatron_spo.data.offline_store import OfflineStoreWriter, StoreError
    from megatron_spo.data.trajectory import Trajectory

    bad = Trajectory(prompt_id="p", prompt_tokens=[1], response_tokens=[2**40], reward=0.0, source="x",
                     policy_version=0)
    with pytest.raises(StoreError, match="does not fit int32"):
        with OfflineStoreWriter(tmp_path / "s", rows_per_shard=1) as w:
            w.add(bad)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == []


def test_settings_and_paths_that_make_no_sense(tmp_path, capsys):
    src = _jsonl(tmp_path / "in.jsonl", GOOD)
    store = _store(tmp_path, capsys)
    a_file = _jsonl(tmp_path / "a.jsonl", GOOD)
    for argv in (("trajectories", "import", src, tmp_path / "s0", "--rows-per-shard", "0"),
                 ("offline", "build", store, "--out", tmp_path / "b0", "--rows-per-shard", "0"),
                 ("offline", "build", store, "--out", tmp_path / "b0", "--cap-per-prompt", "0"),
                 ("offline", "import-taco", src, "--store", tmp_path / "s0", "--max-per-problem", "-1")):
        with pytest.raises(SystemExit) as info:  # argparse: usage, then the line naming the flag
            cli(capsys, *argv)
        flag = argv[-2]
        assert info.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(
            f"error: argument {flag}: '{argv[-1]}' is not a positive integer")
    from megatron_spo.data.offline_store import OfflineStoreWriter, StoreError

    with pytest.raises(StoreError, match="^offline store: rows per shard must be an integer >= 1, got 0$"):
        OfflineStoreWriter(tmp_path / "s0", rows_per_shard=0)
    cases = [
        (("trajectories", "import", src, a_file), f"'{a_file}' is a file, not a store folder"),
        (("trajectories", "export", a_file, tmp_path / "o.jsonl"), f"'{a_file}' is a file, not a store folder"),
        (("trajectories", "import", tmp_path, tmp_path / "s1"), f"{tmp_path}: is a folder, not a JSONL file"),
        (("offline", "build", store, "--out", tmp_path / "b1", "--tokenizer", store),
         f"tokenizer folder '{store}' holds no tokenizer files"),
    ]
    for argv, message in cases:
        refused(capsys, *argv, inputs=(src, store, a_file), names=(message,))
    for name in ("s0", "b0", "s1", "b1", "o.jsonl"):
        assert not (tmp_path / name).exists(), name
    _no_tmp(tmp_path)


def test_store_index_nested_too_deeply(tmp_path, capsys):
    store = _store(tmp_path, capsys)
    (store / "index.json").write_text("[" * 100000)
    refused(capsys, "trajectories", "export", store, tmp_path / "o.jsonl", inputs=(store,),
            names=(f"{store}/index.json: not valid JSON (nested too deeply)",))
    assert not (tmp_path / "o.jsonl").exists()


# ---------------------------------------------------------------------------------------------
# 4. writers never overwrite what they did not create
# ---------------------------------------------------------------------------------------------
def test_trajectories_export_refuses_an_existing_file_unless_forced(tmp_path, capsys):
    store = _store(tmp_path, capsys)
    out = tmp_path / "mine.jsonl"
    out.write_text("precious\n")
    refused(capsys, "trajectories", "export", store, out, inputs=(store, out),
            names=(f"output '{out}' exists (--force overwrites it)",))
    refused(capsys, "trajectories", "export", store, tmp_path, inputs=(store,), names=(f"output '{tmp_path}' is a folder",))
    rc, _, _ = cli(capsys, "trajectories", "export", store, out, "--force")
    assert rc == 0 and [json.loads(x)["prompt_id"] for x in out.read_text().splitlines()] == ["p1", "p2"]
    _no_tmp(tmp_path)


def test_offline_build_refuses_an_existing_output(tmp_path, capsys):
    store = _store(tmp_path, capsys)
    other = _store(tmp_path, capsys, "other")
    refused(capsys, "offline", "build", store, "--out", other, inputs=(store, other),
            names=(f"output '{other}' exists",))
    _no_tmp(tmp_path)
