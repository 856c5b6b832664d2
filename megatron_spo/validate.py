"""`megatron-spo validate CONFIG [overrides]` (and `megatron-spo train --dry-run`): every problem of a training
config found before anything is spawned or allocated, each on one line naming its field, all at once.

    report = validate(cfg, world_size=64)        # Report(problems=[...], summary="...")
    megatron-spo validate examples/llama3.1-8b-spo.yaml --world-size 64 init.hf=/models/llama

Checked: every path (init.hf, init.megatron, sources.*.path, task.paths, task.dedup_against, task.q0_path); each
offline store (readable, records matching its `select`, each record's q0 or its prompt's in the q0 file when the
algorithm reads Q0, each record's routed_experts against the model's layers, top_k and experts); Q0 for every
online prompt; the tokenizer; the hooks (algo, task.reward, sources.*.loss); the architecture (read from init.hf /
init.megatron); the layout against the world size and the heads; the engines' TP against the heads; sequence
lengths; the per-GPU memory plan of this config's own batch, sequence length, layout, optimizer and recompute
(planning/capacity.py's config_memory: the figure `plan --config` gives).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_spo.config import ConfigError, load_config
from megatron_spo.training.config import TrainConfig


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)  # one line each, "field: what is wrong"
    notes: list[str] = field(default_factory=list)  # what was checked and found good (the summary)

    def check(self, where: str, fn, *args, **kw):
        """fn(*args, **kw), or None with its error recorded as a problem of ``where`` (a field name)."""
        try:
            return fn(*args, **kw)
        except Exception as err:  # any failure of a check is a finding, never a traceback
            text = " ".join(str(err).split()) or type(err).__name__
            named = text.startswith((f"{where}:", f"{where}.", f"{where} "))
            self.problems.append(text if named else f"{where}: {text}")
            return None


def default_world_size(cfg: TrainConfig) -> int:
    """Trainer ranks of the launch: WORLD_SIZE (torchrun), SLURM_NTASKS (srun), else cfg.nproc."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return cfg.nproc


def _exists(where: str, path: str, what: str = "path") -> bool:
    if not Path(path).exists():
        raise FileNotFoundError(f"{where}: {what} '{path}' does not exist")
    return True


def _check_paths(cfg: TrainConfig, r: Report) -> None:
    from megatron_spo.data.tasks import expand_paths

    if cfg.init.hf and r.check("init.hf", _exists, "init.hf", cfg.init.hf, "HF directory"):
        if not (Path(cfg.init.hf) / "config.json").is_file():
            r.problems.append(f"init.hf: '{cfg.init.hf}' has no config.json (not an HF model directory)")
    if cfg.init.megatron:
        r.check("init.megatron", _exists, "init.megatron", cfg.init.megatron, "checkpoint")
    for name, src in cfg.sources.items():
        if src.path:
            r.check(f"sources.{name}.path", _exists, f"sources.{name}.path", src.path)
    for item in cfg.task.paths:
        r.check("task.paths", expand_paths, item)
    for item in cfg.task.dedup_against:
        r.check("task.dedup_against", expand_paths, item)
    if cfg.task.q0_path:
        r.check("task.q0_path", _exists, "task.q0_path", cfg.task.q0_path, "q0 file")


def _check_hooks(cfg: TrainConfig, r: Report) -> None:
    from megatron_spo.hooks import is_hook, load_hook
    from megatron_spo.training.algos import algorithm_class

    if is_hook(cfg.algo):
        cls = r.check("algo", algorithm_class, cfg.algo)
        if cls is not None:
            r.check("algo", cls.check_config, cfg)
    if cfg.task.reward:
        r.check("task.reward", load_hook, cfg.task.reward, field="task.reward")
    for name, src in cfg.sources.items():
        if is_hook(src.loss):
            r.check(f"sources.{name}.loss", load_hook, src.loss, field=f"sources.{name}.loss")


def _model(cfg: TrainConfig, r: Report):
    """The model config (given, or read from the init checkpoint: its architecture must be supported)."""
    if cfg.model is not None:
        return cfg.model
    from megatron_spo.training.trainer import _model_config_from_init

    where = "init.megatron" if cfg.init.megatron else "init.hf"
    if not Path(cfg.init.megatron or cfg.init.hf or "").exists():
        return None  # already reported as a missing path
    return r.check(where, _model_config_from_init, cfg.init)


