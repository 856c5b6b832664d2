"""Helpers for trainer tests: a tiny HF Llama, a deterministic trajectory source, spawned runs."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

import torch

VOCAB = 61


@dataclass
class Traj:
    prompt_id: str
    prompt_tokens: list
    response_tokens: list
    reward: float
    source: str = "online"
    policy_version: int = 0
    q0: float = -0.5
    behaviour_logprobs: list | None = None
    mc_targets: list = field(default_factory=list)


class DeterministicSource:
    """Reproducible trajectories: groups of 4 responses per prompt, rewards in {0, -1}."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.drawn = 0

    def take(self, k: int, timeout_s: float | None = None) -> list:
        out = []
        for _ in range(k):
            pid = f"p{self.drawn // 4}"
            prompt = [self.rng.randrange(1, VOCAB) for _ in range(4)]
            response = [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randrange(2, 9))]
            out.append(Traj(pid, prompt, response, reward=-float(response[0] % 2),
                            behaviour_logprobs=[-4.0] * len(response)))
            self.drawn += 1
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(tuple(state["rng"][0:1]) + (tuple(state["rng"][1]),) + tuple(state["rng"][2:]))
        self.drawn = state["drawn"]


class EngineSource:
    """Online trajectories sampled by the local engine (rollout/local_engine.py, SGLang's sampling rules) from
    ``hf_dir``, as the rollout manager builds them: groups of 4 samples per prompt at ``temperature`` / ``top_p``
    with the engine's log-probs (log softmax(logits / T), as SGLang reports them); a temperature range (lo, hi): T ~
    U(lo, hi) per request, as the rollout manager draws it; ``routes``: with the experts the engine routed each token
    to (an MoE model). Rewards: -(first response token odd)."""

    def __init__(self, hf_dir: str, dtype: str = "float32", seed: int = 0, prompt_len: int = 6, new_tokens: int = 10,
                 temperature: float | tuple[float, float] = 1.0, top_p: float = 1.0, routes: bool = False):
        from megatron_spo.rollout.local_engine import LocalEngine

        self.engine = LocalEngine(hf_dir, dtype=dtype, seed=seed, return_routed_experts=routes)
        self.g = torch.Generator().manual_seed(seed)
        self.prompt_len, self.new_tokens, self.drawn = prompt_len, new_tokens, 0
        self.temperature, self.top_p, self.routes = temperature, top_p, routes
        self.takes: list[int] = []  # the draws so far (a resume replays them: the same samples after it)

    def take(self, k: int, timeout_s: float | None = None) -> list:
        from megatron_spo.rollout.local_engine import Req
        from megatron_spo.rollout.manager import Trajectory
        from megatron_spo.rollout.protocol import SamplingParams

        self.takes.append(k)
        reqs, prompt = [], []
        for i in range(k):
            if i % 4 == 0:  # a group of 4 samples per prompt
                prompt = torch.randint(1, self.engine.vocab_size, (self.prompt_len,), generator=self.g).tolist()
            t = self.temperature
            if isinstance(t, tuple):
                t = t[0] + (t[1] - t[0]) * float(torch.rand((), generator=self.g))
            params = SamplingParams(max_new_tokens=self.new_tokens, temperature=t, top_p=self.top_p)
            reqs.append(Req(prompt, params, f"r{self.drawn + i}", routes=[] if self.routes else None))
        self.engine.generate(reqs)
        out = []
        for i, r in enumerate(reqs):
            extra = {}
            if self.routes:
                from megatron_spo.data.routes import RoutedExperts

                extra["routed_experts"] = RoutedExperts.from_array(torch.cat(r.routes).numpy())
            out.append(Trajectory(prompt_id=f"p{(self.drawn + i) // 4}", prompt_tokens=r.prompt,
                                  response_tokens=r.output_ids, reward=-float(r.output_ids[0] % 2), source="online",
                                  policy_version=0, behaviour_logprobs=r.logprobs, q0=-0.5,
                                  temperature=r.params.temperature, top_p=self.top_p, **extra))
        self.drawn += k
        return out

    def state_dict(self) -> dict:
        return {"drawn": self.drawn, "takes": list(self.takes)}

    def load_state_dict(self, state: dict) -> None:
        """Draw again what the checkpointed source drew (the engine's and the prompts' generators end where its did)."""
        for k in state.get("takes", []):
            self.take(k)
        self.drawn = state["drawn"]


