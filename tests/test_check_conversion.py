"""The streaming check-conversion (models/check_conversion.py): every family passes at ~1e-7, a corrupted
conversion is caught with the layer and tensor named, its memory is a small fraction of the model, and the
memory preflight refuses a check that cannot fit (a child process under a cgroup memory limit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import models_helpers as mh  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

CONVERT = (
    "import sys, warnings; warnings.filterwarnings('ignore')\n"
    "from megatron_spo.models.convert import hf_to_megatron\n"
    "for src, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
    "    hf_to_megatron(src, out)\n"
)

# A converter with three bugs (a reader that hands it wrong tensors): layer 1's gate and up exchanged,
# layer 2's K rows of KV groups 0 and 1 swapped, and the embedding rows shifted by one.
CORRUPT_CONVERT = (
    "import sys, warnings, torch; warnings.filterwarnings('ignore')\n"
    "from megatron_spo.models import hf_checkpoint\n"
    "view = hf_checkpoint.HFReader.view\n"
    "def corrupt(self, name):\n"
    "    t = view(self, name)\n"
    "    if name == 'model.layers.1.mlp.gate_proj.weight': return view(self, 'model.layers.1.mlp.up_proj.weight')\n"
    "    if name == 'model.layers.1.mlp.up_proj.weight': return view(self, 'model.layers.1.mlp.gate_proj.weight')\n"
    "    if name == 'model.layers.2.self_attn.k_proj.weight':\n"
    "        d = t.shape[0] // 2; return torch.cat([t[d:], t[:d]])\n"
    "    if name == 'model.embed_tokens.weight': return torch.roll(t, 1, dims=0)\n"
    "    return t\n"
    "hf_checkpoint.HFReader.view = corrupt\n"
    "from megatron_spo.models.convert import hf_to_megatron\n"
    "hf_to_megatron(sys.argv[1], sys.argv[2])\n"
)


def _check_json(hf: Path, meg: Path, *extra: str, ok: bool = True) -> dict:
    proc = mh.run_cli("check-conversion", "--hf", str(hf), "--megatron", str(meg), "--json", "--no-progress", *extra,
                      check=False)
    assert proc.returncode == (0 if ok else 1), proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("check")
    pairs = {case: (mh.make_tiny_family(root / case, case), root / f"{case}-meg") for case in mh.FAMILY_CASES}
    mh.run_cli(*[str(p) for pair in pairs.values() for p in pair], code=CONVERT)
    return pairs


CHECK_ALL = (
    "import json, sys, warnings; warnings.filterwarnings('ignore')\n"
    "from megatron_spo.models.check_conversion import run_check\n"
    "print(json.dumps({hf: run_check(hf, meg, progress=False).to_json() for hf, meg in zip(sys.argv[1::2], sys.argv[2::2])}))\n"
)


@pytest.fixture(scope="module")
def reports(converted) -> dict[str, dict]:
    """The check of every family, in one process (the CLI itself is run by the tests below)."""
    proc = mh.run_cli(*[str(p) for pair in converted.values() for p in pair], code=CHECK_ALL)
    by_hf = json.loads(proc.stdout.strip().splitlines()[-1])
    return {case: by_hf[str(hf)] for case, (hf, _) in converted.items()}


@pytest.mark.parametrize("case", list(mh.FAMILY_CASES))
def test_every_family_passes_with_identical_tensors(converted, reports, case):
    hf, meg = converted[case]
    report = reports[case]
    findings = report["findings"]
    tensors = [f for f in findings if f["what"] == "tensor"]
    layers = [f for f in findings if f["what"] == "layer"]
    assert all(f["error"] == 0.0 for f in tensors)
    # every HF tensor was compared (vocab tensors once per chunk: one chunk here)
    assert len(tensors) == len(mh.all_tensors(hf))
    assert [f["name"] for f in layers] == [f"model.layers.{i}" for i in range(4)]
    assert max(f["error"] for f in layers) < 1e-6 and max(f["carried"] for f in layers) < 1e-6
    logprobs = next(f for f in findings if f["what"] == "logprobs")
    assert logprobs["error"] < 1e-5
    assert report["summary"].startswith("OK: ")


def test_corrupted_conversion_is_caught_with_layer_and_tensor_named(converted, tmp_path):
    hf, _ = converted["qwen2.5"]
    bad = tmp_path / "bad-meg"
    mh.run_cli(str(hf), str(bad), code=CORRUPT_CONVERT)
    report = _check_json(hf, bad, "--vocab-chunk", "256", ok=False)
    failed = [(f["what"], f["name"]) for f in report["findings"] if not f["ok"]]
    tensors = {name for what, name in failed if what == "tensor"}
    # the shifted embedding differs in every row chunk; exactly the three corrupted layer tensors differ
    assert {n for n in tensors if not n.startswith("model.embed_tokens")} == {
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
        "model.layers.2.self_attn.k_proj.weight"}
    assert {n for n in tensors if n.startswith("model.embed_tokens")} == {
        f"model.embed_tokens.weight[{s}:{min(s + 256, mh.VOCAB)}]" for s in range(0, mh.VOCAB, 256)}
    # layer outputs: only the corrupted layers fail in isolation; every layer is off once carried
    layers = {f["name"]: f for f in report["findings"] if f["what"] == "layer"}
    assert [n for n, f in layers.items() if not f["ok"]] == ["model.layers.1", "model.layers.2"]
    assert layers["model.layers.1"]["error"] > 1e-3 and layers["model.layers.2"]["error"] > 1e-3  # tol: 1e-4
    assert all(f["carried"] > 1e-3 for f in layers.values())
    assert report["summary"].startswith(
        "FAIL: first disagreement: tensor model.embed_tokens.weight[0:256] differs (error ")


def test_tp2_pp2_trainer_layout_checkpoint_and_one_line_errors(converted, tmp_path):
    hf, meg = converted["qwen3"]
    # a checkpoint written under TP=2 x PP=2 (keys are global: the check reads it at TP=1)
    code = (
        "import sys, warnings; warnings.filterwarnings('ignore')\n"
        "from megatron_spo.models.config import ParallelConfig\n"
        "from megatron_spo.models.builders import build_policy\n"
        "from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config\n"
        "from megatron_spo.models.hf_map import load_hf_into_model\n"
        "from megatron_spo.models.megatron_checkpoint import save_megatron\n"
        "from megatron_spo.models.parallel import init_parallel, spawn_local\n"
        "def work(hf, out):\n"
        "    cfg = read_hf_config(hf); p = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)\n"
        "    init_parallel(p, cfg); chunks = build_policy(cfg, p, init_weights=False)\n"
        "    load_hf_into_model(chunks, cfg, HFReader(hf).get); save_megatron(chunks, cfg, out)\n"
        "if __name__ == '__main__':\n"
        "    spawn_local(work, 4, sys.argv[1], sys.argv[2])\n"
    )
    script = tmp_path / "save_tp2pp2.py"
    script.write_text(code)
    out = tmp_path / "tp2pp2"
    proc = subprocess.run([sys.executable, str(script), str(hf), str(out)], capture_output=True, text=True,
                          cwd=mh.REPO, env={**os.environ, "PYTHONPATH": str(mh.REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = _check_json(hf, out, "--vocab-chunk", "300")
    assert all(f["error"] == 0.0 for f in report["findings"] if f["what"] == "tensor")
    assert sum(f["name"].startswith("lm_head.weight[") for f in report["findings"]) == 4  # 1001 rows / 300
    # another family's checkpoint: refused in one line naming the field
    other = mh.run_cli("check-conversion", "--hf", str(converted["mistral"][0]), "--megatron", str(meg), check=False)
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1] == (
        "megatron-spo check-conversion: error: architecture differs: HF mistral vs Megatron qwen3")


def test_peak_memory_is_a_small_fraction_of_the_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # 81M parameters, 325 MB in float32
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=16,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    warm = mh.make_tiny_llama(tmp_path / "warm")
    mh.run_cli(str(tmp_path / "hf"), str(tmp_path / "meg"), str(warm), str(tmp_path / "warm-meg"), code=CONVERT)
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "hf").glob("*.safetensors"))
    proc = mh.run_cli(str(warm), str(tmp_path / "warm-meg"), str(tmp_path / "hf"), str(tmp_path / "meg"), "2048",
                      code=mh.PEAK_ANON_CODE)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"]
    peak = result["peak_anon_bytes"]
    print(f"check peak {peak / 2**20:.0f} MB private for a {model_bytes / 2**20:.0f} MB model")
    assert peak < 0.25 * model_bytes
    assert peak < result["estimate"]["total"] - result["estimate"]["baseline"]  # the formula is an upper bound


# ---------------------------------------------------------------------------------------------
# Memory preflight
# ---------------------------------------------------------------------------------------------
def _own_memory_cgroup() -> Path | None:
    """A writable cgroup (v1 memory controller or v2) under this process's own, or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            limit = "memory.limit_in_bytes"
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            base, limit = Path("/sys/fs/cgroup") / rel.lstrip("/"), "memory.max"
        else:
            continue
        child = base / f"spo-preflight-{os.getpid()}"
        try:
            child.mkdir()
            (child / limit).write_text(str(900 * 2**20))
        except OSError:
            if child.is_dir():
                child.rmdir()
            continue
        return child
    return None


