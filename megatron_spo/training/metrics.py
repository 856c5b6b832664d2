"""Run metrics: always a local metrics.jsonl, wandb when configured, and PNG plots (`megatron-spo plot`).

Each line of metrics.jsonl is one step: {"step": int, "time": unix seconds, <name>: float, ...}.
Lines are flushed as written, so a crash loses at most the line being written; a torn last line is
reported by read_metrics, never silently taken as data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from megatron_spo import extras
from megatron_spo.cli import positive_int

METRICS_FILE = "metrics.jsonl"
PLOT_DPI = 100  # overview.png and every panel cut from it
PANEL_INCHES = (5.0, 3.2)  # one panel's cell: width, height
PANEL_MARGINS = (0.9, 0.5, 0.15, 0.5)  # inches of a cell outside its axes: left (tick labels), bottom (x label), right, top (title)

# Plot panels: title -> the metrics drawn together. "prefix/*" stands for every logged name under that prefix
# (per data source, per time bucket, ...); names a run did not log are skipped, and so is a panel with none.
PANELS: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "loss/*"),
    "reward": ("reward", "reward/*"),
    "held-out pass@k (eval.interval)": ("eval/pass@*",),
    "held-out problems evaluated": ("eval/problems",),
    "log(pi / pi_0) of online samples (KL if T=1, fresh)": ("kl",),
    "sequence log(pi / pi_0) by source": ("mean_seq_log_ratio", "mean_seq_log_ratio/*"),
    "policy entropy (nats / token)": ("entropy",),
    "SPO terminal |Q_T - reward|": ("terminal_q_abs_error", "terminal_q_abs_error/*"),
    "SPO mean Q_T": ("mean_q_terminal", "mean_q_terminal/*"),
    "SPO mean token advantage": ("mean_token_advantage", "mean_token_advantage/*"),
    "SPO signed residual Q_T - r (> 0 on a sampler: drift off it)": ("residual_mean/*",),
    "SPO residual spread: mean (Q_T - r)^2, variance within prompt groups": ("residual_sq/*",
                                                                           "residual_group_var/*"),
    "SPO |dL/dQ_T| per sequence, as used (each source's push)": ("coefficient_abs/*",),
    "SPO trust region: share of tokens clipped": ("trust_region_clipped/*",),
    "KL(sampler || pi) from behaviour log-probs (k1, k3)": ("kl_sampler_k1/*", "kl_sampler_k3/*"),
    "log(pi / pi_0) per token by quarter of the response": ("log_ratio_pos*",),
    "SPO Q_t at the end of each quarter of the response": ("q_pos*",),
    "response length (tokens)": ("response_length/*",),
    "AGRO regularised reward": ("mean_regularised_reward", "half_var_regularised_reward", "mean_reward"),
    "PPO / GRPO vs the sampling policy": ("approx_kl_old_new", "clip_fraction", "mean_ratio"),
    "GRPO |advantage|, k3 KL to pi_0": ("advantage_abs", "kl_ref_k3"),
    "GRPO demonstrations (grpo.guide_path): share of sequences, mean advantage, shaped p / (p + gamma)": (
        "guide_share", "guide_advantage", "guide_shaped_p"),
    "stale samples: weight pi_old / mu, share truncated or masked, KL(mu || pi_old)": (
        "behaviour_weight", "behaviour_corrected", "mismatch_kl"),
    "PPO value loss": ("value_loss", "critic_warmup"),
    "staleness (policy versions)": ("staleness", "staleness/*"),
    "tokens / s": ("tokens_per_s", "rollout/tokens_per_s"),
    "share of computed tokens that are padding (this rank's micro-batches, expert parallelism's idle ones included)":
        ("batch/pad_share",),
    "idle micro-batches run to keep an expert group in step (all data-parallel ranks; each 2+ pad tokens)":
        ("batch/idle_micro_batches",),
    "rollout queue depth (groups)": ("rollout/queue_depth",),
    "rollout events (cumulative)": ("rollout/requests", "rollout/groups", "rollout/retries",
                                    "rollout/failed_requests", "rollout/reward_errors", "rollout/dropped_stale",
                                    "rollout/duplicates_dropped", "rollout/staleness_*"),
    "weight pushes vs generation (cumulative)": ("rollout/aborted_requests", "rollout/retracted_samples",
                                                 "rollout/mixed_version_samples", "rollout/mixed_version_dropped"),
    "step time split (s)": ("time/*", "weight_sync/seconds"),
    "checkpoint (s): the steps blocked, written in the background (checkpoint.async_save)": (
        "checkpoint/blocked_s", "checkpoint/background_s"),
    "weight push (s): engines paused, transfer": ("weight_sync/pause_seconds", "weight_sync/transfer_seconds"),
    "weight sync to the fleet (bytes / s)": ("weight_sync/bytes_per_s",),
    "bytes per weight push": ("weight_sync/bytes",),
    "weight sync engines (per push)": ("weight_sync/engines_updated", "weight_sync/engines_failed",
                                       "weight_sync/engines_resynced", "weight_sync/engines_restarted"),
    "engines restarted (the run's total) and the fleet's state": ("fleet/*",),
    "weight sync failures": ("weight_sync/failed",),
    "engine vs trainer log-prob gap (per token)": ("logprob_gap/mean_abs", "logprob_gap/max_abs",
                                                   "logprob_gap/mismatch_kl"),
    "log-prob gap: samples measured (current weights: 1)": ("logprob_gap/sequences", "logprob_gap/current"),
    "grad norm": ("grad_norm", "grad_norm/*"),
    "learning rate": ("lr",),
    "online samples per step": ("samples/online",),
    "share of each batch per source (sources.*.weight and its schedule)": ("batch_share/*",),
    "trainer peak RSS (GB)": ("memory/peak_rss_gb",),
}
# Panels on a log y axis (when every value is positive): a correct push's 1e-7 and a broken one's 0.5 on one plot.
LOG_PANELS = frozenset({"engine vs trainer log-prob gap (per token)"})
# Logged but not plotted: bookkeeping, not a training signal.
UNPLOTTED = frozenset({"step", "time", "policy_version", "reference_step"})


def panel_names(title: str, logged: Iterable[str]) -> list[str]:
    """The logged metric names that PANELS[title] draws, in panel order (a pattern's matches sorted)."""
    logged = set(logged)
    out: list[str] = []
    for pattern in PANELS[title]:
        if pattern.endswith("*"):
            out += sorted(n for n in logged if n.startswith(pattern[:-1]) and n not in out)
        elif pattern in logged and pattern not in out:
            out.append(pattern)
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings so the line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Writes step metrics to run_dir/metrics.jsonl (append; resumable) and to wandb if enabled.

    Only the logging rank should construct one with enabled=True; other ranks get a no-op logger.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool = True,
        wandb_project: str | None = None,
        wandb_mode: str = "offline",
        run_name: str | None = None,
        config: dict | None = None,
        resume_from_step: int | None = None,
        wandb_entity: str | None = None,
        wandb_group: str | None = None,
        wandb_tags: Iterable[str] = (),
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._wandb_run = None
        self._file = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # resuming: drop replayed steps and any torn line from a crash
            truncate_after_step(self.path, resume_from_step if resume_from_step is not None else 2**62)
        self._file = open(self.path, "a", buffering=1)  # line-buffered
        if wandb_project:
            wandb = extras.wandb()
            if wandb is None:
                raise RuntimeError("metrics: wandb_project is set but the wandb package is not installed "
                                   "(pip install -e .[wandb])")
            os.environ.setdefault("WANDB_DIR", str(self.run_dir))
            self._wandb_run = wandb.init(project=wandb_project, entity=wandb_entity, name=run_name,
                                         group=wandb_group, tags=list(wandb_tags) or None, mode=wandb_mode,
                                         config=config or {}, dir=str(self.run_dir), resume="allow",
                                         id=(run_name or self.run_dir.name).replace("/", "-"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "time": time.time()}
        record.update({k: _finite(float(v)) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._wandb_run is not None:
            self._wandb_run.log({k: float(v) for k, v in metrics.items()}, step=int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetricsFileError(ValueError):
    pass


def read_metrics(path: str | Path) -> list[dict]:
    """All records of a metrics.jsonl. A malformed line raises, naming file and line (and a folder that is not
    a run says what it is: a folder of runs, or a study report's folder)."""
    path = Path(path)
    if path.is_dir():
        if not (path / METRICS_FILE).exists():
            raise MetricsFileError(not_a_run(path))
        path = path / METRICS_FILE
    if not path.exists():
        raise MetricsFileError(f"{path}: no such metrics file")
    records = []
    lines = path.read_text().splitlines(keepends=True)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines) and not line.endswith("\n"):
                warnings.warn(f"{path} line {lineno}: torn last line skipped (the run stopped while "
                              "writing it)", stacklevel=2)
                continue
            raise MetricsFileError(f"{path} line {lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise MetricsFileError(f"{path} line {lineno}: a record needs a 'step' field")
        records.append({k: (float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v)
                        for k, v in rec.items()})
    return records


def not_a_run(folder: Path) -> str:
    """Why a folder without metrics.jsonl cannot be plotted, in one line."""
    runs = sorted(p.parent for p in folder.glob(f"**/{METRICS_FILE}"))
    if runs:
        return (f"{folder} is a folder of {len(runs)} run{'s' * (len(runs) != 1)}, not a run: plot each one "
                f"(e.g. megatron-spo plot {runs[0]})")
    if (folder / "report.md").is_file():
        return (f"{folder} is a study report (its plots are the PNGs beside report.md; it keeps no metrics): "
                f"plot a run of the study's out_dir instead")
    return f"{folder}: no {METRICS_FILE} here or below (not a run directory)"


def truncate_after_step(path: Path, step: int) -> int:
    """Drop records with step > `step` (a resumed run replays those steps). Returns lines dropped."""
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn line from the crash that led to this resume
        if rec.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, smooth: int = 1) -> list[Path]:
    """One PNG per panel that has data, plus overview.png with all of them. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    logged = {k for r in records for k, v in r.items() if isinstance(v, (int, float))}
    panels = {}
    for title in PANELS:
        series = {}
        for name in panel_names(title, logged):
            pts = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
            if pts:
                series[name] = pts
        if series:
            panels[title] = series
    if not panels:
        raise MetricsFileError(f"{run_dir}: no plottable metrics")

    def draw(ax, title, series):
        for name, pts in series.items():
            xs, ys = zip(*pts)
            ys = _moving_average(ys, smooth)
            ax.plot(xs, ys, label=name, lw=1.4)
        ax.set_title(textwrap.fill(title, 50), fontsize=11)  # two lines at most: the cell's top margin holds them
        if title in LOG_PANELS and all(y > 0 for pts in series.values() for _, y in pts):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)

    # One figure drawn once, a grid of equal cells: overview.png is the figure and each panel's PNG its cell's
    # pixels. Drawing every panel as a figure of its own, and tight_layout, cost 10x more (0.3 s per panel).
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = plt.figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), dpi=PLOT_DPI)
    width, height = PANEL_INCHES
    left, bottom, right, top = PANEL_MARGINS
    cells = []
    for i, (title, series) in enumerate(panels.items()):
        row, col = divmod(i, cols)
        ax = fig.add_axes(((col * width + left) / (width * cols), ((rows - 1 - row) * height + bottom) / (height * rows),
                           (width - left - right) / (width * cols), (height - bottom - top) / (height * rows)))
        draw(ax, title, series)
        cells.append((title, row, col))
    fig.canvas.draw()
    pixels = np.array(fig.canvas.buffer_rgba())  # a copy: the buffer goes with the figure
    plt.close(fig)
    cell_h, cell_w = pixels.shape[0] // rows, pixels.shape[1] // cols
    written = []
    for title, row, col in cells:
        path = out / (_slug(title) + ".png")
        plt.imsave(path, pixels[row * cell_h:(row + 1) * cell_h, col * cell_w:(col + 1) * cell_w], dpi=PLOT_DPI)
        written.append(path)
    path = out / "overview.png"
    plt.imsave(path, pixels, dpi=PLOT_DPI)
    written.append(path)
    return written


def _moving_average(ys: Iterable[float], window: int) -> list[float]:
    ys = list(ys)
    if window <= 1:
        return ys
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


def plot_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo plot", description="PNG plots of a run's metrics.jsonl")
    parser.add_argument("run_dir", help="a run directory (holding metrics.jsonl) or the file itself")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/plots)")
    parser.add_argument("--smooth", type=positive_int, default=1, help="moving-average window in steps")
    args = parser.parse_args(argv)
    try:
        files = plot_run(args.run_dir, args.out, smooth=args.smooth)
    except MetricsFileError as err:
        print(f"megatron-spo plot: {err}", file=sys.stderr)
        return 1
    for f in files:
        print(f)
    return 0


def duration(seconds: float) -> str:
    """'1:02:03' / '2:03' / '-' (unknown) for a log line."""
    if not math.isfinite(seconds):
        return "-"
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes}:{sec:02d}"


def timing(step: int, total: int, start: int, elapsed: float) -> str:
    """'elapsed 2:03, 4.10 s/step, ETA 6:09' of a run started at step `start`, now at `step` of `total`."""
    done = step - start
    per_step = elapsed / done if done > 0 else math.nan
    return f"elapsed {duration(elapsed)}, {per_step:.2f} s/step, ETA {duration(per_step * (total - step))}"


def progress_line(enabled: bool, total: int, start: int):
    """A rich progress bar on a terminal (rank 0), else one line per step with elapsed time, s/step and ETA
    (SLURM logs; MEGATRON_SPO_PROGRESS=1 forces the bar). Returns update(step, metrics); update(None, None)
    closes it."""
    if not enabled:
        return lambda step, metrics: None
    t0 = time.monotonic()
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                   transient=False, disable=not sys.stdout.isatty() and not os.environ.get("MEGATRON_SPO_PROGRESS"))
    task = bar.add_task("train", total=total, completed=start, info="")
    bar.start()

    def update(step, metrics):
        if step is None:
            bar.stop()
            return
        info = f"loss {metrics.get('loss', math.nan):.4f} reward {metrics.get('reward', math.nan):+.3f}"
        if "kl" in metrics:  # SPO / AGRO: mean sequence log(pi / pi_0) on online samples
            info += f" kl {metrics['kl']:.3f}"
        elif "mean_seq_log_ratio" in metrics:  # offline data only: not a KL estimate
            info += f" log_ratio {metrics['mean_seq_log_ratio']:.3f}"
        if "approx_kl_old_new" in metrics:  # PPO: against the policy that sampled
            info += f" kl(old) {metrics['approx_kl_old_new']:.4f} clip {metrics.get('clip_fraction', 0.0):.2f}"
        if "entropy" in metrics:  # nats per response token
            info += f" entropy {metrics['entropy']:.3f}"
        if "logprob_gap/mean_abs" in metrics:  # engines vs trainer (training/logprob_gap.py)
            info += f" logprob_gap {metrics['logprob_gap/mean_abs']:.2g}"
        bar.update(task, completed=step, info=info)
        if not bar.live.is_started or bar.disable:
            print(f"step {step}/{total} {info} | {timing(step, total, start, time.monotonic() - t0)}", flush=True)

    return update
