"""The report of `megatron-spo compare`: report.md and PNGs from the finished runs of a study.

Every comparison is paired: arms of one seed share the reference's evaluation draws, and a difference is taken
per (seed, problem) before it is averaged. Intervals are two-way bootstraps: seeds and problems are resampled
independently, so both the training noise (seeds) and the problem sample count.
"""

from __future__ import annotations

import functools
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

from megatron_spo.experiments.arms import ARMS, RunSpec

KS = (1, 10)
KS_NAMES = tuple(f"pass@{k}" for k in KS)

_WORDS_MARGIN = 1.25  # words drawn at first, over the average a bootstrap takes (more are drawn when short)


@functools.lru_cache(maxsize=8)  # a report bootstraps ~100 differences of a few shapes, all from seed 0
def _draws(seed: int, n_s: int, n_p: int, resamples: int):
    """The indices `random.Random(seed)` gives for `resamples` x ([randrange(n_s)] * n_s, [randrange(n_p)] * n_p),
    drawn at numpy's speed: numpy's MT19937 started from the same state yields the same 32-bit words, from which
    randrange(n) takes the top n.bit_length() bits and draws again when they reach n (CPython 3.11 and 3.12 alike;
    tests/test_study.py checks them against random.Random). Returns (seeds (R, n_s), problems (R, n_p))."""
    import numpy as np

    state = random.Random(seed).getstate()[1]
    gen = np.random.MT19937()
    gen.state = {"bit_generator": "MT19937", "state": {"key": np.array(state[:624], dtype=np.uint32),
                                                       "pos": state[624]}}
    per = 2 ** n_s.bit_length() + 2 ** n_p.bit_length()  # the words a resample takes on average
    words = gen.random_raw(int(_WORDS_MARGIN * resamples * per) + 64)
    starts: list[tuple[int, int]] = []  # per resample, its first accepted seed word and problem word (of ok_s, ok_p)
    pos = 0
    while True:
        v_s, v_p = words >> (32 - n_s.bit_length()), words >> (32 - n_p.bit_length())
        ok_s, ok_p = np.flatnonzero(v_s < n_s), np.flatnonzero(v_p < n_p)
        # before[i]: how many words before word i are accepted, i.e. which accepted word is the first at or after i
        before_s = np.concatenate([[0], np.cumsum(v_s < n_s)])
        before_p = np.concatenate([[0], np.cumsum(v_p < n_p)])
        while len(starts) < resamples:
            a = before_s.item(pos)
            if a + n_s > len(ok_s):
                break
            b = before_p.item(ok_s.item(a + n_s - 1) + 1)
            if b + n_p > len(ok_p):
                break
            starts.append((a, b))
            pos = ok_p.item(b + n_p - 1) + 1
        else:
            at = np.array(starts, dtype=np.int64)
            seeds = v_s[ok_s[at[:, :1] + np.arange(n_s)]].astype(np.int64)
            problems = v_p[ok_p[at[:, 1:] + np.arange(n_p)]].astype(np.int64)
            seeds.flags.writeable = problems.flags.writeable = False  # shared by every caller (the cache)
            return seeds, problems
        words = np.concatenate([words, gen.random_raw(len(words) // 4 + 64)])  # rarely: more words


def two_way_bootstrap(diff: list[list[float]], *, resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of diff[seed][problem] and its 95% interval, resampling seeds and problems independently."""
    if not diff or not diff[0]:
        return math.nan, math.nan, math.nan
    import numpy as np

    n_s, n_p = len(diff), len(diff[0])
    mean = sum(map(sum, diff)) / (n_s * n_p)
    # each resample: seeds and problems drawn as random.Random(seed).randrange draws them, its mean summed in the
    # order sum(diff[s][p] for s in seeds for p in problems) adds (cumsum is sequential, as that sum is on 3.11;
    # numpy's sum would pair): the intervals of every committed report, about 100x faster
    seeds, problems = _draws(seed, n_s, n_p, resamples)
    picked = np.asarray(diff, dtype=np.float64)[seeds[:, :, None], problems[:, None, :]].reshape(resamples, -1)
    means = np.sort(np.cumsum(picked, axis=1)[:, -1] / (n_s * n_p))
    return mean, float(means[int(0.025 * resamples)]), float(means[int(0.975 * resamples) - 1])


def _records(path: Path) -> dict[str, dict]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if "prompt_id" in rec:
                    out[rec["prompt_id"]] = rec
    return out


def _turn_records(path: Path) -> dict:
    """A multi-turn evaluation (engine_tools/eval_turns.py) as {"first": records, "last": records, "mean_turns",
    "fixed_share"}, each records {prompt_id: per-problem record}."""
    data = json.loads(path.read_text())
    out = {tag: {r["prompt_id"]: r for r in data[f"{tag}_turn"]["problems"]} for tag in ("first", "last")}
    return {**out, "mean_turns": data["mean_turns"], "fixed_share": data["fixed_share"]}


def _metrics(run: Path) -> list[dict]:
    from megatron_spo.training.metrics import read_metrics

    try:
        return read_metrics(run / "train")
    except (OSError, ValueError):
        return []


class ArmRuns:
    """The finished runs of one arm: per seed, the per-problem evaluations after training, and its metrics."""

    def __init__(self, name: str, runs: dict[int, Path], root: Path):
        self.name = name
        self.after = {s: _records(r / "eval_after.jsonl") for s, r in runs.items()}
        self.before = {s: _records(root / "shared" / f"seed{s}" / "eval_before.jsonl") for s in runs}
        self.results = {s: json.loads((r / "results.json").read_text()) for s, r in runs.items()}
        self.metrics = {s: _metrics(r) for s, r in runs.items()}
        self.sft = {s: _records(r / "eval_sft.jsonl") for s, r in runs.items()}  # the SFT'd policy, before RL
        # multi-turn runs (quickstart env): the held-out problems as conversations, per turn ("first" / "last")
        self.turns = {s: _turn_records(r / "eval_turns_after.json") for s, r in runs.items()
                      if (r / "eval_turns_after.json").exists()}

    @property
    def seeds(self) -> list[int]:
        return sorted(self.after)

    def value(self, rec: dict, what: str) -> float:
        if what == "gap":
            return rec["pass@10"] - rec["pass@1"]
        if what == "distinct":
            return float(rec.get("distinct_correct") or 0)
        return rec[what]

    def matrix(self, what: str, seeds: list[int], problems: list[str], before: bool = False,
               src: dict | None = None) -> list[list[float]]:
        src = src if src is not None else self.before if before else self.after
        return [[self.value(src[s][p], what) for p in problems] for s in seeds]

    def mean(self, what: str, seeds: list[int], problems: list[str], before: bool = False) -> float:
        """The mean over those seeds and problems (0 when there are none)."""
        return sum(map(sum, self.matrix(what, seeds, problems, before))) / max(1, len(seeds) * len(problems))


def _ci(mean: float, lo: float, hi: float) -> str:
    return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _num(x: float) -> str:
    """x to 2 decimals; n/a for a metric the arm does not log (nan)."""
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def _score(grid_point: dict) -> str:
    if grid_point["validation"] is not None:
        return format(grid_point["validation"], ".3f")
    why = grid_point.get("failure") or "failed"
    if "TrainingDiverged" in why:
        return f"diverged ({why.split('TrainingDiverged:')[-1].split(':')[0].strip()})"
    return why


def _verdict(lo: float, hi: float) -> str:
    return "reproduced" if lo > 0 else ("not reproduced: the opposite holds" if hi < 0
                                        else "inconclusive (CI includes 0)")


def _common(arms: list[ArmRuns]) -> tuple[list[int], list[str]]:
    seeds = sorted(set.intersection(*(set(a.seeds) for a in arms)))
    problems = sorted(set.intersection(*(set(a.after[s]) & set(a.before[s]) for a in arms for s in seeds))) if seeds \
        else []
    return seeds, problems


def _change_minus_change(a_long: ArmRuns, a: ArmRuns, b_long: ArmRuns, b: ArmRuns,
                         what: str) -> tuple[float, float, float, int, int]:
    """(a_long - a) - (b_long - b) per (seed, problem) over the seeds all four share: how much more arm a gained
    (or less it lost) from its longer training than arm b. Mean, CI, seeds, problems."""
    seeds, problems = _common([a_long, a, b_long, b])
    if not problems:
        return math.nan, math.nan, math.nan, 0, 0
    gain_a, gain_b = (_minus(long.matrix(what, seeds, problems), short.matrix(what, seeds, problems))
                      for long, short in ((a_long, a), (b_long, b)))
    return (*paired_difference(gain_a, gain_b), len(seeds), len(problems))


def compare(a: ArmRuns, b: ArmRuns | None, what: str) -> tuple[float, float, float, int, int]:
    """a - b (b None: a after - reference before) per (seed, problem): mean, CI, seeds, problems."""
    seeds, problems = _common([a] + ([b] if b else []))
    if not problems:
        return math.nan, math.nan, math.nan, 0, 0
    x = a.matrix(what, seeds, problems)
    y = b.matrix(what, seeds, problems) if b else a.matrix(what, seeds, problems, before=True)
    return (*paired_difference(x, y), len(seeds), len(problems))


def paired_difference(x: list[list[float]], y: list[list[float]]) -> tuple[float, float, float]:
    """x - y, both [seed][problem] on the same seeds and problems: mean and two-way bootstrap 95% CI."""
    return two_way_bootstrap(_minus(x, y))


def _minus(x: list[list[float]], y: list[list[float]]) -> list[list[float]]:
    return [[xi - yi for xi, yi in zip(rx, ry)] for rx, ry in zip(x, y)]


def _resources(arm: ArmRuns) -> dict[str, Any]:
    walls = [r["wall_s"]["train"] for r in arm.results.values()]
    pushes = [r.get("weight_pushes", 0) for r in arm.results.values()]
    gb = [sum(m.get("weight_sync/bytes", 0.0) for m in ms) / 1e9 for ms in arm.metrics.values()]
    rss = [max((m.get("memory/peak_rss_gb", 0.0) for m in ms), default=0.0) for ms in arm.metrics.values()]
    return {"wall": walls, "pushes": pushes, "gb": gb, "rss": rss}


def _mean_sd(xs: list[float], fmt: str = "{:.0f}") -> str:
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.mean(xs))} ± {fmt.format(statistics.stdev(xs))}"


def _curve(metrics: list[dict], x: str) -> tuple[list[float], list[float]]:
    """Training reward of online samples against cumulative online samples ("rollouts") or seconds."""
    xs, ys, total = [], [], 0.0
    t0 = metrics[0]["time"] - metrics[0].get("time/step", 0.0) if metrics else 0.0
    for m in metrics:
        reward = m.get("reward/online", m.get("reward"))
        if reward is None:
            continue
        total += m.get("samples/online", 0.0)
        xs.append(total if x == "rollouts" else m["time"] - t0)
        ys.append(reward)
    return xs, ys


def _smooth(ys: list[float], w: int = 9) -> list[float]:
    return [sum(ys[max(0, i - w + 1): i + 1]) / len(ys[max(0, i - w + 1): i + 1]) for i in range(len(ys))]


def _plots(arms: list[ArmRuns], long: list[ArmRuns], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, k in zip(axes, KS):
        names, means, errs = [], [], [[], []]
        for arm in arms:
            mean, lo, hi, _, n = compare(arm, None, f"pass@{k}")
            seeds, problems = _common([arm])
            after = sum(map(sum, arm.matrix(f"pass@{k}", seeds, problems))) / max(1, len(seeds) * len(problems))
            names.append(arm.name)
            means.append(after)
            errs[0].append(max(0.0, mean - lo) if n else 0)  # rounding can put the point a hair outside
            errs[1].append(max(0.0, hi - mean) if n else 0)
        if arms:
            seeds, problems = _common(arms[:1])
            ref = sum(map(sum, arms[0].matrix(f"pass@{k}", seeds, problems, before=True))) / max(
                1, len(seeds) * len(problems))
            ax.axhline(ref, color="k", ls="--", lw=1, label="reference")
        ax.bar(names, means, yerr=errs, capsize=4, color="tab:blue")
        ax.set_title(f"held-out pass@{k} (95% CI of the change)")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    paths.append(out / "pass_at_k.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for x, label in (("rollouts", "online samples (rollouts)"), ("seconds", "wall clock of training (s)")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for i, arm in enumerate(arms):
            band = _mean_band([_curve(arm.metrics[s], x) for s in arm.seeds])
            if band is None:
                continue
            xs, mean, lo, hi = band
            ax.plot(xs, mean, color=f"C{i}", lw=1.5, label=f"{arm.name} ({len(arm.seeds)} seeds)")
            ax.fill_between(xs, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
        ax.set_xlabel(label)
        ax.set_ylabel("training reward (online samples)")
        ax.set_title("learning curves: mean over seeds, band min..max")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / f"learning_curve_{x}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    if long:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        styles = ("-", "--", ":", "-.")
        for i, arm in enumerate(long):
            for j, s in enumerate(arm.seeds):  # one colour per arm, one line style per seed
                ms = arm.metrics[s]
                steps = [m["step"] for m in ms]
                kw = dict(color=f"C{i}", ls=styles[j % len(styles)], lw=1.2, label=f"{arm.name} seed {s}")
                axes[0].plot(steps, _smooth([m.get("grad_norm", math.nan) for m in ms]), **kw)
                axes[1].plot(steps, _smooth([m.get("mean_seq_log_ratio", math.nan) for m in ms]), **kw)
        axes[0].set_title("grad norm (long runs)")
        axes[0].set_ylabel("grad norm (log scale)")
        axes[0].set_yscale("log")
        axes[1].set_title("mean sequence log(pi / pi_0) (long runs)")
        axes[1].set_ylabel("log(pi / pi_0) per sequence (symlog)")
        axes[1].set_yscale("symlog", linthresh=0.1)  # GRPO's 0.5 and SPO's 50 on one axis, signs kept
        for ax in axes:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3, which="both")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / "stability.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _mean_band(curves: list[tuple[list[float], list[float]]], points: int = 60):
    """(x, mean, min, max) of the seeds' smoothed curves on a common x grid (up to where every seed reaches),
    or None without data."""
    import numpy as np

    curves = [(xs, _smooth(ys)) for xs, ys in curves if len(xs) > 1]
    if not curves:
        return None
    end = min(xs[-1] for xs, _ in curves)
    start = max(xs[0] for xs, _ in curves)
    if end <= start:
        return None
    grid = np.linspace(start, end, points)
    ys = np.array([np.interp(grid, xs, y) for xs, y in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def _stability(arm: ArmRuns, short: ArmRuns | None) -> dict[str, float]:
    """Over the long runs' seeds: mean grad-norm growth (last third / first third of the steps), the largest
    |mean sequence log-ratio|, and mean held-out pass@1 after the long run and after the same seeds' normal run."""
    growth, ratio, after, before = [], [], [], []
    for s, ms in arm.metrics.items():
        g = [m["grad_norm"] for m in ms if "grad_norm" in m]
        third = max(1, len(g) // 3)
        if g:
            growth.append((sum(g[-third:]) / third) / max(sum(g[:third]) / third, 1e-12))
        ratio += [abs(m["mean_seq_log_ratio"]) for m in ms if "mean_seq_log_ratio" in m]
        after.append(arm.results[s].get("pass@1", {}).get("after", math.nan))
        if short is not None and s in short.results:
            before.append(short.results[s].get("pass@1", {}).get("after", math.nan))
    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else math.nan

    return {"grad_norm_growth": mean(growth), "max_abs_log_ratio": max(ratio, default=math.nan),
            "pass@1": mean(after), "pass@1_short": mean(before), "seeds": len(arm.metrics)}


def run_dirs(study, root: Path, chosen: dict, kind: str, name: str) -> dict[int, Path]:
    """Per seed, where the arm's run of this kind is (or would be)."""
    from megatron_spo.experiments.quickstart import QuickstartTrainConfig

    settings = tuple(chosen.get(name, {}).get("settings", {}).items())
    extra = ()
    if kind == "long":
        steps = int(study.quickstart.get("train", {}).get("steps", QuickstartTrainConfig().steps))
        extra = (("train.steps", steps * study.long_run.steps_factor),)
    seeds = study.seeds if kind == "runs" else study.long_run.seeds
    return {seed: RunSpec(kind, name, seed, settings + extra).run_dir(root) for seed in seeds}


def load_arms(study, root: Path, chosen: dict, kind: str, names: list[str]) -> list[ArmRuns]:
    arms = []
    for name in names:
        runs = {s: r for s, r in run_dirs(study, root, chosen, kind, name).items() if (r / "results.json").exists()}
        if runs:
            arms.append(ArmRuns(name, runs, root))
    return arms


def _long_runs(study, root: Path, chosen: dict, long: list[ArmRuns], by: dict[str, ArmRuns]) -> list[str]:
    """Per long-run arm: held-out pass@k after 3x the steps against the same seeds' 1x runs (3x - 1x, paired per
    seed and problem) and against the reference, its stability numbers, and the long runs that failed. It holds
    when no run failed, neither pass@k is lower at 3x (the interval reaches 0 or above) and pass@10 stays above
    the reference (the interval excludes 0)."""
    names = [a for a in study.long_run.arms if a in study.arms]
    if not names:
        return []
    lines = [f"## Long runs ({study.long_run.steps_factor}x the steps): do they hold?", "",
             "| arm | seeds x problems | pass@1 1x -> long | long - 1x | pass@10 1x -> long | long - 1x | pass@10 long - "
             "reference | grad-norm growth | largest abs(mean seq log-ratio) | failed runs | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    done = {a.name: a for a in long}
    for name in names:
        failed = [f"seed {s}: " + (r.parent / "FAILED").read_text().strip()[:80].replace("|", "/")
                  for s, r in run_dirs(study, root, chosen, "long", name).items() if (r.parent / "FAILED").exists()]
        arm, short = done.get(name), by.get(name)
        if arm is None or short is None:
            lines.append(f"| {name} | 0 | | | | | | | | {'; '.join(failed) or 'none'} | "
                         f"{'fails' if failed else 'not measured'} |")
            continue
        seeds, problems = _common([arm, short])

        d1, d10 = compare(arm, short, "pass@1"), compare(arm, short, "pass@10")
        ref10 = compare(arm, None, "pass@10")
        st = _stability(arm, short)
        if failed:
            verdict = "fails"
        elif d1[2] < 0 or d10[2] < 0:
            verdict = "decays"
        elif not ref10[1] > 0:
            verdict = "holds, but pass@10 not above the reference"
        else:
            verdict = "holds"
        lines.append(f"| {name} | {len(seeds)} x {len(problems)} | {short.mean('pass@1', seeds, problems):.3f} -> "
                     f"{arm.mean('pass@1', seeds, problems):.3f} | {_ci(*d1[:3])} | "
                     f"{short.mean('pass@10', seeds, problems):.3f} -> {arm.mean('pass@10', seeds, problems):.3f} | "
                     f"{_ci(*d10[:3])} | {_ci(*ref10[:3])} | "
                     f"{_num(st['grad_norm_growth'])} | {_num(st['max_abs_log_ratio'])} | {'; '.join(failed) or 'none'} "
                     f"| {verdict} |")
    return lines + [""]


def write_report(study, root: Path, chosen: dict) -> Path:
    arms = load_arms(study, root, chosen, "runs", study.arms)
    long = load_arms(study, root, chosen, "long", [a for a in study.long_run.arms if a in study.arms])
    by = {a.name: a for a in arms}
    plots = _plots(arms, long, root)
    lines = ["# SPO vs its baselines on the quickstart task", "",
             f"Seeds {study.seeds}; every interval is a 95% two-way (seeds x problems) paired bootstrap. "
             "Numbers regenerate with `megatron-spo compare --report-only`.", ""]
    if study.sweep.enabled:
        lines += ["## Equal tuning budget", "",
                  f"Every arm: learning rates {study.sweep.lrs} x its coefficient grid, seed {study.sweep.seed}, "
                  f"chosen on {study.sweep.metric} of {study.sweep.validation_problems} validation problems (training "
                  "problems held out of training; the test problems are never looked at).", "",
                  "| arm | grid: setting -> validation score | chosen |", "|---|---|---|"]
        for name in study.arms:
            c = chosen.get(name, {})
            grid = "; ".join(", ".join(f"{k.split('.')[-1]} {v:g}" for k, v in g["settings"].items())
                             + f" -> {_score(g)}"
                             for g in c.get("grid", []))
            pick = ", ".join(f"{k} = {v:g}" for k, v in c.get("settings", {}).items()) or "defaults"
            if c.get("not_separated"):
                pick += " (not separated from: " + "; ".join(
                    ", ".join(f"{k.split('.')[-1]} {v:g}" for k, v in t.items()) for t in c["not_separated"]) + ")"
            if c.get("inherited_from"):
                grid, pick = f"not swept: takes {c['inherited_from']}'s settings (an ablation)", pick
            lines.append(f"| {name} | {grid} | {pick} |")
        lines += ["", "Not separated: the grid points whose validation score is within one paired standard error "
                  "(over the validation problems) of the choice's; the sweep cannot rank them, so a choice among "
                  "them is noise, which only the held-out seeds below can settle.", ""]
    else:
        lines += ["## Settings (no sweep)", "", "| arm | settings |", "|---|---|"]
        lines += [f"| {name} | " + (", ".join(f"{k} = {v}" for k, v in chosen.get(name, {}).get("settings", {}).items())
                                    or "the quickstart's defaults") + " |" for name in study.arms]
        lines.append("")
    lines += ["## Held-out test problems: trained vs reference", "",
              "| arm | seeds x problems | pass@1 | change | pass@10 | change | pass@10 - pass@1 | distinct correct "
              "programs / problem | train wall s | weight pushes | GB pushed | trainer peak RSS GB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        seeds, problems = _common([arm])
        mean = {w: arm.mean(w, seeds, problems) for w in ("pass@1", "pass@10", "gap", "distinct")}
        d1, d10 = compare(arm, None, "pass@1"), compare(arm, None, "pass@10")
        r = _resources(arm)
        lines.append(f"| {arm.name} | {len(seeds)} x {len(problems)} | {mean['pass@1']:.3f} | {_ci(*d1[:3])} | "
                     f"{mean['pass@10']:.3f} | {_ci(*d10[:3])} | {mean['gap']:.3f} | {mean['distinct']:.2f} | "
                     f"{_mean_sd(r['wall'])} | {_mean_sd(r['pushes'])} | {_mean_sd(r['gb'], '{:.2f}')} | "
                     f"{_mean_sd([x for x in r['rss'] if x], '{:.2f}')} |")
    if arms:
        seeds, problems = _common(arms[:1])
        ref = {w: arms[0].mean(w, seeds, problems, before=True) for w in ("pass@1", "pass@10", "gap", "distinct")}
        lines.append(f"| reference | {len(seeds)} x {len(problems)} | {ref['pass@1']:.3f} | | {ref['pass@10']:.3f} | | "
                     f"{ref['gap']:.3f} | {ref['distinct']:.2f} | | | | |")
    lines += ["", "Arms: " + "; ".join(f"**{n}**: {ARMS[n].about}" for n in study.arms), ""]
    if "spo" in by:
        lines += ["## SPO against each arm (SPO minus arm, paired per seed and problem)", "",
                  "| arm | pass@1 | pass@10 | pass@10 - pass@1 | distinct correct |", "|---|---|---|---|---|"]
        for arm in arms:
            if arm.name != "spo":
                cells = [_ci(*compare(by["spo"], arm, w)[:3]) for w in ("pass@1", "pass@10", "gap", "distinct")]
                lines.append(f"| {arm.name} | " + " | ".join(cells) + " |")
        lines.append("")
    if "grpo" in by and any(ARMS[a.name].uses for a in arms):
        lines += _against_grpo(arms, by["grpo"])
    if "spo" in by and "spo-lora" in by:
        lines += _lora(by["spo"], by["spo-lora"])
    if "grpo" in by and "trl-grpo" in by:  # our GRPO held to an outside implementation: the same rollouts per step
        lines += ["## Our GRPO against TRL's GRPOTrainer (grpo minus trl-grpo, paired per seed and problem)", "",
                  "| pass@1 | pass@10 | pass@10 - pass@1 | distinct correct | within noise |", "|---|---|---|---|---|"]
        diffs = [compare(by["grpo"], by["trl-grpo"], w)[:3] for w in ("pass@1", "pass@10", "gap", "distinct")]
        agree = all(lo <= 0 <= hi for _, lo, hi in diffs[:2])
        lines += ["| " + " | ".join(_ci(*d) for d in diffs) + f" | {'yes' if agree else 'no'} (pass@1, pass@10) |", ""]
    lines += _multi_turn(arms, by.get("spo"))
    lines += _long_runs(study, root, chosen, long, by)
    lines += _sft_stage(arms)
    lines += _data_tokens(arms)
    lines += _claims(by, long)
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    report = root / "report.md"
    report.write_text("\n".join(lines) + "\n")
    (root / "report.json").write_text(json.dumps(
        {a.name: {w: compare(a, None, w)[:3] for w in ("pass@1", "pass@10", "gap")} for a in arms}, indent=2) + "\n")
    return report


def _multi_turn(arms: list[ArmRuns], single: ArmRuns | None) -> list[str]:
    """Issue 63: arms trained on conversations (their runs' eval_turns_after.json): held-out pass@k at the first
    and the last turn after training, the last minus the first (what the feedback adds at evaluation), and each
    turn against single-turn SPO's single-turn samples (the spo arm), paired per seed and problem."""
    multi = [a for a in arms if a.turns]
    if not multi:
        return []
    lines = ["## Multi-turn: the held-out problems as conversations (first and last turn)", "",
             "| arm | seeds x problems | first turn pass@1 / pass@10 | last turn pass@1 / pass@10 | last minus first: "
             "pass@1 | turns a conversation | fixed by the feedback | last turn minus single-turn spo: pass@1 | "
             "pass@10 | first turn minus single-turn spo: pass@1 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in multi:
        seeds = sorted(arm.turns)
        problems = sorted(set.intersection(*(set(arm.turns[s]["last"]) for s in seeds)))

        def m(tag: str, what: str, arm=arm, seeds=seeds, problems=problems) -> list[list[float]]:
            return [[arm.turns[s][tag][p][what] for p in problems] for s in seeds]

        mean = {(t, w): sum(map(sum, m(t, w))) / (len(seeds) * len(problems))
                for t in ("first", "last") for w in ("pass@1", "pass@10")}
        cells = ["n/a"] * 3
        if single is not None:
            both = [s for s in seeds if s in single.after]
            common = [p for p in problems if all(p in single.after[s] for s in both)]
            if both and common:
                def against(tag: str, what: str, arm=arm, both=both, common=common) -> str:
                    x = [[arm.turns[s][tag][p][what] for p in common] for s in both]
                    return _ci(*paired_difference(x, single.matrix(what, both, common)))

                cells = [against("last", "pass@1"), against("last", "pass@10"), against("first", "pass@1")]
        turns = sum(arm.turns[s]["mean_turns"] for s in seeds) / len(seeds)
        fixed = sum(arm.turns[s]["fixed_share"] for s in seeds) / len(seeds)
        lines.append(f"| {arm.name} | {len(seeds)} x {len(problems)} | {mean['first', 'pass@1']:.3f} / "
                     f"{mean['first', 'pass@10']:.3f} | {mean['last', 'pass@1']:.3f} / {mean['last', 'pass@10']:.3f} | "
                     f"{_ci(*paired_difference(m('last', 'pass@1'), m('first', 'pass@1')))} | {turns:.2f} | "
                     f"{fixed:.1%} | " + " | ".join(cells) + " |")
    return lines + ["", "A conversation's first turn is what single-turn sampling of the same prompt gets; its last is "
                    "the program it ends on after the environment's feedback (up to env.max_turns model turns, so "
                    "more generated tokens than one sample); single-turn spo is sampled once per problem and "
                    "sample.", ""]


def _lora(full: ArmRuns, lora: ArmRuns) -> list[str]:
    """Issue 46: SPO with LoRA against full SPO, held-out pass@k (paired) beside what LoRA saves: the bytes of one
    weight push (the training's pushes, weight_sync/bytes; the merged push before the final evaluation is not one)
    and the trainer's peak RSS (rank 0, memory/peak_rss_gb; on CPU the trainer's whole footprint)."""
    lines = ["## LoRA against full SPO (spo-lora minus spo, paired per seed and problem)", "",
             "| arm | seeds x problems | pass@1 | pass@10 | spo-lora minus spo: pass@1 | pass@10 | weight pushes | "
             "MB per push | trainer peak RSS GB |", "|---|---|---|---|---|---|---|---|---|"]
    for arm in (full, lora):
        seeds, problems = _common([full, lora])
        per_push = [statistics.mean(b) / 1e6 for ms in arm.metrics.values()
                    if (b := [m["weight_sync/bytes"] for m in ms if m.get("weight_sync/bytes")])]
        r = _resources(arm)
        delta = "|" if arm is full else " | ".join(_ci(*compare(lora, full, w)[:3]) for w in ("pass@1", "pass@10"))
        lines.append(f"| {arm.name} | {len(seeds)} x {len(problems)} | {arm.mean('pass@1', seeds, problems):.3f} | "
                     f"{arm.mean('pass@10', seeds, problems):.3f} | {delta} | {_mean_sd(r['pushes'])} | "
                     f"{_mean_sd(per_push, '{:.3f}')} | {_mean_sd([x for x in r['rss'] if x], '{:.3f}')} |")
    return lines + ["", "MB per push: the bytes sent to the engines per training push (weight_sync/bytes; an adapter "
                    "push sends the adapters alone); trainer peak RSS: rank 0's peak resident set (VmHWM), on CPU "
                    "the whole trainer (model, reference or none, gradients, optimizer state, activations).", ""]


def _against_grpo(arms: list[ArmRuns], grpo: ArmRuns) -> list[str]:
    """Issue 48: with the study's data, each arm against what a user runs today without it (GRPO), paired per seed
    and problem over the seeds both have; the README's recommendation table is this one."""
    rows = []
    for arm in arms:
        seeds, problems = _common([arm])
        means = " / ".join(f"{arm.mean(w, seeds, problems):.3f}" for w in KS_NAMES)
        cells = [_ci(*compare(arm, grpo, w)[:3]) for w in KS_NAMES] if arm is not grpo else ["", ""]
        rows.append(f"| {arm.name} | {len(seeds)} | {means} | " + " | ".join(cells)
                    + f" | {arm.mean('distinct', seeds, problems):.2f} |")
    return ["## With the study's data: each arm against GRPO without it", "",
            "What a user with such data would run today is GRPO, which cannot use it: each arm minus grpo, paired "
            "per seed and problem over the seeds both ran.", "",
            "| arm | seeds | pass@1 / pass@10 | minus grpo: pass@1 | pass@10 | distinct correct / problem |",
            "|---|---|---|---|---|---|", *rows, ""]


def _sft_stage(arms: list[ArmRuns]) -> list[str]:
    """Issue 48: per arm with an SFT stage, the step early stopping kept, and the SFT'd policy's held-out pass@k
    (its own evaluation before RL) against the reference and against the same run after RL, paired per seed and
    problem: what SFT alone gave, and what RL added on top of it."""
    rows = []
    for arm in arms:
        seeds = [s for s in arm.seeds if arm.sft[s]]
        if not seeds:
            continue
        problems = sorted(set.intersection(*(set(arm.sft[s]) & set(arm.before[s]) & set(arm.after[s])
                                             for s in seeds)))
        infos = [arm.results[s].get("sft", {}) for s in seeds]
        kept = ", ".join(f"{i.get('chosen_step', '?')} of {i.get('settings', {}).get('steps', '?')}" for i in infos)
        cells = []
        for what in ("pass@1", "pass@10"):
            sft, ref, after = (arm.matrix(what, seeds, problems, src=src) for src in (arm.sft, arm.before, arm.after))
            mean = sum(map(sum, sft)) / max(1, len(seeds) * len(problems))
            cells += [f"{mean:.3f}", _ci(*paired_difference(sft, ref)), _ci(*paired_difference(after, sft))]
        rows.append(f"| {arm.name} | {len(seeds)} x {len(problems)} | {kept} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["## The SFT stage: what SFT alone gave, and what RL added", "",
            "The SFT'd policy (the run's start and pi_0) evaluated before RL, paired per seed and problem with the "
            "reference and with the same run after RL. Steps kept: early stopping on the validation problems' "
            "response NLL (sft.eval_every), per seed.", "",
            "| arm | seeds x problems | SFT steps kept | SFT'd pass@1 | minus reference | RL's change over it | "
            "SFT'd pass@10 | minus reference | RL's change over it |", "|---|---|---|---|---|---|---|---|---|",
            *rows, ""]


TAIL_STEPS = 10  # the issue-48 section averages each run's last this many logged steps


def _data_tokens(arms: list[ArmRuns]) -> list[str]:
    """Issue 48, "which tokens carry it": per arm that trains on the study's data (a source 'data' or GRPO's
    'guide') and per source, the last TAIL_STEPS steps' mean (then over seeds) of the sequence log(pi / pi_0), and
    for SPO of log(pi / pi_0) per token and Q_t by quarter of the response and the signed residual Q_T - r."""
    rows = []
    for arm in arms:
        tails = [ms[-TAIL_STEPS:] for ms in arm.metrics.values() if ms]
        sources = sorted({k.split("/", 1)[1] for ms in tails for m in ms for k in m
                          if k.startswith("mean_seq_log_ratio/")})
        if not {"data", "guide"} & set(sources):
            continue

        def mean(name: str, tails: list = tails) -> str:
            per_seed = [statistics.mean(v) for ms in tails if (v := [m[name] for m in ms if name in m])]
            return f"{statistics.mean(per_seed):+.3f}" if per_seed else "-"

        for src in sources:
            quarters = [(mean(f"log_ratio_pos{k}/{src}"), mean(f"q_pos{k}/{src}")) for k in range(1, 5)]
            rows.append(f"| {arm.name} | {src} | {mean(f'mean_seq_log_ratio/{src}')} | "
                        + " / ".join(q[0] for q in quarters) + " | " + " / ".join(q[1] for q in quarters)
                        + f" | {mean(f'residual_mean/{src}')} |")
    if not rows:
        return []
    return ["## Which tokens carry it: the study's data against the policy's own samples", "",
            f"Each run's last {TAIL_STEPS} steps, averaged, then over seeds. Sources: `data` (the study's data, an SPO "
            "source), `guide` (the same data in GRPO's groups), `online` (the policy's samples), `offline` (pi_0's "
            "correct samples and the task's solutions). '-': not logged for that arm (GRPO logs sequence log-ratios "
            "only).", "",
            "| arm | source | sequence log(pi / pi_0) | per-token log(pi / pi_0), quarters 1 / 2 / 3 / 4 of the response "
            "| Q_t at the end of quarters 1 / 2 / 3 / 4 | signed residual Q_T - r |", "|---|---|---|---|---|---|",
            *rows, ""]


def _claims(by: dict[str, ArmRuns], long: list[ArmRuns]) -> list[str]:
    """The SPO paper's five claims, each with the measurement that speaks to it and a verdict."""
    rows = []

    def paired(claim: str, a: str, b: str, what: str) -> None:
        if a in by and b in by:
            mean, lo, hi, s, p = compare(by[a], by[b], what)
            seeds = f"{s} seed" + ("s" if s != 1 else "")
            rows.append((claim, f"{a} - {b}, {what}: {_ci(mean, lo, hi)} ({seeds} x {p} problems)", _verdict(lo, hi)))
        else:
            rows.append((claim, f"needs arms {a} and {b}", "not measured"))

    paired("1. SPO beats PPO on pass@10", "spo", "ppo", "pass@10")
    paired("2. SPO keeps a larger pass@10 - pass@1 gap (a softer policy) than PPO", "spo", "ppo", "gap")
    grpo = "grpo" if "grpo" in by else "grpo-tis"  # the synchronous arm when the study has it, else the async one
    paired("2b. ... and than GRPO", "spo", grpo, "gap")
    paired("3. SPO benefits from offline data", "spo", "spo-online", "pass@1")
    paired("3b. ... on pass@10", "spo", "spo-online", "pass@10")
    if "sft-grpo" in by:  # issue 48: the study's own data, SPO against what a user would run with it
        for a, what in (("spo-data", "pass@1"), ("spo-data", "pass@10"), ("sft-spo", "pass@1"), ("sft-spo", "pass@10")):
            paired(f"48. {a} (SPO {'with the data as a source' if a == 'spo-data' else 'after the same SFT'}) beats "
                   f"SFT then GRPO on {what}", a, "sft-grpo", what)
    if "grpo-guided" in by:  # the off-policy-guided GRPO a user could run with the same data
        for what in ("pass@1", "pass@10"):
            paired(f"48. spo-data (SPO with the data as a source) beats mixed-policy GRPO (LUFFY) on {what}",
                   "spo-data", "grpo-guided", what)
    if "spo" in by and "ppo" in by:
        s, p = _resources(by["spo"]), _resources(by["ppo"])
        common = sorted(set(by["spo"].results) & set(by["ppo"].results))  # paired by seed
        ratios = [by["spo"].results[k]["wall_s"]["train"] / by["ppo"].results[k]["wall_s"]["train"] for k in common]
        faster = all(r < 1 for r in ratios)
        rows.append(("4. SPO trains faster per wall clock (pushes every 10 steps, PPO every step)",
                     f"train wall SPO / PPO per seed {', '.join(f'{r:.2f}' for r in ratios)}; pushes "
                     f"{_mean_sd(s['pushes'])} vs {_mean_sd(p['pushes'])}; GB pushed {_mean_sd(s['gb'], '{:.2f}')} "
                     f"vs {_mean_sd(p['gb'], '{:.2f}')}",
                     "reproduced" if faster else ("not reproduced: the opposite holds" if all(r > 1 for r in ratios)
                                                   else "inconclusive (seeds disagree)")))
    else:
        rows.append(("4. SPO trains faster per wall clock", "needs arms spo and ppo", "not measured"))
    longs = {a.name: a for a in long}
    grpo = "grpo" if "grpo" in longs else "grpo-tis"
    if all(name in longs and name in by for name in ("spo", grpo)):
        s, g = _stability(longs["spo"], by["spo"]), _stability(longs[grpo], by[grpo])
        # the change from 1x to 3x the steps, SPO's minus GRPO's, per (seed, problem): > 0 is SPO decaying less
        did = {w: _change_minus_change(longs["spo"], by["spo"], longs[grpo], by[grpo], w) for w in KS_NAMES}
        verdicts = {_verdict(lo, hi) for _, lo, hi, _, _ in did.values()}
        n = did["pass@1"][3]
        seeds = f"{n} seed" + ("s" if n != 1 else "")
        if "reproduced" in verdicts:
            verdict = "mixed (one pass@k each way)" if "not reproduced: the opposite holds" in verdicts else "reproduced"
        else:
            verdict = "not reproduced: the opposite holds" if "not reproduced: the opposite holds" in verdicts \
                else "inconclusive (CI includes 0)"
        rows.append((f"5. SPO is more stable (long runs, 3x steps, {seeds})",
                     f"(3x - 1x) SPO minus (3x - 1x) {grpo}: pass@1 {_ci(*did['pass@1'][:3])}, pass@10 "
                     f"{_ci(*did['pass@10'][:3])}; held-out pass@1 1x -> 3x SPO {s['pass@1_short']:.3f} -> "
                     f"{s['pass@1']:.3f}, {grpo} {g['pass@1_short']:.3f} -> {g['pass@1']:.3f}; grad-norm growth (last "
                     f"/ first third) {s['grad_norm_growth']:.2f} vs {g['grad_norm_growth']:.2f}",
                     verdict + (" (indicative: one seed)" if n == 1 else "")))
    else:
        rows.append(("5. SPO is more stable", "needs long and normal runs of spo and grpo", "not measured"))
    return ["## The paper's claims, in miniature", "", "| claim | measurement | verdict |", "|---|---|---|",
            *[f"| {c} | {m} | {v} |" for c, m, v in rows], ""]


# The training metrics the report reads (resources, learning curves, stability): an archive keeps only these.
REPORT_METRICS = ("step", "time", "time/step", "reward", "reward/online", "samples/online", "grad_norm",
                  "mean_seq_log_ratio", "weight_sync/bytes", "memory/peak_rss_gb")
# per-source metrics the issue-48 section reads (any source: NAME/SOURCE), kept by the archive too
REPORT_PREFIXES = ("mean_seq_log_ratio/", "log_ratio_pos", "q_pos", "residual_mean/", "guide_")
# a seed's reference evaluation, Q0, and the stamp naming the reference that made them (quickstart.REFERENCE_STAMP)
_SHARED_FILES = ("eval_before.jsonl", "q0.jsonl", "q0_correct_samples.jsonl", "reference.json")


def archive(root: Path, dest: Path) -> dict[str, int]:
    """Copy what the report reads out of a study's out_dir into dest, about 100 KB per run instead of tens of
    MB: the study and its choices, each seed's reference evaluation and Q0 files, and per finished run its
    results.json, per-problem evaluations and the REPORT_METRICS / REPORT_PREFIXES of its metrics.jsonl (plus
    FAILED files).
    `compare out_dir=dest --report-only` writes the same report from it, and `compare out_dir=dest` resumes there:
    a run with results.json is finished. Resuming elsewhere rebuilds the quickstart's reference model (cached per
    machine), which another CPU can make with other weights: each seed's reference.json names the weights the
    finished runs started from, and compare refuses to resume from others.
    Returns {"runs": n, "bytes": total written}."""
    from megatron_spo.training.metrics import METRICS_FILE, read_metrics

    root, dest = Path(root), Path(dest)
    if not (root / "study.json").exists():
        raise FileNotFoundError(f"compare --archive: {root} is not a study's out_dir (no study.json)")
    if dest.resolve() == root.resolve():
        raise ValueError(f"compare --archive: the archive {dest} is the study's own out_dir")
    if dest.exists() and any(dest.iterdir()):  # an older archive's files would mix with this one's
        raise FileExistsError(f"compare --archive: {dest} is not empty (remove it, or name a new folder)")
    written, runs = 0, 0

    def put(rel: Path, text: str) -> None:
        nonlocal written
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
        written += len(text.encode())

    for name in ("study.json", "chosen.json"):
        if (root / name).exists():
            put(Path(name), (root / name).read_text())
    for path in sorted(root.glob("shared/seed*/*")):
        if path.name in _SHARED_FILES:
            put(path.relative_to(root), path.read_text())
    for kind in ("sweep", "runs", "long"):
        for failed in sorted(root.glob(f"{kind}/*/*/FAILED")):
            put(failed.relative_to(root), failed.read_text())
        for done in sorted(root.glob(f"{kind}/*/*/*/results.json")):
            run, runs = done.parent, runs + 1
            for path in [done, *sorted(run.glob("eval_*.jsonl")), *sorted(run.glob("eval_turns_*.json"))]:
                put(path.relative_to(root), path.read_text())
            if (run / "train" / METRICS_FILE).exists():
                kept = [{k: v for k, v in m.items() if k in REPORT_METRICS or k.startswith(REPORT_PREFIXES)}
                        for m in read_metrics(run / "train")]
                put((run / "train" / METRICS_FILE).relative_to(root),
                    "".join(json.dumps(m) + "\n" for m in kept))
    return {"runs": runs, "bytes": written}
