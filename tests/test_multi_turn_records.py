"""Multi-turn records (issue 63): response_mask (1 = the model's token, 0 = the environment's) and turn_versions (the
policy version of each model turn) kept by trajectory files, the offline store and the experience archive, and refused
in one line naming the field where they cannot be a record's."""

from types import SimpleNamespace

import pytest

from megatron_spo.data.offline_store import load_trajectories, write_store
from megatron_spo.data.trajectory import RecordError, Trajectory, validate_record

BASE = {"prompt_id": "a", "prompt_tokens": [1, 2], "response_tokens": [3, 4, 5, 6, 7], "reward": 0.0,
        "source": "online", "policy_version": 1}


def test_the_mask_and_turn_versions_round_trip_through_a_record_and_the_store(tmp_path):
    record = validate_record({**BASE, "response_mask": [1, 1, 0, 0, 1], "turn_versions": [1, 2]}, "x:1")
    assert (record.response_mask, record.turn_versions) == ([1, 1, 0, 0, 1], [1, 2])
    assert validate_record(record.to_dict(), "x:2") == record
    single = validate_record(BASE, "x:3")
    write_store([record, single], tmp_path / "store")
    back = load_trajectories(str(tmp_path / "store"))
    assert back == [record, single]
    assert single.response_mask is None and "response_mask" not in single.to_dict()


def test_the_archive_keeps_a_multi_turn_trajectory(tmp_path):
    from megatron_spo.data.archive import ExperienceArchive

    archive = ExperienceArchive(tmp_path / "exp", run_id="r")
    archive.add([SimpleNamespace(**{**BASE, "behaviour_logprobs": [-1.0, -1.0, 0.0, 0.0, -1.0], "q0": None,
                                    "response_mask": [1, 1, 0, 0, 1], "turn_versions": [1, 2]})])
    archive.close()
    [t] = load_trajectories(str(tmp_path / "exp"))
    assert (t.response_mask, t.turn_versions) == ([1, 1, 0, 0, 1], [1, 2])


@pytest.mark.parametrize("fields, message", [
    ({"response_mask": [1, 0]}, "field 'response_mask': must be a 0 / 1 per response token (5), got 2"),
    ({"response_mask": [1, 2, 0, 0, 1]}, "field 'response_mask': must hold only 0 (environment) and 1 (model)"),
    ({"response_mask": [0, 1, 1, 1, 1]}, "field 'response_mask': the response starts with the model's turn"),
    ({"response_mask": [1, 0, 1, 0, 1], "turn_versions": [0, 1]},
     "field 'turn_versions': must be one integer >= 0 per model turn (3), got [0, 1]"),
    ({"turn_versions": [0]}, "field 'turn_versions': needs response_mask"),
])
def test_a_mask_that_cannot_be_a_records_is_one_line_naming_the_field(fields, message):
    with pytest.raises(RecordError) as err:
        validate_record({**BASE, **fields}, "data.jsonl:7")
    assert str(err.value).startswith(f"data.jsonl:7: {message}") and "\n" not in str(err.value)


def test_collate_trains_only_the_models_tokens():
    from megatron_spo.data.batching import collate

    t = Trajectory(**{**BASE, "response_mask": [1, 1, 0, 0, 1]})
    mb = collate([t], pad_id=0)
    # prompt (2) + response (5) - 1 positions: the response's targets sit at 1..5, the environment's at 3, 4
    assert mb.loss_mask[0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_a_conversation_longer_than_the_trainer_takes_is_refused_at_config_time():
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.training.config import TrainConfig

    with pytest.raises(ConfigError) as err:
        build_config(TrainConfig, {"init": {"hf": "x"}, "rollout": {"env": {"name": "calculator",
                                                                            "max_total_tokens": 900}},
                                   "batch": {"max_seq_length": 512}})
    assert str(err.value) == ("rollout.env.max_total_tokens: a conversation of up to 900 tokens does not fit "
                              "batch.max_seq_length 512 (the trainer refuses longer records); lower it or raise "
                              "batch.max_seq_length")
