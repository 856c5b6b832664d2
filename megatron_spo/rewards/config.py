"""The reward sandbox's config (rewards/sandbox.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_spo.config import StrictModel


class SandboxConfig(StrictModel):
    """Isolation and limits for running model-written programs against tests.

    isolation "bubblewrap" (the default) unshares every namespace; "rlimits-only" keeps seccomp, rlimits
    and the per-slot uid but no namespaces or filesystem view: chosen explicitly, and warned on every start.
    """

    isolation: Literal["bubblewrap", "rlimits-only"] = "bubblewrap"
    bwrap_path: str = "bwrap"
    python: str = Field("auto", description="interpreter for programs; auto = this one if slot uids can reach it, "
                        "else /usr/bin/python3")
    slots: int = Field(0, ge=0, description="sandboxes running at once; 0 = number of CPUs")
    uid_base: int = Field(1_000_000, ge=1000, description="slot i runs as host uid/gid uid_base + i (when root)")
    time_limit_s: float = Field(2.0, gt=0, description="CPU seconds per test")
    wall_factor: float = Field(2.0, ge=1, description="wall deadline = max(time_limit_s * this, time_limit_s + 1)")
    memory_mb: int = Field(1024, ge=64, description="address-space limit per test (RLIMIT_AS)")
    output_limit_mb: float = Field(16.0, gt=0, description="stdout (and stderr) cap per test")
    tmp_size_mb: int = Field(16, gt=0, description="size of the private /tmp")
    file_size_mb: int = Field(16, gt=0, description="RLIMIT_FSIZE")
    open_files: int = Field(64, ge=16, description="RLIMIT_NOFILE")
    processes: int = Field(64, ge=4, description="RLIMIT_NPROC: threads of the slot uid (fork is denied anyway)")
    startup_timeout_s: float = Field(20.0, gt=0, description="budget for a sandbox to start, on top of its tests")
    prestart: bool = Field(True, description="keep a started sandbox waiting in every idle slot")
    float_tolerance: float | None = Field(None, ge=0, description="token-wise float tolerance when comparing outputs")
