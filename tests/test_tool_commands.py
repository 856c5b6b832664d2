"""The commands that score speak with one reward (issue 64): estimate-q0, eval, pts and sample score with a training
config's task.reward hook as train does (or with --reward), not with the task's built-in reward, and say so in one
line; eval reads a config's held-out problems, finds the engines' tokenizer behind sglang-router and records every
sample; convert summarises megatron-core's warnings as train does; validate's help is whole.

The engine is the in-process local engine of a tiny random Llama (rollout_helpers), sampled with seeds on
deterministic inference, so two runs of a command draw the same samples and differ only in how they are scored.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from rollout_helpers import FaultyServer, ServerThread, engine_env, make_tiny_llama, start_on_free_port  # noqa: E402

from megatron_spo import cli  # noqa: E402

HOOKS = '''
def even(problem, text):
    """Passes when the character codes of the completion sum to an even number: about half of any samples."""
    return 0.0 if sum(map(ord, text)) % 2 == 0 else -1.0


def odd(problem, text):
    return -1.0 if sum(map(ord, text)) % 2 == 0 else 0.0


def starts_x(problem, text):
    return 0.0 if text.startswith("x") else -1.0


def not_x(problem, text):
    return -1.0 if text.startswith("x") else 0.0
'''
SAMPLING = ["--limit", "2", "--temperature", "1.0", "--seed", "5", "--max-new-tokens", "7", "--no-progress"]


def even(text: str) -> bool:
    return sum(map(ord, text)) % 2 == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def engine(model_dir):
    from megatron_spo.rollout.local_engine import LocalEngine

    with ServerThread(LocalEngine(model_dir, seed=0, deterministic=True)) as srv:
        yield srv


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    """The module 'spo_tool_hooks' of reward hooks, importable by the commands."""
    (tmp_path / "spo_tool_hooks.py").write_text(HOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "spo_tool_hooks"
    sys.modules.pop("spo_tool_hooks", None)


def train_config(path, model_dir: str, url: str, reward: str) -> str:
    """A training config naming the engine, the tokenizer and the toy task with ``reward`` as its task.reward."""
    path.write_text(f"init: {{hf: {model_dir}}}\ntask: {{kind: toy, reward: '{reward}'}}\n"
                    f"fleet: {{engine_urls: ['{url}']}}\n")
    return str(path)


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_estimate_q0_eval_and_sample_score_with_the_configs_hook_and_reward_flips_them(engine, model_dir, hooks,
                                                                                      tmp_path, capsys):
    """The config's task.reward passes the samples whose character codes sum to an even number, --reward HOOK the
    others: the same seeded samples, so every prompt's count under one plus its count under the other is n, and
    each recorded verdict is the hook's (a random model passes none of the built-in toy reward's tests)."""
    from megatron_spo.data.offline_store import load_trajectories
    from megatron_spo.data.problems import load_problems

    config = train_config(tmp_path / "train.yaml", model_dir, engine.url, f"{hooks}:even")
    flag = ["--engine-url", engine.url, "--task", "toy", "--reward", f"{hooks}:odd"]  # tokenizer: the engine's
    runs = {}
    for name, source in (("config", [config]), ("flag", flag)):
        out = tmp_path / name
        assert cli.main(["estimate-q0", *source, "--out", str(out / "q0.jsonl"), "--samples", "8", *SAMPLING]) == 0
        assert cli.main(["eval", *source, "--out", str(out / "ev.jsonl"), "-n", "6", "--ks", "1", *SAMPLING]) == 0
        assert cli.main(["sample", *source, "--store", str(out / "store"), "--n", "4", *SAMPLING]) == 0
        runs[name] = {"q0": jsonl(out / "q0.jsonl"), "eval": jsonl(out / "ev.jsonl"),
                      "samples": jsonl(out / "ev.completions.jsonl"), "stdout": capsys.readouterr().out,
                      "store": load_trajectories(str(out / "store"))}
    said = f"scoring with task.reward {hooks}:even of {config}, as train scores"
    for tool in ("estimate-q0", "eval", "sample"):
        assert f"{tool}: {said}" in runs["config"]["stdout"]
        assert f"{tool}: scoring with --reward {hooks}:odd\n" in runs["flag"]["stdout"]
    mine, theirs = runs["config"], runs["flag"]

    # estimate-q0: the training prompts, each prompt's correct count complementary
    train_ids = [p.id for p in load_problems("toy", split="train")[:2]]
    assert [r["prompt_id"] for r in mine["q0"]] == [r["prompt_id"] for r in theirs["q0"]] == train_ids
    assert [a["correct"] + b["correct"] for a, b in zip(mine["q0"], theirs["q0"])] == [8, 8]
    assert 0 < sum(r["correct"] for r in mine["q0"]) < 16  # the hook's verdicts, not the built-in's 0

    # eval: the config's held-out problems (the generated task's held-out split), every sample recorded
    heldout_ids = [p.id for p in load_problems("toy", split="heldout")[:2]]
    assert [r["prompt_id"] for r in mine["eval"]] == [r["prompt_id"] for r in theirs["eval"]] == heldout_ids
    assert [a["correct"] + b["correct"] for a, b in zip(mine["eval"], theirs["eval"])] == [6, 6]
    for run, passes in ((mine, even), (theirs, lambda t: not even(t))):
        assert [(s["prompt_id"], s["sample"]) for s in run["samples"]] == [(p, i) for p in heldout_ids
                                                                            for i in range(6)]
        assert all(s["passed"] == passes(s["text"]) and s["reward"] == (0.0 if s["passed"] else -1.0)
                   and s["info"] == {"custom": True} for s in run["samples"])
        for record in run["eval"]:
            correct = sum(s["passed"] for s in run["samples"] if s["prompt_id"] == record["prompt_id"])
            assert record["correct"] == correct and record["pass@1"] == pytest.approx(correct / 6)
    assert [s["text"] for s in mine["samples"]] == [s["text"] for s in theirs["samples"]]

    # sample: every sample stored with the hook's reward
    assert len(mine["store"]) == len(theirs["store"]) > 0
    passing = [sum(t.reward == 0.0 for t in run["store"]) for run in (mine, theirs)]
    assert sum(passing) == len(mine["store"]) and 0 < passing[0] < len(mine["store"])
    assert f"{passing[0]} pass" in mine["stdout"] and f"{passing[1]} pass" in theirs["stdout"]


def test_pts_scores_with_the_configs_hook(engine, model_dir, hooks, tmp_path, capsys):
    """Under task.reward 'starts with x' a trajectory "xyzwvuts" succeeds from its first token on: S = 1 exactly after
    it, that token is pivotal. Under --reward 'does not start with x' the prompt alone almost surely succeeds: no
    gap, nothing searched into. (The built-in reward runs neither as a program that passes its tests.)"""
    from transformers import AutoTokenizer

    from megatron_spo.data.problems import load_problems
    from megatron_spo.data.prompts import make_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    [prompt] = make_prompts(load_problems("toy", split="train")[:1], tokenizer)
    record = {"prompt_id": prompt.prompt_id, "prompt_tokens": list(prompt.tokens),
              "response_tokens": tokenizer("xyzwvuts", add_special_tokens=False)["input_ids"], "reward": 0.0,
              "source": "reference", "policy_version": 0}
    (tmp_path / "in.jsonl").write_text(json.dumps(record) + "\n")
    config = train_config(tmp_path / "train.yaml", model_dir, engine.url, f"{hooks}:starts_x")
    common = ["--trajectories", str(tmp_path / "in.jsonl"), "-k", "8", "--threshold", "0.3", "--max-new-tokens", "6",
              "--seed", "3", "--no-progress"]
    assert cli.main(["pts", config, "--out", str(tmp_path / "x.jsonl"), *common]) == 0
    stdout = capsys.readouterr().out
    assert f"pts: scoring with task.reward {hooks}:starts_x of {config}" in stdout and "1 pivotal tokens" in stdout
    [out] = jsonl(tmp_path / "x.jsonl")
    assert out["mc_targets"] == [{"t": 0, "success_prob": 1.0}, {"t": 1, "success_prob": 1.0},
                                 {"t": 3, "success_prob": 1.0}]
    assert cli.main(["pts", "--engine-url", engine.url, "--task", "toy", "--reward", f"{hooks}:not_x",
                     "--out", str(tmp_path / "not-x.jsonl"), *common]) == 0
    assert "0 pivotal tokens" in capsys.readouterr().out
    assert jsonl(tmp_path / "not-x.jsonl")[0]["mc_targets"] == []


def test_a_reward_hook_that_does_not_load_is_one_line_naming_the_flag_or_the_field(engine, model_dir, hooks, tmp_path,
                                                                                  capsys):
    argv = ["--engine-url", engine.url, "--task", "toy", "--out", str(tmp_path / "ev.jsonl"), "-n", "2", "--ks", "1",
            *SAMPLING]
    assert cli.main(["eval", *argv, "--reward", f"{hooks}:missing"]) == 2
    assert capsys.readouterr().err.strip() == f"megatron-spo eval: config error: --reward: module '{hooks}' has no " \
                                              "attribute 'missing'"
    config = train_config(tmp_path / "train.yaml", model_dir, engine.url, "no_such_module:score")
    assert cli.main(["estimate-q0", config, "--out", str(tmp_path / "q0.jsonl"), "--samples", "2", *SAMPLING]) == 2
    assert capsys.readouterr().err.startswith("megatron-spo estimate-q0: config error: task.reward: cannot import "
                                              "'no_such_module'")
    assert not (tmp_path / "ev.jsonl").exists() and not (tmp_path / "q0.jsonl").exists()  # refused before sampling


def test_eval_behind_sglang_router_finds_the_engines_tokenizer(engine, hooks, tmp_path, capsys):
    """sglang-router answers /model_info with 404: eval reads the tokenizer folder of its first worker (/workers)
    instead of asking for --tokenizer; an engine naming a folder this machine lacks is one line naming the flag."""
    pytest.importorskip("sglang_router")
    from megatron_spo.net import free_port

    def start(port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "megatron_spo.cli", "router", "--host", "127.0.0.1", "--port",
                                 str(port), "--worker-urls", engine.url, "--policy", "round_robin", "--log-level",
                                 "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                                env=engine_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    router, url = start_on_free_port(start, "router")
    try:
        from megatron_spo.rollout.client import get_json

        deadline = time.monotonic() + 60
        while not get_json(url + "/workers")[1].get("workers"):  # the router registers its worker after /health
            assert time.monotonic() < deadline, "the router registered no worker in 60 s"
            time.sleep(0.1)
        assert get_json(url + "/model_info")[0] == 404  # what made eval ask for --tokenizer
        assert cli.main(["eval", "--router-url", url, "--task", "toy", "--reward", f"{hooks}:even", "--out",
                         str(tmp_path / "ev.jsonl"), "-n", "3", "--ks", "1", *SAMPLING]) == 0
    finally:
        router.terminate()
        router.wait(30)
    samples = jsonl(tmp_path / "ev.completions.jsonl")
    assert [s["sample"] for s in samples] == [0, 1, 2] * 2
    assert all(set(s) == {"prompt_id", "sample", "text", "reward", "passed", "info"} for s in samples)
    assert f"-> {tmp_path / 'ev.jsonl'} (samples: {tmp_path / 'ev.completions.jsonl'})" in capsys.readouterr().out
    with FaultyServer("error") as faulty:  # its /model_info names the folder 'faulty'
        assert cli.main(["eval", "--engine-url", f"http://127.0.0.1:{faulty.port}", "--task", "toy", "--out",
                         str(tmp_path / "f.jsonl"), "-n", "1", "--ks", "1", "--no-progress"]) == 2
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"megatron-spo eval: error: http://127.0.0.1:{faulty.port} (/model_info, or its router's /workers) names the "
        "folder 'faulty', not on this machine; pass --tokenizer DIR")


def test_a_cut_eval_resumes_with_each_sample_recorded_once(engine, hooks, tmp_path):
    """The completions file follows the results file: a problem cut before its result line is sampled again and
    its earlier lines dropped, so a resumed run ends with the file an uninterrupted one writes."""
    argv = ["eval", "--engine-url", engine.url, "--task", "toy", "--reward", f"{hooks}:even", "-n", "3", "--ks", "1",
            *SAMPLING]
    assert cli.main([*argv, "--out", str(tmp_path / "full.jsonl")]) == 0
    full = (tmp_path / "full.completions.jsonl").read_text().splitlines(keepends=True)
    results = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "cut.jsonl").write_text(results[0])  # the first problem done; the second cut after its samples
    (tmp_path / "cut.completions.jsonl").write_text("".join(full) + full[0][:10])  # and a torn line
    assert cli.main([*argv, "--out", str(tmp_path / "cut.jsonl")]) == 0
    assert (tmp_path / "cut.completions.jsonl").read_text() == "".join(full)
    assert (tmp_path / "cut.jsonl").read_text() == "".join(results)


def test_convert_summarises_megatrons_warnings_in_one_line(tmp_path):
    """A fresh process (megatron-core warns when first imported): its fallback warnings go to OUT.warnings.log,
    one line says how many, none reaches stderr."""
    from trainer_helpers import make_tiny_hf

    hf = make_tiny_hf(str(tmp_path / "hf"))
    out = tmp_path / "mcore"
    proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "convert", "hf-to-megatron", "--hf", hf, "--out",
                           str(out)], capture_output=True, text=True, env=engine_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = tmp_path / "mcore.warnings.log"
    count = len(re.findall(r"^\S+:\d+: \w*Warning: ", log.read_text(), re.M))
    assert count > 0 and not any(p in proc.stderr for p in ("/megatron/core/", "/apex/", "/transformer_engine/"))
    assert f"[megatron-spo] {count} library warning{'s' * (count != 1)} suppressed, see {log}" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"wrote {out}"


def test_validate_help_is_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        cli.main(["validate", "--help"])
    description = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert description.endswith("each on one line naming its field, all at once.")


def test_the_own_fleet_section_of_the_docs_holds(monkeypatch, capsys):
    """docs/at-scale.md "Your own fleet, outside SLURM": its `fleet up` flags exist, its fleet block and its
    exports name the same endpoints (FleetEndpoints, as train, eval and estimate-q0 resolve them)."""
    import shlex
    from pathlib import Path

    import yaml

    from megatron_spo.rollout.config import FleetEndpoints

    text = (Path(__file__).resolve().parents[1] / "docs" / "at-scale.md").read_text()
    section = text.split("## Your own fleet, outside SLURM\n", 1)[1].split("\n## ", 1)[0]
    code = [line[4:] for line in section.splitlines() if line.startswith("    ")]
    [up] = [line for line in code if line.startswith("megatron-spo fleet up ")]
    with pytest.raises(SystemExit):
        cli.main(["fleet", "up", "--help"])
    flags = capsys.readouterr().out
    assert all(f"{word} " in flags for word in shlex.split(up) if word.startswith("--"))
    start = code.index("fleet:")
    block = yaml.safe_load("\n".join(code[start:start + 4]))
    from_config = FleetEndpoints(**block["fleet"]).resolved()
    for line in (line for line in code if line.startswith("export ")):
        name, value = shlex.split(line.split("#")[0])[1].split("=", 1)
        monkeypatch.setenv(name, value)
    from_env = FleetEndpoints().resolved()
    assert (from_env.router_url, from_env.engine_urls) == (from_config.router_url, from_config.engine_urls)
    assert from_config.engine_urls == ["http://127.0.0.1:30010", "http://127.0.0.1:30011"]  # --engine-base-port 30010


def test_what_eval_reads_of_a_training_config_keeps_the_trainers_defaults():
    """engine_tools/ cannot import training/: its view of the eval section repeats HeldOutEvalConfig's defaults."""
    from megatron_spo.engine_tools.config import HeldOutView
    from megatron_spo.training.config import HeldOutEvalConfig

    assert HeldOutView().model_dump() == HeldOutEvalConfig().model_dump(include=set(HeldOutView.model_fields))


