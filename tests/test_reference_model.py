"""Character tokenizer and the cached, atomically written SFT reference model (tiny settings)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_spo.config import ConfigError, build_config
from megatron_spo.data import toy_code
from megatron_spo.data.char_tokenizer import ALPHABET, build_char_tokenizer
from megatron_spo.data.config import ToyCodeTaskConfig
from megatron_spo.experiments import reference_model as rm
from megatron_spo.experiments.config import QuickstartModelConfig


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def tiny_config(**overrides) -> QuickstartModelConfig:
    settings = dict(
        task=ToyCodeTaskConfig(num_problems=12, max_solutions=4, num_sft_problems=30),
        hidden_size=32,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=256,
        sft_steps=3,
        batch_size=4,
        warmup_steps=1,
        num_threads=1,
    )
    settings.update(overrides)
    return QuickstartModelConfig(**settings)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def test_tokenizer_vocabulary(tokenizer):
    assert len(tokenizer) == 100
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert tokenizer("a\n b")["input_ids"] == [1, 4 + ALPHABET.index("a"), 4, 5, 4 + ALPHABET.index("b")]
    assert tokenizer("é")["input_ids"] == [1, tokenizer.unk_token_id]


def test_tokenizer_round_trips_every_task_string(tokenizer):
    task = toy_code.make_task()
    texts = list(toy_code.all_text(task))
    assert {c for t in texts for c in t} <= set(ALPHABET)
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1  # one token per character
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # and every symbol of the alphabet, including runs of spaces and newlines
    assert tokenizer.decode(tokenizer(ALPHABET + "  \n\n  ")["input_ids"], skip_special_tokens=True) == ALPHABET + "  \n\n  "


def test_tokenizer_loads_with_auto_tokenizer(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "# list: dbl, sum\na=list(map(int,input().split()))\nprint(sum(a))\n"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text
    assert (loaded.eos_token, loaded.pad_token, loaded.padding_side) == ("<eos>", "<pad>", "left")
    batch = loaded(["ab", "abcd"], padding=True)["input_ids"]
    assert batch[0][:2] == [0, 0] and batch[0][2] == loaded.bos_token_id  # left padding for generation


# ---------------------------------------------------------------------------------------------
# SFT pieces
# ---------------------------------------------------------------------------------------------
def test_encode_example_masks_the_prompt(tokenizer):
    ids, labels = rm.encode_example(tokenizer, "# num: sq\n", "print(int(input())**2)\n")
    n_prompt = 1 + len("# num: sq\n")
    assert len(ids) == len(labels) == n_prompt + len("print(int(input())**2)\n") + 1
    assert labels[:n_prompt] == [rm.IGNORE_INDEX] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:] and ids[-1] == tokenizer.eos_token_id
    batch = rm.collate([(ids, labels), (ids[:5], labels[:5])], tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, len(ids))
    assert batch["attention_mask"][1].tolist() == [1] * 5 + [0] * (len(ids) - 5)
    assert (batch["labels"][1, 5:] == rm.IGNORE_INDEX).all()


def test_sampler_swaps_the_configured_fraction_for_neighbour_programs():
    task = toy_code.make_task()
    sampler = rm.SFTSampler(task, swap_fraction=0.25, seed=0)
    by_prompt = {p.prompt: p for p in task.sft_problems}
    swapped = 0
    for _ in range(4000):
        prompt, program = sampler.draw()
        problem = by_prompt[prompt]  # only train and SFT-only prompts are ever drawn, never held-out ones
        if program not in problem.solutions:
            assert program in task.by_id(task.neighbour[problem.id]).solutions
            swapped += 1
    assert swapped == sampler.num_swapped
    assert abs(swapped / 4000 - 0.25) < 0.03


def test_sampler_slips_the_configured_fraction_of_targets():
    task = toy_code.make_task()
    sampler = rm.SFTSampler(task, swap_fraction=0.0, seed=0, slip_fraction=0.4)
    by_prompt = {p.prompt: p for p in task.sft_problems}
    slipped = 0
    for _ in range(4000):
        prompt, program = sampler.draw()
        problem = by_prompt[prompt]
        if program not in problem.solutions:
            assert any(program == toy_code.with_input_slip(problem.family, s) for s in problem.solutions)
            slipped += 1
    assert slipped == sampler.num_slipped
    assert abs(slipped / 4000 - 0.4) < 0.03


def test_lr_schedule_exact_values():
    cfg = tiny_config(lr=1e-3, warmup_steps=10, sft_steps=110, min_lr_ratio=0.1)
    assert rm.lr_at(0, cfg) == pytest.approx(1e-4)
    assert rm.lr_at(9, cfg) == pytest.approx(1e-3)
    assert rm.lr_at(60, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert rm.lr_at(110, cfg) == pytest.approx(1e-4)


@pytest.mark.parametrize("architecture, model_class", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_sft_lowers_the_loss(tokenizer, architecture, model_class):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(sft_steps=40, batch_size=8, lr=1e-2, warmup_steps=2, hidden_size=64, num_attention_heads=4,
                      architecture=architecture)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(rm.reference_hf_config(cfg, tokenizer))
    assert type(model).__name__ == model_class
    summary = rm.train_sft(model, tokenizer, rm.task_from_config(cfg), cfg, progress=False)
    assert summary["first_loss"] == pytest.approx(torch.log(torch.tensor(100.0)).item(), abs=0.3)  # uniform start
    assert summary["final_loss"] < 0.6 * summary["first_loss"]


# ---------------------------------------------------------------------------------------------
# build_reference: loadable HF dir, cache hit, atomic rebuild
# ---------------------------------------------------------------------------------------------
def test_build_reference_writes_a_loadable_hf_dir_and_reuses_it(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaForCausalLM

    cfg = tiny_config()
    path = rm.build_reference(cfg, cache_dir=tmp_path, progress=False)
    assert path == tmp_path / f"quickstart-ref-{rm.cache_key(cfg)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary directory left behind
    model = LlamaForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert (path / "model.safetensors").is_file()
    assert model.config.vocab_size == len(tok) == 100
    assert model.config.tie_word_embeddings is False
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.num_key_value_heads) == (32, 1, 1)
    info = rm.read_build_info(path)
    assert info["steps"] == 3 and info["cache_key"] == rm.cache_key(cfg)
    assert info["num_parameters"] == sum(p.numel() for p in model.parameters())

    # the saved model is the trained one: a tokenized prompt gives finite, non-uniform next-token logits
    logits = model(**tok("# num: sq\n", return_tensors="pt")).logits[0, -1]
    assert torch.isfinite(logits).all() and logits.std() > 0

    # second call: cache hit, no training, files untouched
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("train_sft ran on a cache hit")

    monkeypatch.setattr(rm, "train_sft", no_training)
    assert rm.build_reference(cfg, cache_dir=tmp_path, progress=False) == path
    # num_threads does not change the weights, so it shares the cache entry
    assert rm.build_reference(cfg.model_copy(update={"num_threads": 2}), cache_dir=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.undo()

    # force rebuilds in place (atomically replaced, same key)
    rebuilt = rm.build_reference(cfg, cache_dir=tmp_path, force=True, progress=False)
    assert rebuilt == path and rm.read_build_info(path)["built_at"] > info["built_at"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_incomplete_directory_is_not_a_cache_hit(tmp_path):
    cfg = tiny_config(sft_steps=1)
    path = rm.reference_dir(cfg, tmp_path)
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")  # a crash left this (no build_info.json)
    assert rm.build_reference(cfg, cache_dir=tmp_path, progress=False) == path
    assert json.loads((path / "build_info.json").read_text())["steps"] == 1


def test_cache_key_tracks_settings_and_env_root(tmp_path, monkeypatch):
    cfg = tiny_config()
    assert rm.cache_key(cfg) != rm.cache_key(tiny_config(sft_steps=4))
    assert rm.cache_key(cfg) != rm.cache_key(tiny_config(task=ToyCodeTaskConfig(num_problems=12, seed=1)))
    assert rm.cache_key(cfg) != rm.cache_key(tiny_config(task=ToyCodeTaskConfig(num_problems=12, num_sft_problems=31)))
    assert rm.cache_key(cfg) == rm.cache_key(tiny_config(num_threads=2))
    monkeypatch.setenv("MEGATRON_SPO_CACHE", os.fspath(tmp_path))
    assert rm.reference_dir(cfg) == tmp_path / f"quickstart-ref-{rm.cache_key(cfg)}"


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not divisible by num_key_value_heads 3"):
        build_config(QuickstartModelConfig, {"num_key_value_heads": 3})
    with pytest.raises(ConfigError, match=r"swap_fraction: Input should be less than 1 \(got 1.5\)"):
        build_config(QuickstartModelConfig, {"swap_fraction": 1.5})
    with pytest.raises(ConfigError, match=r"task.num_problems: Input should be greater than or equal to 6"):
        build_config(QuickstartModelConfig, {"task": {"num_problems": 2}})
    with pytest.raises(ConfigError, match=r"sft_stepz: unknown field"):
        build_config(QuickstartModelConfig, {"sft_stepz": 3})


def test_unknown_reference_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match=r"architecture: unknown architecture 'gpt2' \(supported: llama, mistral, qwen2"):
        tiny_config(architecture="gpt2")
