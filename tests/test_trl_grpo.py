"""TRL's GRPOTrainer as a benchmark baseline (megatron_spo/experiments/trl_grpo.py): the same prompt tokens, the same
rewards, and a short run that trains, logs and saves a checkpoint our tools load."""

from __future__ import annotations

import asyncio
import math
import os
import types
import zlib

import pytest
import torch

trl = pytest.importorskip("trl")

from megatron_spo.data.char_tokenizer import build_char_tokenizer  # noqa: E402
from megatron_spo.data.config import ToyCodeTaskConfig  # noqa: E402
from megatron_spo.data.prompts import Prompt, make_prompts  # noqa: E402
from megatron_spo.experiments import trl_grpo  # noqa: E402
from megatron_spo.experiments.config import QuickstartModelConfig  # noqa: E402
from megatron_spo.experiments.quickstart import QuickstartConfig  # noqa: E402
from megatron_spo.experiments.reference_model import build_reference, task_from_config  # noqa: E402
from megatron_spo.rewards.config import SandboxConfig  # noqa: E402
from megatron_spo.rewards.reward import RewardPool  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The quickstart's tokenizer as the trainer loads it: saved with the reference, read back."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_char_tokenizer().save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def quickstart_prompts(tokenizer):
    return make_prompts(list(task_from_config(QuickstartConfig().reference).train), tokenizer)


def trl_prompt_ids(tokenizer, texts):
    """GRPOTrainer's own tokenization of plain-text prompts (its _tokenize_prompts, on a stand-in trainer)."""
    stand_in = types.SimpleNamespace(processing_class=tokenizer, _is_vlm=False)
    return [list(ids) for ids in trl.GRPOTrainer._tokenize_prompts(stand_in, list(texts))[0]]


# ---------------------------------------------------------------------------------------------
# (a) TRL sees exactly prompt.tokens
# ---------------------------------------------------------------------------------------------
def test_trl_tokenizes_every_training_prompt_to_prompt_tokens(tokenizer, quickstart_prompts):
    assert len(quickstart_prompts) == 120
    texts = trl_grpo.prompt_texts(quickstart_prompts, tokenizer)
    assert trl_prompt_ids(tokenizer, texts) == [p.tokens for p in quickstart_prompts]
    assert texts == [p.problem.prompt for p in quickstart_prompts]  # the toy task's raw prompt, BOS added by TRL
    trl_grpo.check_prompt_tokens(quickstart_prompts, texts, lambda t: trl_prompt_ids(tokenizer, t))


def test_a_prompt_trl_cannot_reproduce_is_refused(tokenizer):
    no_bos = Prompt("p0", tokenizer("print(1)\n", add_special_tokens=False)["input_ids"])  # TRL always adds BOS
    with pytest.raises(ValueError, match="prompt 'p0'.*first difference at position 0"):
        trl_grpo.prompt_texts([no_bos], tokenizer)
    with pytest.raises(ValueError, match="prompt 'p0'"):
        trl_grpo.check_prompt_tokens([no_bos], ["print(1)\n"], lambda t: trl_prompt_ids(tokenizer, t))


def test_missing_trl_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "trl", None)
    with pytest.raises(ImportError, match=r"pip install megatron-spo\[bench\]") as err:
        trl_grpo.train_trl_grpo(tmp_path, [], None, tmp_path, steps=1, lr=1e-4, beta=0.1, prompts_per_step=1,
                                samples_per_prompt=2, max_new_tokens=4, warmup_steps=0, seed=0)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# (b) the reward TRL gets is our RewardPool's, on the text our engines return
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox_rewards():
    from megatron_spo.rewards.sandbox import SandboxPool, SandboxUnavailableError

    if os.geteuid() != 0:
        pytest.skip("per-slot uids need root (the CI machine runs as root)")
    try:
        sandbox = SandboxPool(SandboxConfig(time_limit_s=1.0, memory_mb=256, slots=2, uid_base=2_200_000))
    except SandboxUnavailableError as err:
        pytest.skip(f"no bubblewrap here: {err}")
    pool = RewardPool(sandbox)
    yield pool
    pool.close()
    sandbox.close()