def _check_layout(cfg: TrainConfig, model, world_size: int, r: Report) -> None:
    r.check("parallel", cfg.parallel.check, model, world_size)
    r.check("parallel", cfg.parallel.check_training, model)  # MoE: TP needs sequence parallelism, EP not yet
    tp = cfg.fleet.resolved().engine_tp_size
    if tp is not None and (model.num_attention_heads % tp or (model.num_query_groups % tp and tp % model.num_query_groups)):
        r.problems.append(f"fleet.engine_tp_size: {tp} does not divide model.num_attention_heads "
                          f"{model.num_attention_heads} / num_query_groups {model.num_query_groups} (engines shard "
                          "heads over TP)")
    if cfg.batch.max_seq_length > model.max_position_embeddings:
        r.problems.append(f"batch.max_seq_length: {cfg.batch.max_seq_length} > the model's max_position_embeddings "
                          f"{model.max_position_embeddings}")


def _check_memory(cfg: TrainConfig, model, world_size: int, gpu_memory_gb: float | None, r: Report) -> None:
    """The plan's figure of this config (planning/capacity.py's config_memory: its own optimizer and recompute)
    against one GPU's memory."""
    from megatron_spo.planning.capacity import GB, RECOMPUTE_NAMES, capacity_shape, config_memory
    from megatron_spo.planning.config import CapacityConfig

    if gpu_memory_gb is None:
        import torch

        gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else 80.0
    shape = CapacityConfig(**capacity_shape(cfg, world_size, gpu_memory_gb))
    need = config_memory(model, shape, cfg.parallel).total / GB
    cp = cfg.parallel.context_parallel_size
    what = (f"batch {shape.global_batch_size} x seq {shape.seq_length}, micro-batch {shape.micro_batch_size} x "
            f"{shape.seq_length} tokens" + (f" over CP {cp}" if cp > 1 else "")
            + ("" if shape.recompute == "none" else f", {RECOMPUTE_NAMES[shape.recompute]}"))
    if need > gpu_memory_gb:
        r.problems.append(f"memory: the plan needs {need:.1f} GB per GPU ({what}) > {gpu_memory_gb:.0f} GB "
                          "(megatron-spo plan --config shows the breakdown; raise TP / PP / CP, set "
                          "use_distributed_optimizer or recompute_granularity full, or lower "
                          "batch.max_tokens_per_micro_batch)")
    else:
        r.notes.append(f"memory plan {need:.1f} GB per GPU of {gpu_memory_gb:.0f} ({what})")


def _check_prompt_lengths(cfg: TrainConfig, problems: list, tokenizer, r: Report) -> None:
    """The prompts the online source keeps (at most task.max_prompt_tokens) plus a whole response must fit in
    batch.max_seq_length."""
    from megatron_spo.data.prompts import make_prompts

    prompts = r.check("task", make_prompts, problems, tokenizer)
    if prompts is None:
        return
    kept = [len(p.tokens) for p in prompts if len(p.tokens) <= cfg.task.max_prompt_tokens]
    if not kept:
        r.problems.append(f"task.max_prompt_tokens: all {len(prompts)} prompts are longer than "
                          f"{cfg.task.max_prompt_tokens} tokens (shortest {min(len(p.tokens) for p in prompts)})")
    elif max(kept) + cfg.rollout.max_new_tokens > cfg.batch.max_seq_length:
        r.problems.append(f"batch.max_seq_length: {cfg.batch.max_seq_length} < the longest prompt ({max(kept)} "
                          f"tokens) + rollout.max_new_tokens {cfg.rollout.max_new_tokens}")


