"""A port probed free may be taken before it is bound (the CI's quickstart lost its conversion's rendezvous port so:
EADDRINUSE). Every group this package forms itself binds its port as it chooses it; here every port a probe
(``net.free_port``) hands out is held by another socket, and each group still forms."""

import json
import os
import sys

import pytest
import torch

from megatron_spo import net
from megatron_spo.models import convert, parallel  # noqa: F401  (loaded before the probe is rigged)
from megatron_spo.rollout import fleet, weight_sync  # noqa: F401

sys.path.insert(0, os.path.dirname(__file__))
from rollout_helpers import ServerThread, make_tiny_llama, perturbed_state_dict  # noqa: E402


@pytest.fixture
def probed_port_held(monkeypatch):
    """Every ``free_port`` in the package answers one port, which another socket holds (listening) meanwhile."""
    held = net.listening_socket()
    port = held.getsockname()[1]
    probe = net.free_port
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron_spo") and getattr(module, "free_port", None) is probe:
            monkeypatch.setattr(module, "free_port", lambda host="127.0.0.1": port)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    yield port
    held.close()


def test_a_conversion_forms_its_one_process_world_while_the_probed_port_is_held(probed_port_held, tmp_path):
    from megatron_spo.models.convert import hf_to_megatron

    assert net.free_port() == probed_port_held  # the rig holds
    hf = make_tiny_llama(str(tmp_path / "hf"))
    hf_to_megatron(hf, tmp_path / "megatron")  # was: DistNetworkError ... EADDRINUSE on the probed port
    from megatron_spo.checkpoint_digest import verify_checkpoint

    assert verify_checkpoint(tmp_path / "megatron") == "verified"  # a whole checkpoint, its digests matching
    assert "MASTER_PORT" not in os.environ  # nothing left behind for a later launch to mistake for its own


def allreduce_rank(out_dir: str) -> None:
    import torch.distributed as dist

    from megatron_spo.models.config import ModelConfig, ParallelConfig

    cfg = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=2,
                      vocab_size=16)
    parallel.init_parallel(ParallelConfig(), cfg)
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"sum": total.item(), "port": int(os.environ["MASTER_PORT"])}, f)
    parallel.destroy_parallel()


@pytest.mark.parametrize("fork_server", [False, True], ids=["spawned-helper", "fork-server"])
def test_local_ranks_meet_on_a_store_their_launcher_bound_while_the_probed_port_is_held(
        probed_port_held, tmp_path, monkeypatch, fork_server):
    monkeypatch.setattr(parallel, "FORK_SERVER", fork_server)
    ctx = parallel.start_local(allreduce_rank, 2, str(tmp_path))
    while not ctx.join(timeout=1.0):
        pass
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    assert {r["port"] for r in ranks} == {ctx.rendezvous_store.port} != {probed_port_held}


def test_a_weight_push_forms_its_group_while_the_probed_port_is_held(probed_port_held, tmp_path):
    from megatron_spo.rollout.local_engine import LocalEngine
    from megatron_spo.rollout.weight_sync import WeightBroadcaster

    hf = make_tiny_llama(str(tmp_path / "hf"))
    new_state = perturbed_state_dict(hf, seed=1)
    with ServerThread(LocalEngine(hf)) as srv, WeightBroadcaster([srv.url], bucket_bytes=20_000) as sync:
        assert srv.port != probed_port_held
        report = sync.push(new_state.items(), version="1")
        assert report.engines_updated == [srv.url] and report.failed == {}
        for name, tensor in srv.engine.model.state_dict().items():
            assert torch.equal(tensor, new_state[name]), name
