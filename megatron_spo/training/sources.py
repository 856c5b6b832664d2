"""Where a training batch comes from (rank 0 only): offline stores and the online rollout buffer, mixed by weight.

    sampler, online = build_sampler(cfg, online_source)   # online: the 'online' source or None
    trajectories = sampler.next(n)                        # resumable: sampler.state_dict() / load_state_dict()
                                                          # (+ demonstrations spliced into online groups: GRPO's guide)
    archive = build_archive(cfg)                          # the online trajectories, kept (or None)
"""

from __future__ import annotations

import logging

from megatron_spo.data.batching import OfflineCursor, source_counts
from megatron_spo.data.trajectory import record_tokens
from megatron_spo.training.algos import algorithm_needs_q0
from megatron_spo.training.config import GUIDE_SOURCE, TrainConfig

log = logging.getLogger(__name__)


def refuse_too_long(records: list, max_seq_length: int | None, where: str) -> None:
    """ConfigError when a record has more tokens (prompt + response) than a micro-batch row holds: at start, not at
    the step that first draws it."""
    if max_seq_length is None:
        return
    long = [r for r in records if record_tokens(r) > max_seq_length]
    if long:
        from megatron_spo.config import ConfigError

        r = long[0]
        raise ConfigError(f"{where}: {len(long)} of {len(records)} records are longer than batch.max_seq_length "
                          f"{max_seq_length} (e.g. prompt {r.prompt_id!r}: {len(r.prompt_tokens)} + "
                          f"{len(r.response_tokens)} tokens); drop them (`megatron-spo offline build ... --max-tokens "
                          f"{max_seq_length}`) or raise batch.max_seq_length")


def warn_long_responses(records: list, max_new_tokens: int | None, where: str) -> None:
    if max_new_tokens is not None and (warning := long_response_warning(records, max_new_tokens)):
        log.warning(f"{where}: {warning}")


def long_response_warning(records: list, max_new_tokens: int, field: str = "rollout.max_new_tokens") -> str:
    """'' or one line: how many responses are longer than the run's generation budget ``field`` (rollouts and
    evaluations stop at max_new_tokens, so a policy that learns to write like them is cut off there). A warning,
    not a refusal: the loss may train on longer rows."""
    long = [len(r.response_tokens) for r in records if len(r.response_tokens) > max_new_tokens]
    if not long:
        return ""
    return (f"{len(long)} of {len(records)} responses ({len(long) / len(records):.0%}) are longer than "
            f"{field} {max_new_tokens} (up to {max(long)} tokens): rollouts and evaluations stop there, so a policy "
            f"that learns to write like them (SFT, or SPO on them) is cut off; raise {field} to {max(long)} or more")


def provenance_filter(select):
    """The records a source's ``select`` (ProvenanceSelect) keeps, as a predicate; None without one (every record)."""
    if select is None:
        return None
    from megatron_spo.data.experience import ProvenanceFilter

    return ProvenanceFilter(*(None if v is None else set(v) for v in (select.kinds, select.models, select.run_ids)),
                            assume_kind=select.assume_kind)


def check_source_routes(name: str, src, model, *, verify: bool | None = None) -> None:
    """The routed_experts of every record the offline source ``name`` draws (its path and select) can be ``model``'s
    (RoutedExperts.check_for), as the trainer checks each step's (trainer.check_routes), before the first: streamed
    (offline_store.iter_routed), stopped at the first that cannot, a RoutesError naming the source's path, the record
    and its prompt_id, and the field."""
    from megatron_spo.data.offline_store import iter_routed

    keep = provenance_filter(src.select)
    for where, record in iter_routed(src.path, verify=verify):
        if keep is None or keep(record):
            record.routed_experts.check_for(model, f"sources.{name}.path {where} (prompt_id {record.prompt_id!r})")