def test_eval_of_a_config_with_an_environment_also_evaluates_conversations(model_dir, engine, hooks, tmp_path,
                                                                           capsys):
    """`eval CONFIG` whose rollout.env is code_feedback: beside the single-turn samples, the held-out problems as
    conversations (up to 2 model turns; the tiny random model's programs always fail, so every conversation takes
    both), in OUT.turns.json and one line; the environment's sandbox is started though the reward is a hook that
    needs none. --single-turn skips it; an unknown environment is one line naming the field, before sampling; on
    engines with deterministic inference the conversations are refused in one line, the single-turn results kept."""
    from megatron_spo.data.problems import load_problems
    from megatron_spo.rollout.local_engine import LocalEngine

    def config(url: str, env: str) -> str:
        path = tmp_path / f"train-{env.split(':')[0]}.yaml"
        path.write_text(f"init: {{hf: {model_dir}}}\ntask: {{kind: toy, reward: '{hooks}:even'}}\n"
                        f"fleet: {{engine_urls: ['{url}']}}\nrollout: {{env: {{name: {env}, max_turns: 2, max_total_tokens: 256, max_observation_tokens: 64}}}}\n")
        return str(path)

    argv = ["-n", "4", "--ks", "1", "2", *SAMPLING]
    with ServerThread(LocalEngine(model_dir, seed=0)) as sampling_engine:
        good = config(sampling_engine.url, "code_feedback")
        assert cli.main(["eval", good, "--out", str(tmp_path / "ev.jsonl"), *argv]) == 0
        said = capsys.readouterr().out
        assert cli.main(["eval", good, "--out", str(tmp_path / "single.jsonl"), "--single-turn", *argv]) == 0
    turns = json.loads((tmp_path / "ev.turns.json").read_text())
    held_out = [p.id for p in load_problems("toy", split="heldout")[:2]]
    assert [p["prompt_id"] for p in turns["first_turn"]["problems"]] == held_out
    assert [p["prompt_id"] for p in turns["last_turn"]["problems"]] == held_out
    assert all(p["n"] == 4 and p["tests"] == {"custom": 1} for p in turns["last_turn"]["problems"])
    assert turns["mean_turns"] == 2.0 and (turns["first_turn"]["temperature"], turns["first_turn"]["top_p"]) == (1.0, 0.95)
    first, last = (turns[k]["mean"] for k in ("first_turn", "last_turn"))
    assert (f"eval: as conversations with code_feedback (up to 2 model turns): pass@1 {first['pass@1']:.4f} at the "
            f"first turn, {last['pass@1']:.4f} at the last, pass@2 {first['pass@2']:.4f} at the first turn, "
            f"{last['pass@2']:.4f} at the last; 2.00 model turns a conversation, {100 * turns['fixed_share']:.1f}% "
            f"fixed by the feedback -> {tmp_path / 'ev.turns.json'}") in said
    assert (tmp_path / "single.jsonl").exists() and not (tmp_path / "single.turns.json").exists()

    assert cli.main(["eval", config(engine.url, "no_such_env"), "--out", str(tmp_path / "bad.jsonl"), *argv]) == 2
    assert "rollout.env.name" in capsys.readouterr().err and not (tmp_path / "bad.jsonl").exists()
    assert cli.main(["eval", config(engine.url, "env_helpers:Scripted"), "--out", str(tmp_path / "det.jsonl"),
                     *argv]) == 2
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"megatron-spo eval: error: rollout engines ['{engine.url}'] run with --enable-deterministic-inference: the 4 "
        "samples of each request would be identical (SGLang shares one seed among them); restart them without it")
    assert len(jsonl(tmp_path / "det.jsonl")) == 2 and not (tmp_path / "det.turns.json").exists()