def guide_file(root) -> str:
    """Demonstrations for prompts p0 and p2 (DeterministicSource's first groups of steps 1 and 2; p1, p3 get none)."""
    path = os.path.join(str(root), "guide.jsonl")
    rows = [{"prompt_id": p, "prompt_tokens": [1, 2, 3, 4], "response_tokens": [5, 6, 7, 8, 9], "reward": 0.0,
             "source": "expert", "policy_version": 0} for p in ("p0", "p2")]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def trainer_config(root, hf: str, name: str, algo: str = "spo", tp: int = 1, pp: int = 1, steps: int = 2,
                   **overrides) -> dict:
    """The trainer tests' TrainConfig data (tests/test_trainer.py, tools/gpu_part_training.py): a run of `steps`
    steps of 8 sequences on DeterministicSource; algo "grpo-guided" is GRPO with guide_file's demonstrations."""
    if algo == "grpo-guided":
        algo, overrides = "grpo", {"grpo": {"guide_path": guide_file(root)}, **overrides}
    cfg = dict(run_dir=os.path.join(str(root), name), steps=steps, algo=algo, beta=0.5, init={"hf": hf},
               parallel={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
               optimizer={"lr": 1e-3, "warmup_steps": 2},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               model_update_interval=1, checkpoint={"interval": 100}, logging={"progress": False})
    if algo in ("agro", "grpo"):  # whole prompt groups (4 sequences) per micro-batch
        cfg["batch"] = dict(cfg["batch"], max_tokens_per_micro_batch=64)
    if algo in ("ppo", "grpo"):  # importance ratios: the behaviour log-probs are of T = 1, top-p 1 sampling
        cfg["rollout"] = {"temperature_range": [1.0, 1.0], "top_p": 1.0}
    cfg.update(overrides)
    return cfg


def make_tiny_hf(path: str, seed: int = 0, num_layers: int = 2) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def train_and_dump(runs: list[tuple[dict, str]]) -> None:
    """One rank: for each (config, out_file), train with the deterministic online source, then save the
    full HF-named weights to out_file. The runs share the processes (one spawn for several trainings)."""
    from megatron_spo.models.hf_map import iter_hf_tensors
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, out_file) in enumerate(runs):
        trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=DeterministicSource())
        try:
            trainer.train()
            weights = {name: t.clone() for name, t in iter_hf_tensors(trainer.policy, trainer.model_cfg)}
            if trainer.rank == 0:
                torch.save(weights, out_file)
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)


def train_configs(runs: list[dict]) -> None:
    """One rank: train each TrainConfig data in turn with its own sources (the processes shared by the runs)."""
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, cfg_data in enumerate(runs):
        trainer = Trainer(TrainConfig.model_validate(cfg_data))
        try:
            trainer.train()
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)


def run_spawned(runs: list[tuple[dict, str]], world_size: int) -> None:
    from megatron_spo.models.parallel import spawn_local

    spawn_local(train_and_dump, world_size, runs)


class FailingPushSource(DeterministicSource):
    """An online source whose first ``failures`` weight pushes reach no engine (as OnlineSource reports it)."""

    def __init__(self, failures: int):
        super().__init__()
        self.failures, self.pushes = failures, []
        self.last_sync_error = None

    def push_weights(self, version: int, named_tensors) -> dict:
        n = sum(1 for _ in named_tensors)
        self.pushes.append((version, n))
        if len(self.pushes) <= self.failures:
            self.last_sync_error = f"weight sync to version {version} reached no engine: {{'http://e0': 'OOM'}}"
            return {"weight_sync/failed": 1.0, "weight_sync/engines_updated": 0.0}
        self.last_sync_error = None
        return {"weight_sync/failed": 0.0, "weight_sync/engines_updated": 1.0}