class OfflineSource:
    """Trajectories from a JSONL file or an offline store, drawn in resumable shuffled epochs."""

    def __init__(self, name: str, path: str, seed: int, select=None, *, q0: dict[str, float] | None = None,
                 q0_path: str | None = None, needs_q0: bool = False, max_seq_length: int | None = None,
                 max_new_tokens: int | None = None, q0_basis: tuple[float, str] | None = None):
        """select: a ProvenanceSelect (config) or None: only records of that provenance are drawn.
        needs_q0: the algorithm reads Q0 (SPO): records without q0 take their prompt's from ``q0`` (the table
        of task.q0_path), or the source is refused naming the prompt; q0_basis (this run's beta, reference identity):
        records whose q0 is of another (an earlier run's archive at another beta or from another reference) take
        the table's too, or the source is refused (data/q0.refresh_foreign_q0). max_seq_length: refuse longer records;
        max_new_tokens: warn of longer responses (long_response_warning)."""
        from megatron_spo.data.offline_store import load_trajectories

        self.name = name
        self.records = load_trajectories(path)
        keep = provenance_filter(select)
        if keep is not None:
            from megatron_spo.config import ConfigError

            total = len(self.records)
            self.records = [r for r in self.records if keep(r)]
            if not self.records:
                raise ConfigError(f"sources.{name}.select: none of the {total} records of {path} match "
                                  f"{select.model_dump(exclude_none=True)}")
        refuse_too_long(self.records, max_seq_length, f"sources.{name} ({path})")
        warn_long_responses(self.records, max_new_tokens, f"sources.{name} ({path})")
        if needs_q0:
            from megatron_spo.config import ConfigError
            from megatron_spo.data.q0 import fill_missing_q0, refresh_foreign_q0

            where = f"sources.{name} ({path})"
            try:
                fill_missing_q0(self.records, q0, where=where, q0_path=q0_path)
                if q0_basis is not None:
                    redone = refresh_foreign_q0(self.records, q0, beta=q0_basis[0], reference=q0_basis[1], where=where)
                    if redone:
                        print(f"[megatron-spo] {where}: {redone} record(s) carried a q0 of another beta or reference; "
                              f"each now has its prompt's Q0 of this run (task.q0_path)", flush=True)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        for r in self.records:
            r.source = name  # the source name selects the loss, whatever the file said
        self.cursor = OfflineCursor(len(self.records), seed=seed)

    def take(self, k: int, timeout_s: float | None = None) -> list:
        return [self.records[i] for i in self.cursor.take(k)]

    def state_dict(self) -> dict:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state)


class GuideSource:
    """Demonstrations for mixed-policy GRPO: ``splice`` adds ``per_prompt`` records of each online group's prompt
    to the group (source GUIDE_SOURCE), a prompt's records taken round-robin (resumable)."""

    def __init__(self, path: str, per_prompt: int, max_seq_length: int | None = None,
                 max_new_tokens: int | None = None):
        from megatron_spo.config import ConfigError
        from megatron_spo.data.offline_store import load_trajectories
        from megatron_spo.data.trajectory import RecordError

        try:
            records = load_trajectories(path)
        except (OSError, RecordError) as err:
            raise ConfigError(f"grpo.guide_path: {err}") from None
        refuse_too_long(records, max_seq_length, f"grpo.guide_path ({path})")
        warn_long_responses(records, max_new_tokens, f"grpo.guide_path ({path})")
        self.by_prompt: dict[str, list] = {}
        for r in records:
            r.source = GUIDE_SOURCE
            self.by_prompt.setdefault(str(r.prompt_id), []).append(r)
        self.path, self.per_prompt = path, per_prompt
        self.taken: dict[str, int] = {}  # records taken so far, per prompt
        self.matched_once = False

    def splice(self, trajs: list) -> list:
        """trajs with each online group's demonstrations placed after it; the rows of one prompt come together
        (micro-batches keep a group whole, data-parallel shards split by prompt), in order of first appearance."""
        rows_of: dict[str, list] = {}
        for t in trajs:
            rows_of.setdefault(str(t.prompt_id), []).append(t)
        out, online = [], 0
        for key, rows in rows_of.items():
            out.extend(rows)
            records = self.by_prompt.get(key)
            if not any(t.source == "online" for t in rows):
                continue
            online += 1
            if records:
                start = self.taken.get(key, 0)
                out.extend(records[(start + j) % len(records)] for j in range(self.per_prompt))
                self.taken[key] = start + self.per_prompt
        if online and not self.matched_once:
            self.matched_once = len(out) > len(trajs)
            if not self.matched_once:
                log.warning("grpo.guide_path %s: none of this step's %d prompts (e.g. %r) has a demonstration (its "
                            "%d prompts, e.g. %r): the groups stay on-policy", self.path, online, next(iter(rows_of)),
                            len(self.by_prompt), next(iter(self.by_prompt), None))
        return out

    def state_dict(self) -> dict:
        return {"taken": dict(self.taken)}

    def load_state_dict(self, state: dict) -> None:
        self.taken = dict(state.get("taken", {}))


