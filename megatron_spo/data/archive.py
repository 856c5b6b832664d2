"""The trainer's experience archive: every online trajectory it trains on, appended to an offline store.

    archive = ExperienceArchive("runs/r1/experience", run_id="r1", model="Qwen/Qwen3-8B")
    archive.add(trajectories)      # the step's online trajectories (any with reward, tokens, version)
    archive.flush()                # at each checkpoint: what is flushed survives any crash
    archive.close()

Each record keeps its reward, policy version, behaviour log-probs, Q0 and the engine's routed experts (a MoE
policy's routes: a later run that reads the archive replays them), with provenance kind "online", the
run id, the producing model, the sampling temperature / top-p and the time it was archived. The store's own
writer makes it crash-safe: a shard is written to a temporary folder, fsynced, renamed and only then listed
in the index, so a killed run leaves a readable store whose index lists only complete shards (an interrupted
shard is ignored with a warning, never counted as data). A run that resumes appends to the same store; a
later run reads it as an offline source (SourceConfig.select picks it by run id or kind) or merges it with
``megatron-spo offline build``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from megatron_spo.data.offline_store import OfflineStoreWriter
from megatron_spo.data.trajectory import Provenance, Trajectory


class ExperienceArchive:
    def __init__(self, path: str | Path, *, run_id: str, model: str | None = None, rows_per_shard: int = 4096,
                 q0_basis: str | None = None):
        """q0_basis: what the run's Q0 values are of (data/q0.q0_basis: its beta and reference), kept with every
        record that has a q0, so a later run at another beta or reference recomputes or refuses them."""
        self.path = Path(path)
        self.run_id, self.model, self.q0_basis = run_id, model, q0_basis
        self.writer = OfflineStoreWriter(self.path, rows_per_shard=rows_per_shard)
        self.added = 0

    def record(self, t) -> Trajectory:
        """The store record of one online trajectory (a rollout.manager.Trajectory or a record-like object)."""
        q0 = getattr(t, "q0", None)
        provenance = Provenance(kind="online", model=self.model, run_id=self.run_id,
                                temperature=getattr(t, "temperature", None), top_p=getattr(t, "top_p", None),
                                created=time.time(), q0_basis=self.q0_basis if q0 is not None else None)
        return Trajectory(prompt_id=t.prompt_id, prompt_tokens=list(t.prompt_tokens),
                          response_tokens=list(t.response_tokens), reward=float(t.reward), source="online",
                          policy_version=int(t.policy_version),
                          behaviour_logprobs=None if t.behaviour_logprobs is None else list(t.behaviour_logprobs),
                          q0=q0, provenance=provenance,
                          routed_experts=getattr(t, "routed_experts", None),
                          response_mask=getattr(t, "response_mask", None), turn_versions=getattr(t, "turn_versions", None))

    def add(self, trajectories: Iterable) -> None:
        for t in trajectories:
            self.writer.add(self.record(t))
            self.added += 1

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
