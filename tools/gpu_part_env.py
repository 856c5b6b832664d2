"""GPU check, item 6: the device (name, driver, memory, capability) and the versions the check ran with.

Also where megatron.core and pydantic were imported from, so the report shows they came from the wheels.
"""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess

from gpu_result import PartResult, part_main

MODULES = {"torch": "torch", "triton": "triton", "megatron_core": "megatron.core", "transformers": "transformers",
           "pydantic": "pydantic", "liger_kernel": "liger_kernel", "transformer_engine": "transformer_engine"}


def _version(module: str) -> tuple[str, str]:
    """(version, file) of an importable module; ('absent: <error>', '') otherwise."""
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # an absent or broken optional package is a finding, not a crash
        return f"absent: {type(err).__name__}: {err}"[:200], ""
    version = getattr(mod, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version(module.split(".")[0].replace("_", "-"))
    return str(version), str(getattr(mod, "__file__", ""))


def body(result: PartResult, args) -> None:
    import torch

    result.number("python", platform.python_version())
    for key, module in MODULES.items():
        version, where = _version(module)
        result.number(key, version)
        if where and key in ("megatron_core", "pydantic"):
            result.number(f"{key}_from", where)
    result.number("torch_cuda", torch.version.cuda)
    result.require("megatron-core imports", not result.numbers["megatron_core"].startswith("absent"),
                   result.numbers["megatron_core"])
    result.require("pydantic imports", not result.numbers["pydantic"].startswith("absent"), result.numbers["pydantic"])
    if args.device == "cpu":
        result.number("gpu", "none (--device cpu)")
        return
    result.require("torch sees a GPU", torch.cuda.is_available())
    count = torch.cuda.device_count()
    result.number("gpus", count)
    props = torch.cuda.get_device_properties(0)
    result.number("gpu", props.name)
    result.number("gpu_memory_gib", round(props.total_memory / 2**30, 1))
    result.number("capability", f"{props.major}.{props.minor}")
    result.number("multiprocessors", props.multi_processor_count)
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=10)
        if query.returncode == 0 and query.stdout.strip():
            result.number("driver", query.stdout.strip().splitlines()[0].split(",")[-1].strip())
    nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
    result.number("nccl", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))


if __name__ == "__main__":
    raise SystemExit(part_main(body))