def test_preflight_refuses_a_check_that_cannot_fit_in_a_cgroup_limited_child(converted):
    cgroup = _own_memory_cgroup()
    if cgroup is None:
        pytest.skip("no writable memory cgroup on this machine (the env-limit test below still runs)")
    hf, meg = converted["llama3.2-tied"]
    try:  # 0.9 GB: the interpreter fits, the check's 1 GB baseline + imports do not
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_spo.cli", "check-conversion", "--hf", str(hf), "--megatron", str(meg)],
            capture_output=True, text=True, cwd=mh.REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"},
            preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
    finally:
        cgroup.rmdir()
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("megatron-spo check-conversion: error: check-conversion needs about 1.0 GB of memory but ")
    assert f"(cgroup memory limit 0.9 GB at {cgroup}/" in line
    assert line.endswith("; a smaller --vocab-chunk lowers the vocabulary part")


def test_preflight_messages_and_limits():
    from megatron_spo import memory

    os.environ["MEGATRON_SPO_MEMORY_LIMIT_BYTES"] = str(2 * 10**9)
    try:
        avail = memory.available_memory()
        assert avail == memory.Available(2 * 10**9, "MEGATRON_SPO_MEMORY_LIMIT_BYTES")
        with pytest.raises(memory.MemoryPreflightError) as info:
            memory.preflight("convert hf-to-megatron", 3.5e9, hint="use a node with more memory")
        assert str(info.value) == ("convert hf-to-megatron needs about 3.5 GB of memory but 2.0 GB is available "
                                   "(MEGATRON_SPO_MEMORY_LIMIT_BYTES); use a node with more memory")
        assert memory.preflight("x", 1e9).bytes == 2 * 10**9
    finally:
        del os.environ["MEGATRON_SPO_MEMORY_LIMIT_BYTES"]