def _check_data(cfg: TrainConfig, r: Report, tokenizer=None, model=None) -> None:
    from megatron_spo.data.q0 import ESTIMATE_HINT, q0_table
    from megatron_spo.training.algos import algorithm_needs_q0
    from megatron_spo.training.sources import OfflineSource, check_source_routes

    needs_q0 = bool(r.check("algo", algorithm_needs_q0, cfg))
    table = None
    if cfg.task.q0_path and Path(cfg.task.q0_path).is_file():
        table = r.check("task.q0_path", q0_table, cfg.task.q0_path, cfg.beta)
    if cfg.task.q0_path and table is None:
        needs_q0 = False  # the file is missing or unreadable: reported once above, not again per source
    for name, src in cfg.sources.items():
        if name == "online" or not Path(src.path).exists():
            continue
        source = r.check(f"sources.{name}", OfflineSource, name, src.path, cfg.seed, src.select, q0=table,
                         q0_path=cfg.task.q0_path, needs_q0=needs_q0)
        if source is not None:
            r.notes.append(f"sources.{name}: {len(source.records)} records")
        if source is not None and model is not None:  # what the trainer refuses at its first step, and train before it
            r.check(f"sources.{name}.path", check_source_routes, name, src, model, verify=cfg.checkpoint.verify)
    if "online" not in cfg.sources or any(p.startswith("task.paths") for p in r.problems):
        return
    from megatron_spo.data.problems import problems_from_task_config

    problems = r.check("task", problems_from_task_config, cfg.task)
    if problems is None:
        return
    r.notes.append(f"task: {len(problems)} {cfg.task.kind} problems")
    if tokenizer is not None:
        _check_prompt_lengths(cfg, problems, tokenizer, r)
    if needs_q0 and cfg.task.q0_path is None:
        r.problems.append(f"task.q0_path: algo {cfg.algo} needs Q0 for every online prompt and none is set; "
                          f"{ESTIMATE_HINT}")
    elif needs_q0 and table is not None:
        missing = [p.id for p in problems if str(p.id) not in table]
        if missing:
            r.problems.append(f"task.q0_path: {len(missing)} of {len(problems)} training prompts have no Q0 in "
                              f"{cfg.task.q0_path} (first: '{missing[0]}')")


def _check_tokenizer(cfg: TrainConfig, r: Report):
    folder = cfg.init.hf or cfg.init.megatron
    if "online" in cfg.sources and folder and Path(folder).is_dir():  # the online source tokenizes the prompts
        from transformers import AutoTokenizer

        return r.check("init.hf" if cfg.init.hf else "init.megatron", AutoTokenizer.from_pretrained, folder)
    return None


def _count(n: int) -> str:
    """8.03B, 125M, 53.2K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def validate(cfg: TrainConfig, *, world_size: int | None = None, gpu_memory_gb: float | None = None) -> Report:
    """Every check of the module docstring on a config that parsed; problems and notes in the Report."""
    r = Report()
    world_size = world_size or default_world_size(cfg)
    _check_paths(cfg, r)
    _check_hooks(cfg, r)
    tokenizer = _check_tokenizer(cfg, r)
    model = _model(cfg, r)
    if model is not None:
        r.notes.insert(0, f"{model.architecture} {_count(model.num_parameters())} parameters")
        _check_layout(cfg, model, world_size, r)
        if not any(p.startswith("parallel") for p in r.problems):
            p = cfg.parallel
            cp = f"CP {p.context_parallel_size} x " if p.context_parallel_size > 1 else ""
            r.notes.append(f"layout TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} x {cp}DP "
                           f"{p.data_parallel_size(world_size)} on {world_size} rank(s)")
            r.check("memory", _check_memory, cfg, model, world_size, gpu_memory_gb, r)
    _check_data(cfg, r, tokenizer, model)
    return r


def validate_file(path: str, overrides: list[str] | None = None, **kw) -> Report:
    """validate() of a config file; a config that does not parse gives its field errors, one problem each."""
    try:
        cfg = load_config(TrainConfig, path, overrides or [])
    except ConfigError as err:
        return Report(problems=[p.strip() for p in str(err).split("; ") if p.strip()])
    return validate(cfg, **kw)


def print_report(report: Report, path: str, prog: str = "megatron-spo validate") -> int:
    """Print the problems (exit code 1) or the summary (0)."""
    if report.problems:
        print(f"{prog}: {len(report.problems)} problem(s) in {path}:", file=sys.stderr)
        for line in report.problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"{prog}: {path} OK: " + "; ".join(report.notes))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=None,
                        help="trainer ranks the layout must fit (default: WORLD_SIZE, SLURM_NTASKS, else nproc)")
    parser.add_argument("--gpu-memory-gb", type=float, default=None,
                        help="memory of one trainer GPU for the plan (default: this machine's GPU, else 80)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="training YAML config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for megatron-spo train")
    add_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)  # `train --dry-run` comes here
    parser.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)  # train's flag: nothing to load
    args = parser.parse_intermixed_args(argv)
    report = validate_file(args.config, args.overrides, world_size=args.world_size, gpu_memory_gb=args.gpu_memory_gb)
    return print_report(report, args.config, "megatron-spo train --dry-run" if args.dry_run else "megatron-spo validate")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