def train_with_failing_pushes(cfg_data: dict, failures: int, out_file: str) -> None:
    """One rank: train; rank 0's pushes fail ``failures`` times; rank 0 writes its pushes and the error."""
    import json

    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    source = FailingPushSource(failures)
    trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=source)
    error = None
    try:
        trainer.train()
    except RuntimeError as err:
        error = str(err)
    finally:
        trainer.close()
    if trainer.rank == 0:
        with open(out_file, "w") as f:
            json.dump({"pushes": source.pushes, "error": error, "step": trainer.step}, f)
    elif (error is not None) != (failures >= trainer.cfg.rollout.weight_sync_attempts):
        raise AssertionError(f"rank {trainer.rank} did not act with rank 0: {error}")


def train_and_dump_dtypes(runs: list[tuple[dict, str]]) -> None:
    """One rank: for each (config, out_file), train (the online source, if the config has one, is the
    deterministic one), then save {"weights": HF-named weights, "params": {policy parameter name: dtype},
    "main_params": dtypes of the optimizer's main (master) parameters} to out_file."""
    from megatron_spo.models.hf_map import iter_hf_tensors
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, out_file) in enumerate(runs):
        cfg = TrainConfig.model_validate(cfg_data)
        trainer = Trainer(cfg, online_source=DeterministicSource() if "online" in cfg.sources else None)
        try:
            trainer.train()
            weights = {name: t.clone() for name, t in iter_hf_tensors(trainer.policy, trainer.model_cfg)}
            params = {name: str(p.dtype) for chunk in trainer.policy for name, p in chunk.named_parameters()}
            optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
            main = [str(p.dtype) for opt in optimizers for group in opt.optimizer.param_groups for p in group["params"]]
            if trainer.rank == 0:
                torch.save({"weights": weights, "params": params, "main_params": main}, out_file)
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)


class DeterminismRecordingSource(DeterministicSource):
    """Records, at each take(), whether torch's deterministic algorithms are on and cuBLAS's workspace."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def take(self, k: int, timeout_s: float | None = None) -> list:
        self.seen.append([torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")])
        return super().take(k, timeout_s)


def train_recording_determinism(cfg_data: dict, out_file: str) -> None:
    """One rank: train; write what the source saw during training and the flag after close()."""
    import json

    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    source = DeterminismRecordingSource()
    trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=source)
    try:
        trainer.train()
    finally:
        trainer.close()
    with open(out_file, "w") as f:
        json.dump({"during": source.seen, "after": torch.are_deterministic_algorithms_enabled()}, f)


def train_on_engine_samples(runs: list[tuple[dict, dict]]) -> None:
    """One rank: each (config, EngineSource keyword arguments) trains on the local engine's samples of its init.hf
    model; the metrics are in its run_dir."""
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    for i, (cfg_data, source) in enumerate(runs):
        cfg = TrainConfig.model_validate(cfg_data)
        trainer = Trainer(cfg, online_source=EngineSource(cfg.init.hf, **source))
        try:
            trainer.train()
        finally:
            trainer.close(keep_process_group=i < len(runs) - 1)


def toy_q0_file(root, limit: int) -> str:
    """A q0 file for the toy task's first ``limit`` training prompts (SPO refuses prompts without Q0): 1 success
    of 2 samples each."""
    from pathlib import Path

    from test_user_data import write_q0

    from megatron_spo.data.problems import problems_from_task_config
    from megatron_spo.training.config import TrainConfig

    task = TrainConfig.model_validate(dict(init={"hf": "x"}, task={"kind": "toy", "limit": limit})).task
    return write_q0(Path(root) / "q0.jsonl", {p.id: (1, 2) for p in problems_from_task_config(task)})
