"""The CPU shims cover what every supported megatron-core touches on CPU, and bootstrap's torch constraint holds.

The shim checks run in a fresh interpreter: apply_cpu_shims() patches torch for the whole process.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.megatron, pytest.mark.skipif(torch.cuda.is_available(), reason="the shims apply only without CUDA")]


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_current_stream_is_a_no_op_used_as_start_grad_sync_uses_it():
    """megatron-core 0.19 param_and_grad_buffer.py: start_grad_sync and finish_grad_sync, call for call."""
    out = _run("""
        import torch
        from megatron_spo.models.cpu_shims import apply_cpu_shims
        assert apply_cpu_shims()

        class Event:  # a CUDA-graph wgrad-ready event left on a param
            pass

        params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
        params[0]._cudagraph_wgrad_ready_event = params[2]._cudagraph_wgrad_ready_event = Event()

        # start_grad_sync
        current_stream = torch.cuda.current_stream()
        waited_event_ids = set()
        for param in params:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None and id(event) not in waited_event_ids:
                current_stream.wait_event(event)
                waited_event_ids.add(id(event))
        assert len(waited_event_ids) == 1
        communication_stream = torch.cuda.current_stream()  # stands in for DDP's torch.cuda.Stream
        stream_context = torch.cuda.stream(communication_stream)
        communication_stream.wait_stream(torch.cuda.current_stream())
        with stream_context:
            x = params[1] * 2
        # finish_grad_sync with several distributed-optimizer instances
        torch.cuda.current_stream().wait_stream(communication_stream)
        torch.cuda.current_stream().synchronize()
        assert torch.cuda.current_stream().query()
        assert torch.cuda.current_stream(torch.device("cuda")) is current_stream
        assert x.tolist() == [2.0, 2.0]
        print("ok")
    """)
    assert out.strip().endswith("ok")


def test_megatron_ddp_grad_sync_runs_on_cpu():
    """The installed megatron-core's own DDP grad sync (0.19: current_stream() in start_grad_sync), one gloo rank."""
    out = _run("""
        import os
        import torch
        import torch.distributed as dist
        from megatron_spo.models.cpu_shims import apply_cpu_shims
        from datetime import timedelta
        from megatron_spo.net import hosted_store
        assert apply_cpu_shims()
        dist.init_process_group("gloo", rank=0, world_size=1, store=hosted_store(1, timedelta(minutes=1)))
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 3)
        ddp = DistributedDataParallel(
            config=config, module=linear,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False))
        ddp.zero_grad_buffer()
        x = torch.arange(8.0).reshape(2, 4)
        ddp(x).pow(2).sum().backward()
        ddp.finish_grad_sync()
        expected = torch.autograd.grad(torch.nn.functional.linear(x, linear.weight, linear.bias).pow(2).sum(),
                                       linear.weight)[0]
        assert torch.allclose(linear.weight.main_grad, expected), (linear.weight.main_grad, expected)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        print("ok")
    """)
    assert out.strip().endswith("ok")


def _torch_constraint_module():
    spec = importlib.util.spec_from_file_location("torch_constraint", ROOT / "tools" / "torch_constraint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torch_constraint_uses_the_distribution_version(monkeypatch):
    """PyPI's CUDA wheel: torch.__version__ is 2.13.0+cu130, its distribution 2.13.0, and pip checks the latter."""
    tc = _torch_constraint_module()
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    monkeypatch.setattr(tc.importlib.metadata, "version", lambda name: {"torch": "2.13.0"}[name])
    line = tc.torch_constraint()
    assert line == "torch==2.13.0"
    assert Requirement(line).specifier.contains(Version("2.13.0"))
    # what bootstrap wrote before: a constraint the installed torch cannot satisfy (pip: ResolutionImpossible)
    assert not Requirement("torch==" + torch.__version__).specifier.contains(Version("2.13.0"))
    assert tc.torch_constraint("2.13.0+cpu") == "torch==2.13.0+cpu"  # the CPU wheel's distribution keeps +cpu


def test_bootstrap_constrains_torch_to_the_installed_distribution():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "torch_constraint.py")], capture_output=True,
                         text=True, check=True, timeout=60).stdout.strip()
    installed = importlib.metadata.version("torch")
    assert out == f"torch=={installed}"
    assert Requirement(out).specifier.contains(Version(installed))
    assert "tools/torch_constraint.py" in (ROOT / "tools" / "bootstrap.sh").read_text()
