"""Exact resume online (issue 65): a checkpoint keeps the rollouts generated but not yet trained (the online source's
buffer, with their versions and sampling metadata), and the resumed run trains them first, as the run that was not
stopped would have (FIFO). What cannot be exact: requests still in flight at the checkpoint are sampled again by the
resumed run, from the engines' own random state."""

import json
import os

import pytest
from trainer_helpers import train_configs

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_a_resumed_online_run_trains_the_checkpoints_buffered_rollouts_first(tmp_path, monkeypatch):
    import rollout_helpers as rh
    from test_extensions import _cfg
    from test_held_out_eval import REPO, TOY_MATH

    from megatron_spo.data.offline_store import load_trajectories
    from megatron_spo.models.parallel import spawn_local
    from megatron_spo.training.checkpoint import ROLLOUT_BUFFER, read_rollout_buffer

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    model = rh.make_tiny_llama(str(tmp_path / "engine_model"))
    with rh.serving_engine(model) as url:
        def cfg(steps):
            # 4 sequences a step (2 groups of 2); up to 4 finished groups wait in the buffer, so a checkpoint
            # finds some; stale samples tagged, not dropped (the resumed run trains them whatever their age)
            return _cfg(tmp_path, model, "run", steps=steps, algo="agro",
                        batch={"sequences_per_step": 4, "max_tokens_per_micro_batch": 1024, "max_seq_length": 256},
                        task={**TOY_MATH, "reward": "test_held_out_eval:parity_reward", "max_prompt_tokens": 240},
                        fleet={"engine_urls": [url]}, checkpoint={"interval": 2, "export_hf": False},
                        rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "buffer_groups": 4,
                                 "max_inflight_requests": 2, "max_staleness": 100, "stale_policy": "tag"})
        spawn_local(train_configs, 1, [cfg(2)])
        saved = read_rollout_buffer(tmp_path / "run" / "checkpoints" / "iter_0000002" / ROLLOUT_BUFFER)
        assert len(saved) >= 2, "the buffer held fewer than a step's groups at the checkpoint"
        spawn_local(train_configs, 1, [cfg(3)])
    archived = load_trajectories(str(tmp_path / "run" / "experience"))
    step3 = archived[8:12]  # steps 1-2 archived 8 trajectories; step 3 the resumed run's first 4
    expected = [t for g in saved[:2] for t in g]
    key = lambda t: (t.prompt_id, t.prompt_tokens, t.response_tokens, t.reward, t.policy_version,  # noqa: E731
                     t.behaviour_logprobs)
    assert sorted(map(key, step3)) == sorted(map(key, expected))
    # the buffer's lines keep the sampling metadata too (request ids, temperatures)
    line = json.loads((tmp_path / "run" / "checkpoints" / "iter_0000002" / ROLLOUT_BUFFER).read_text().splitlines()[0])
    assert {"request_id", "temperature", "top_p"} <= set(line[0])