def test_estimate_q0_of_a_config_with_an_environment_counts_conversations(model_dir, engine, hooks, tmp_path,
                                                                          capsys):
    """estimate-q0 CONFIG whose rollout.env is a 2-turn environment ending with 0 when the last model turn's text has
    an even length: each prompt's successes are those conversations (all kept, with their mask, q0 and the verdict
    recomputed from the decoded last turn), the line names the environment, a single-turn file does not resume as
    conversations, and a final reward outside {0, -1} is one line."""
    from transformers import AutoTokenizer

    from megatron_spo.data.trajectory import model_turns
    from megatron_spo.rollout.local_engine import LocalEngine

    def config(url: str, env: str) -> str:
        path = tmp_path / f"train-{env.split(':')[-1]}.yaml"
        path.write_text(f"init: {{hf: {model_dir}}}\ntask: {{kind: toy, reward: '{hooks}:even'}}\n"
                        f"fleet: {{engine_urls: ['{url}']}}\nrollout: {{env: {env}}}\n")
        return str(path)

    argv = ["--samples", "6", "--keep-successful", "6", *SAMPLING]
    q0, kept = tmp_path / "q0.jsonl", tmp_path / "kept.jsonl"
    with ServerThread(LocalEngine(model_dir, seed=0)) as sampling_engine:
        good = config(sampling_engine.url, "{name: 'env_helpers:LastTurnParity', options: {turns: 2}}")
        assert cli.main(["estimate-q0", good, "--out", str(q0), "--trajectories-out", str(kept), *argv]) == 0
        said = capsys.readouterr().out
        assert cli.main(["estimate-q0", good, "--out", str(tmp_path / "s.jsonl"), "--single-turn", *argv]) == 0
        assert cli.main(["estimate-q0", good, "--out", str(tmp_path / "s.jsonl"), *argv]) == 2
        refused = capsys.readouterr().out.strip().splitlines()[-1]
        odd = config(sampling_engine.url, "{name: 'env_helpers:Scripted', options: {turns: 2, reward: -0.25}}")
        assert cli.main(["estimate-q0", odd, "--out", str(tmp_path / "odd.jsonl"), *argv]) == 2
        odd_said = capsys.readouterr().out.strip().splitlines()[-1]
    lines, convs = jsonl(q0), jsonl(kept)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(lines) == 2 and all(r["env"] == "env_helpers:LastTurnParity" and r["n"] == 6 for r in lines)
    assert 0 < len(convs) < 12  # some conversations ended even, some odd (all one way: 2 in 4096)
    for line in lines:
        mine = [c for c in convs if c["prompt_id"] == line["prompt_id"]]
        assert len(mine) == line["correct"] and all(c["q0"] == line["q0"] and c["reward"] == 0.0 for c in mine)
        for c in mine:
            turns = model_turns(c["response_mask"])
            assert len(turns) == 2 and c["source"] == "reference"
            a, b = turns[-1]
            assert len(tok.decode(c["response_tokens"][a:b], skip_special_tokens=True)) % 2 == 0
    assert "6 conversations with env_helpers:LastTurnParity (up to 4 model turns) each" in said
    assert "env" not in jsonl(tmp_path / "s.jsonl")[0]
    assert refused == (f"megatron-spo estimate-q0: error: {tmp_path / 's.jsonl'}: prompt '{lines[0]['prompt_id']}' "
                       "was estimated single-turn; this run asks conversations with env_helpers:LastTurnParity (use "
                       "another output file)")
    assert odd_said.startswith("megatron-spo estimate-q0: error: a conversation of prompt") and \
        odd_said.endswith("ended with reward -0.25: Q0 from success counts needs final rewards of 0 or -1 "
                          "(env_helpers:Scripted)")
