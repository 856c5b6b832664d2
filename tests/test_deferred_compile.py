"""megatron-core's torch.compile'd functions are compiled at their first call (megatron_spo/deferred_compile.py)."""

import subprocess
import sys

import torch

from megatron_spo.deferred_compile import compile_at_first_call

PROBE = """
import sys, inspect
def compilers():
    return sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
import torch, torch.distributed.tensor  # megatron-core imports DTensor: what it brings is torch's, not the hook's
before = compilers()
import megatron_spo
import megatron.core, megatron.core.models.gpt
from megatron.core import jit
from megatron.core.fusions import fused_bias_gelu
from megatron_spo.deferred_compile import compile_at_first_call
assert jit.jit_fuser is compile_at_first_call, jit.jit_fuser
assert torch.compile is not compile_at_first_call  # torch's own again once the import finished
fused = fused_bias_gelu.bias_gelu
assert inspect.getsourcefile(fused.__wrapped__) == fused_bias_gelu.__file__  # megatron's own function, wrapped
assert fused.__code__ is not fused.__wrapped__.__code__
print(sorted(set(compilers()) - set(before)))
"""


def test_importing_megatron_core_after_megatron_spo_imports_no_compiler():
    """megatron-core 0.16-0.19 (0.19 adds a direct @torch.compile in moe/router.py) import no torch._dynamo /
    torch._inductor module of their own."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_first_call_compiles_with_the_decorators_options_and_later_calls_reuse_it():
    graphs = []

    def backend(graph_module, example_inputs):  # a torch.compile backend: records each graph it is given
        graphs.append(graph_module)
        return graph_module.forward

    @compile_at_first_call(backend=backend, fullgraph=True)
    def gelu_like(x, y):
        return torch.tanh(x + y) * 0.5

    x, y = torch.randn(4, 8), torch.randn(8)
    assert graphs == []  # decorating compiles nothing
    out = gelu_like(x, y)
    assert torch.equal(out, torch.tanh(x + y) * 0.5) and len(graphs) == 1
    assert torch.equal(gelu_like(x + 1, y), torch.tanh(x + 1 + y) * 0.5) and len(graphs) == 1  # reused
    assert gelu_like.__name__ == "gelu_like" and gelu_like.__wrapped__(x, y).shape == (4, 8)