def test_reward_function_is_the_reward_pool_on_engine_text(tokenizer, quickstart_prompts, sandbox_rewards):
    eos = tokenizer.eos_token_id
    prompts = quickstart_prompts[:3]
    rows = []  # (prompt, completion ids) as TRL hands them over: up to and including EOS, or cut at the limit
    for i, p in enumerate(prompts):
        own = tokenizer(p.problem.solutions[0], add_special_tokens=False)["input_ids"]
        other = tokenizer(prompts[(i + 1) % 3].problem.solutions[0], add_special_tokens=False)["input_ids"]
        rows += [(p, own + [eos]), (p, other + [eos]), (p, own[: len(own) - 3]), (p, [eos]),
                 (p, tokenizer("print(0)\n", add_special_tokens=False)["input_ids"] + [eos])]
    ids = [c for _, c in rows]
    assert trl_grpo.completion_text(tokenizer, ids[0]) == prompts[0].problem.solutions[0]  # EOS dropped

    fn = trl_grpo.reward_function(sandbox_rewards, prompts, tokenizer)
    got = asyncio.run(fn(prompts=[None] * len(rows), completions=[None] * len(rows), completion_ids=ids,
                         prompt_id=[p.prompt_id for p, _ in rows]))
    ours = [sandbox_rewards(p.problem, tokenizer.decode(c, skip_special_tokens=True)).reward for p, c in rows]
    assert got == ours
    assert got[0::5] == [0.0] * 3  # each problem's own solution passes its tests
    assert got[3::5] == got[4::5] == [-1.0] * 3  # an empty completion and a wrong program fail


# ---------------------------------------------------------------------------------------------
# (c) two steps: metrics, changed weights, a checkpoint transformers and our conversion load
# ---------------------------------------------------------------------------------------------
def test_two_trl_steps_train_log_and_save(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from megatron_spo.models.hf_checkpoint import HFReader, read_hf_config
    from megatron_spo.training.metrics import read_metrics

    ref_cfg = QuickstartModelConfig(
        task=ToyCodeTaskConfig(num_problems=12, max_solutions=4, num_sft_problems=30), hidden_size=32,
        num_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        max_position_embeddings=128, sft_steps=3, batch_size=4, warmup_steps=1, num_threads=1)
    ref = build_reference(ref_cfg, tmp_path / "cache", progress=False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref)
    prompts = make_prompts(list(task_from_config(ref_cfg).train)[:4], tok)
    # a reward that varies within every group (so the step has a gradient), through the RewardPool's custom path
    pool = RewardPool(custom=lambda problem, text: -float(zlib.crc32(text.encode()) % 3))

    trainers = []

    class Recording(trl.GRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            trainers.append(self)

    monkeypatch.setattr(trl, "GRPOTrainer", Recording)
    out = tmp_path / "run"
    hf = trl_grpo.train_trl_grpo(ref, prompts, pool, out, steps=2, lr=1e-2, beta=0.1, prompts_per_step=2,
                                 samples_per_prompt=4, max_new_tokens=12, warmup_steps=0, seed=0, progress=False)
    pool.close()
    assert hf == out / "hf"

    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert math.isfinite(r["loss"]) and math.isfinite(r["reward"]) and math.isfinite(r["grad_norm"])
        assert r["samples/online"] == 8 and r["time/step"] > 0 and "entropy" in r and "kl_ref_k3" in r
    assert records[1]["time"] >= records[0]["time"] > 0

    trained = trainers[0].model.eval()
    reloaded = AutoModelForCausalLM.from_pretrained(hf).eval()
    reference = AutoModelForCausalLM.from_pretrained(ref).eval()
    assert reloaded.dtype == reference.dtype == torch.float32
    ids = torch.tensor([prompts[0].tokens + prompts[1].tokens[1:]])
    with torch.no_grad():
        logits = trained(input_ids=ids).logits
        assert torch.equal(reloaded(input_ids=ids).logits, logits)
        assert not torch.allclose(reference(input_ids=ids).logits, logits)
    changed = [n for n, p in reference.state_dict().items() if not torch.equal(p, reloaded.state_dict()[n])]
    assert changed

    cfg = read_hf_config(hf)  # what the HF -> Megatron conversion and the engines read
    assert cfg == read_hf_config(ref)
    HFReader(hf).validate(cfg)
    assert (hf / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()