class BatchSampler:
    """Mixes sources by weight into one global batch of trajectories (and splices a guide's demonstrations into
    the online groups)."""

    def __init__(self, sources: dict, weights: dict, guide: GuideSource | None = None):
        """weights: per source a float, or a function of the step (1-based) giving it (SourceConfig.weight_at)."""
        self.sources, self.weights, self.guide = sources, weights, guide

    def weights_at(self, step: int | None) -> dict[str, float]:
        """Each source's weight at ``step`` (None: the first step's)."""
        return {name: w(step or 1) if callable(w) else w for name, w in self.weights.items()}

    def next(self, n: int, step: int | None = None) -> list:
        """n trajectories mixed by the sources' weights at training step ``step`` (1-based)."""
        out = []
        weights = self.weights_at(step)
        for name, k in source_counts({name: w for name, w in weights.items() if w > 0}, n).items():
            if k:
                out.extend(self.sources[name].take(k))
        return self.guide.splice(out) if self.guide is not None else out

    def state_dict(self) -> dict:
        state = {name: s.state_dict() for name, s in self.sources.items() if hasattr(s, "state_dict")}
        if self.guide is not None:
            state[GUIDE_SOURCE] = self.guide.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        for name, s in self.sources.items():
            if name in state and hasattr(s, "load_state_dict"):
                s.load_state_dict(state[name])
        if self.guide is not None and GUIDE_SOURCE in state:
            self.guide.load_state_dict(state[GUIDE_SOURCE])


def build_sampler(cfg: TrainConfig, online_source=None):
    """(BatchSampler over cfg.sources, the online source or None). online_source: the 'online' source to use
    (default: OnlineSource.from_config(cfg), the rollout manager over cfg.fleet)."""
    from megatron_spo.data.q0 import reference_identity

    sources, online = {}, None
    needs_q0, q0 = algorithm_needs_q0(cfg), None
    if needs_q0 and any(name != "online" for name in cfg.sources):
        from megatron_spo.data.q0 import q0_table

        q0 = q0_table(cfg.task.q0_path, cfg.beta, cfg.task.q0_prior)
    for name, src in cfg.sources.items():
        if name == "online":
            if online_source is None:
                from megatron_spo.training.online import OnlineSource

                online_source = OnlineSource.from_config(cfg)
            online = sources[name] = online_source
        else:
            sources[name] = OfflineSource(name, src.path, seed=cfg.seed, select=src.select, q0=q0,
                                          q0_path=cfg.task.q0_path, needs_q0=needs_q0,
                                          max_seq_length=cfg.batch.max_seq_length,
                                          max_new_tokens=cfg.rollout.max_new_tokens,
                                          q0_basis=(cfg.beta, reference_identity(cfg.init.megatron, cfg.init.hf)))
    guide = GuideSource(cfg.grpo.guide_path, cfg.grpo.guide_per_prompt, cfg.batch.max_seq_length,
                        cfg.rollout.max_new_tokens) if cfg.grpo.guide_path else None
    return BatchSampler(sources, {n: s.weight if s.weight_final is None else s.weight_at
                                  for n, s in cfg.sources.items()}, guide), online


def build_archive(cfg: TrainConfig):
    """The run's experience archive (data/archive.py) when it trains on online data and archive.enabled."""
    if not cfg.archive.enabled or "online" not in cfg.sources:
        return None
    from pathlib import Path

    from megatron_spo.data.archive import ExperienceArchive
    from megatron_spo.data.q0 import q0_basis, reference_identity

    run_dir = Path(cfg.run_dir)
    return ExperienceArchive(cfg.archive.path or run_dir / "experience", run_id=cfg.archive.run_id or run_dir.name,
                             model=cfg.init.hf or cfg.init.megatron, rows_per_shard=cfg.archive.rows_per_shard,
                             q0_basis=q0_basis(cfg.beta, reference_identity(cfg.init.megatron, cfg.init.hf)))