def test_cgroup_room_reads_v1_and_v2_limits_on_the_process_path(tmp_path):
    from megatron_spo.memory import _cgroup_room

    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "job" / "memory.max").write_text(str(8 * 10**9))
    (v2 / "job" / "memory.current").write_text(str(3 * 10**9))
    (v2 / "job" / "step" / "memory.max").write_text("max")
    proc = tmp_path / "cgroup_v2"
    proc.write_text("0::/job/step\n")
    room, source = _cgroup_room(v2, proc)
    assert room == 5 * 10**9 and source == f"cgroup memory limit 8.0 GB at {v2 / 'job' / 'memory.max'}"
    v1 = tmp_path / "v1"
    (v1 / "memory" / "slurm").mkdir(parents=True)
    (v1 / "memory" / "slurm" / "memory.limit_in_bytes").write_text(str(4 * 10**9))
    (v1 / "memory" / "slurm" / "memory.usage_in_bytes").write_text(str(1 * 10**9))
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(9223372036854771712))
    proc.write_text("4:memory:/slurm\n1:cpu:/\n")
    assert _cgroup_room(v1, proc) == (3 * 10**9, f"cgroup memory limit 4.0 GB at {v1 / 'memory' / 'slurm' / 'memory.limit_in_bytes'}")


def test_convert_and_serve_refuse_a_load_that_does_not_fit(converted, tmp_path):
    hf, meg = converted["qwen2.5"]
    env = {"MEGATRON_SPO_MEMORY_LIMIT_BYTES": str(500 * 10**6)}  # the limit a machine may not show
    for args, prefix in (
        (("convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "out")),
         "megatron-spo convert: error: convert hf-to-megatron needs about 1.0 GB of memory but 0.5 GB is available "
         "(MEGATRON_SPO_MEMORY_LIMIT_BYTES); conversion streams one layer"),
        (("convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(tmp_path / "out")),
         "megatron-spo convert: error: convert megatron-to-hf needs about 1.0 GB"),
        (("serve", "--model", str(hf), "--port", "1"),
         f"megatron-spo serve: error: engine load of {hf} needs about 1.0 GB of memory but 0.5 GB is available"),
    ):
        proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", *args], capture_output=True, text=True,
                              cwd=mh.REPO, env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(prefix), proc.stderr[-500:]
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_cpu_training_refuses_a_model_that_does_not_fit(converted, tmp_path):
    import yaml

    hf, _ = converted["qwen3"]
    cfg = dict(run_dir=str(tmp_path / "run"), steps=1, algo="ppo", init={"hf": str(hf)}, nproc=2, rollout={"temperature_range": [1.0, 1.0], "top_p": 1.0},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               logging={"progress": False})
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "train", str(tmp_path / "train.yaml")],
                          capture_output=True, text=True, cwd=mh.REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "MEGATRON_SPO_MEMORY_LIMIT_BYTES": str(10**9)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    # 2 processes: 2 x 1.0 GB baseline alone exceed 1 GB; nothing was started or written
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "megatron-spo train: error: CPU training of a 0.00B-parameter qwen3 on 2 process(es) needs about 2.0 GB of "
        "memory but 1.0 GB is available (MEGATRON_SPO_MEMORY_LIMIT_BYTES); train on GPUs")
    assert not (tmp_path / "run").exists()
