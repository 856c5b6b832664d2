"""`megatron-spo compare`: SPO against its baselines on the quickstart task, equally tuned, over seeds.

    megatron-spo compare [out_dir=outputs/compare] [arms=[spo,ppo]] [seeds=[0,1,2]] [sweep.enabled=false]
                         [quickstart.train.steps=90 ...] [quickstart.task=toy_math] [--report-only]

1. sweep: every arm gets the same grid (sweep.lrs x its own coefficient) on a validation split of the
   training problems (held out of training, disjoint from the held-out test problems), at sweep.seed; the best
   validation pass@1 wins (chosen.json and the report say which);
2. runs: every arm with its chosen settings at every seed, on the held-out test problems; the reference's
   evaluations and Q0 are made once per seed and shared by the arms, so arms are compared on the same draws;
3. long runs: long_run.arms at long_run.steps_factor x the steps, for stability (grad norm, log-ratio);
4. report.md + PNGs (experiments/study_report.py).

The arms and where a run lives: experiments/arms.py.

Each run is a `megatron-spo quickstart` subprocess writing results.json when it is done: a study that is
stopped and started again skips the finished runs (and redoes an unfinished one from its start).

A study's out_dir (and its archive, `--archive DIR`) keeps its settings in study.json: `compare out_dir=DIR` alone
resumes that study and `compare --report-only out_dir=DIR` alone rewrites its report. Overrides given beside an
existing study.json are applied on top of it: `--report-only` refuses any that changes a setting, in one line naming
each field with both values; a resumed study runs the changed settings and says which changed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron_spo.config import ConfigError, StrictModel, apply_overrides, build_config, quote, read_yaml
from megatron_spo.experiments.arms import ARMS, DATA_ARMS, RunSpec


def _known_arms(arms: list[str]) -> list[str]:
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {bad}; arms are {list(ARMS)}")
    return arms


class SweepConfig(StrictModel):
    enabled: bool = True
    lrs: list[float] = Field(default_factory=lambda: [1e-5, 3e-5, 1e-4, 4e-4], min_length=1,
                             description="down to 1e-5: the clean 2026-11-26 sweeps chose 3e-5 or 1e-4 for every "
                                         "arm, and 4e-4 was every arm's worst")
    coefficients: dict[str, list[float]] = Field(default_factory=dict, description="per arm, replaces the arm's "
                                                 "own grid (ARMS); [] keeps the quickstart's value")
    inherit: dict[str, str] = Field(default_factory=lambda: {"spo-online-plain": "spo-online",
                                                             "spo-online-refresh": "spo-online"}, description="arm -> the arm "
                                    "whose chosen settings it takes (an ablation keeps its parent's settings)")
    validation_problems: int = Field(30, gt=0)
    seed: int = 0
    metric: Literal["pass@1", "pass@10"] = "pass@1"

    @field_validator("coefficients", "inherit")
    @classmethod
    def _arms(cls, v: dict) -> dict:
        _known_arms(list(v) + [x for x in v.values() if isinstance(x, str)])
        return v


class LongRunConfig(StrictModel):
    arms: list[str] = Field(default_factory=lambda: ["spo", "spo-online", "grpo", "grpo-tis"])
    steps_factor: int = Field(3, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0, 1])

    _check = field_validator("arms")(classmethod(lambda cls, v: _known_arms(v)))


class StudyConfig(StrictModel):
    out_dir: str = "outputs/compare"
    arms: list[str] = Field(default_factory=lambda: [a for a in ARMS
                                                     if a not in ("trl-grpo", "spo-lora", *DATA_ARMS)] + ["trl-grpo"],
                            description="default: every arm but those needing `data` and spo-lora (LoRA is not a "
                            "baseline: name it to run it)")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    sweep: SweepConfig = Field(default_factory=SweepConfig)
    long_run: LongRunConfig = Field(default_factory=LongRunConfig)
    quickstart: dict[str, Any] = Field(default_factory=dict, description="quickstart settings for every run "
                                       "(quickstart.train.steps=90, ...)")
    settings: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per arm, the settings its runs "
                                                 "use when sweep.enabled is false (dotted quickstart paths, e.g. an "
                                                 "earlier study's chosen.json); an arm not named runs at the "
                                                 "quickstart's defaults")
    validation_held_out: bool | None = Field(None, description="keep the sweep's validation problems out of the "
                                             "runs' training; None: when the sweep runs (true with settings taken "
                                             "from an earlier sweep's chosen.json trains on that study's problems)")
    retry_failed: bool = Field(False, description="run failed runs again (they have a FAILED file)")
    progress: bool = True
    data: list[str] = Field(default_factory=list, description="offline stores / trajectory JSONL of the data the "
                            f"arms {', '.join(DATA_ARMS)} use (each run keeps its training prompts' records)")
    sft_steps: int = Field(600, gt=0, description="the most SFT steps of every arm with an SFT stage (quickstart "
                           "sft.steps; the same for all of them). On the code task's 90 expert solutions the "
                           "validation NLL fell until ~225 steps (0.076) and the SFT'd policy at 60 steps solved "
                           "nothing (docs/offpolicy-data.md)")
    sft_eval_every: int = Field(25, ge=0, description="early-stop the SFT stage (quickstart sft.eval_every): every N "
                                "steps the response NLL on the validation problems' data, keeping the best step "
                                "(sft_steps is then the most); needs the validation problems held out of the runs "
                                "(validation_held_out, or the sweep); 0: all sft_steps")

    _check = field_validator("arms")(classmethod(lambda cls, v: _known_arms(v)))

    @model_validator(mode="after")
    def _data_arms(self) -> StudyConfig:
        need = [a for a in self.arms if ARMS[a].uses]
        if need and not self.data:
            raise ValueError(f"data: arms {need} learn from the study's data; give data=[STORE, ...]")
        if self.sft_eval_every and not self.holds_out_validation and any("sft" in ARMS[a].uses for a in self.arms):
            raise ValueError(f"sft_eval_every {self.sft_eval_every}: early stopping reads the validation problems' "
                             "data, which these runs train on; set validation_held_out=true (or sft_eval_every=0)")
        return self

    @field_validator("settings")
    @classmethod
    def _settings_arms(cls, v: dict) -> dict:
        _known_arms(list(v))
        return v

    @property
    def holds_out_validation(self) -> bool:
        """Whether the runs keep the sweep's validation problems out of training (validation_held_out, else the
        sweep's)."""
        return self.sweep.enabled if self.validation_held_out is None else self.validation_held_out

    def fixed_settings(self) -> dict[str, dict]:
        """The chosen settings of a study without a sweep."""
        return {a: {"settings": dict(self.settings.get(a, {}))} for a in self.arms}


def _flat(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:  # an empty one ({}: a sub-config at its defaults, train.lora={}) stays
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def quickstart_overrides(study: StudyConfig, spec: RunSpec, root: Path) -> list[str]:
    """The `megatron-spo quickstart` arguments of one run."""
    arm = ARMS[spec.arm]
    base = apply_overrides(json.loads(json.dumps(study.quickstart)), list(arm.overrides))
    shared = root / "shared" / f"seed{spec.seed}"  # the training problems are the same in every kind of run
    extra = {"out_dir": str(spec.run_dir(root).parent), "algo": arm.algo, "seed": spec.seed,
             "reuse_dir": str(shared), "progress": False}
    if spec.kind == "sweep":
        extra.update({"validation_problems": study.sweep.validation_problems, "eval_splits": ["validation"]})
    else:  # the same training problems as the sweep (validation stays out), scored on the test problems
        extra.update({"validation_problems": study.sweep.validation_problems if study.holds_out_validation else 0,
                      "eval_splits": ["heldout"]})
    if arm.uses:  # the same data and SFT budget for every arm that uses them
        extra["offline_data"] = list(study.data)
    if "sft" in arm.uses:
        extra["sft.steps"] = study.sft_steps
        if study.sft_eval_every:
            extra["sft.eval_every"] = study.sft_eval_every
    apply_overrides(base, [f"{k}={json.dumps(v)}" for k, v in extra.items()])
    apply_overrides(base, [f"{path}={json.dumps(value)}" for path, value in spec.settings])
    return _flat(base)


def _check_quickstart(study: StudyConfig) -> None:
    """Fail now, naming the field, rather than after an hour of runs."""
    from megatron_spo.experiments.quickstart import QuickstartConfig

    for arm in study.arms:
        spec = RunSpec("runs", arm, study.seeds[0], ())
        build_config(QuickstartConfig, apply_overrides({}, quickstart_overrides(study, spec, Path("/tmp"))),
                     f"compare: arm {arm}")


def _check_reference(study: StudyConfig, root: Path) -> None:
    """A resumed study's shared evaluations and Q0 must be this machine's reference's: every new run would refuse
    them (quickstart.claim_reuse_dir), so say it once, before any run, rather than in a FAILED file per run."""
    from megatron_spo.experiments.quickstart import QuickstartConfig, claim_reuse_dir
    from megatron_spo.experiments.reference_model import build_reference, reference_identity

    used = sorted(p for p in (root / "shared").glob("seed*") if p.is_dir() and any(p.iterdir()))
    if not used:
        return
    spec = RunSpec("runs", study.arms[0], study.seeds[0], ())
    cfg = build_config(QuickstartConfig, apply_overrides({}, quickstart_overrides(study, spec, root)), "compare")
    identity = reference_identity(build_reference(cfg.reference, cfg.cache_dir, progress=False))
    for shared in used:
        claim_reuse_dir(shared, identity, who="compare")


def failure(spec: RunSpec, root: Path) -> str | None:
    """Why a run failed (its FAILED file: the error line of its log), or None (also for a run that finished on a
    retry: folders from before retries removed the file keep it)."""
    path = spec.run_dir(root).parent / "FAILED"
    if (spec.run_dir(root) / "results.json").exists():
        return None
    return path.read_text().strip() if path.exists() else None


def _error_line(log_path: Path) -> str:
    lines = [ln.split("]: ")[-1].strip() for ln in log_path.read_text(errors="replace").splitlines()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Diverged", "Exception"))]
    return (errors or lines or ["no output"])[-1][:300]


def run_one(study: StudyConfig, spec: RunSpec, root: Path, log, run: bool = True) -> dict | None:
    """The run's results.json, running it unless a finished one is there; None when it failed (the reason goes to
    its FAILED file; a failed run is not retried unless retry_failed, since most failures are the settings', e.g.
    a diverged learning rate)."""
    out = spec.run_dir(root)
    done = out / "results.json"
    if done.exists():
        return json.loads(done.read_text())
    if not run or (failure(spec, root) is not None and not study.retry_failed):
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    args = quickstart_overrides(study, spec, root)
    t0 = time.perf_counter()
    with open(out.parent / "quickstart.log", "w") as f:
        proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "quickstart", *args], stdout=f,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or not done.exists():
        (out.parent / "FAILED").write_text(_error_line(out.parent / "quickstart.log") + "\n")
        log(f"FAILED {spec.kind} {spec.arm} {spec.tag} seed {spec.seed} after {seconds:.0f} s "
            f"(exit {proc.returncode}): see {out.parent / 'quickstart.log'}")
        return None
    (out.parent / "FAILED").unlink(missing_ok=True)  # an earlier attempt's, retried (retry_failed)
    result = json.loads(done.read_text())
    log(f"done {spec.kind} {spec.arm} {spec.tag} seed {spec.seed} in {seconds:.0f} s")
    return result


def sweep_grid(study: StudyConfig, arm: str) -> list[tuple[tuple[str, Any], ...]]:
    a = ARMS[arm]
    coefs = study.sweep.coefficients.get(arm, list(a.grid))
    # lr * lr_scale rounded to 12 digits: 3e-5 x 10 is 3e-4, not 3.0000000000000003e-4 (run folders name the lr)
    lrs = [float(f"{lr * a.lr_scale:.12g}") for lr in study.sweep.lrs]
    return [(("train.lr", lr),) + (((a.coefficient, c),) if coefs else ()) for lr in lrs for c in (coefs or [None])]


def choose(study: StudyConfig, root: Path, log, run: bool = True) -> dict[str, dict]:
    """Per arm: every grid point's validation score and the chosen settings (the best; ties: the first).
    run=False: from the finished runs only."""
    chosen = {}
    metric = study.sweep.metric
    inherit = study.sweep.inherit
    for arm in sorted(study.arms, key=lambda a: a in inherit):  # parents first
        if arm in inherit and inherit[arm] in chosen:
            chosen[arm] = {**chosen[inherit[arm]], "grid": [], "inherited_from": inherit[arm]}
            continue
        scores = []
        for settings in sweep_grid(study, arm):
            spec = RunSpec("sweep", arm, study.sweep.seed, settings)
            result = run_one(study, spec, root, log, run)
            score = None if result is None else result["validation"][metric]["after"]
            scores.append({"settings": dict(settings), "validation": score, "failure": failure(spec, root)})
        ok = [s for s in scores if s["validation"] is not None]
        best = max(ok, key=lambda s: s["validation"]) if ok else {"settings": {}}
        chosen[arm] = {"settings": best["settings"], "grid": scores, "metric": metric,
                       "not_separated": _not_separated(study, root, arm, best, ok, metric)}
    return chosen


def _validation_records(study: StudyConfig, root: Path, arm: str, settings: dict, metric: str) -> dict[str, float]:
    """Per validation problem, the sweep run's score ({} when the run kept no per-problem file)."""
    path = RunSpec("sweep", arm, study.sweep.seed, tuple(settings.items())).run_dir(root) / "eval_validation_after.jsonl"
    if not path.exists():
        return {}
    scores = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            scores[row["prompt_id"]] = float(row[metric])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"compare: {path}:{n}: not a per-problem evaluation row with prompt_id and {metric} "
                             f"({type(e).__name__}: {e})") from None
    return scores


def paired_gap(best: dict[str, float], other: dict[str, float]) -> tuple[float, float]:
    """(mean, standard error) over the problems both scored of best - other: the noise a validation set of that
    size leaves on a difference between two settings (the same problems, so per-problem difficulty cancels)."""
    diff = [best[p] - other[p] for p in best if p in other]
    if len(diff) < 2:
        return math.nan, math.nan
    return statistics.fmean(diff), statistics.stdev(diff) / math.sqrt(len(diff))


def _not_separated(study: StudyConfig, root: Path, arm: str, best: dict, ok: list[dict], metric: str) -> list[dict]:
    """The other grid points within one paired standard error of the choice on the validation problems: the
    sweep cannot tell them from it (each grid point gets its "gap" and "gap_se"; None without per-problem files)."""
    if not ok:
        return []
    top = _validation_records(study, root, arm, best["settings"], metric)
    tied = []
    for point in ok:
        gap, se = paired_gap(top, _validation_records(study, root, arm, point["settings"], metric))
        point["gap"], point["gap_se"] = (None, None) if math.isnan(se) else (gap, se)
        if point is not best and point["gap_se"] is not None and gap <= se:
            tied.append(point["settings"])
    return tied


def run_study(study: StudyConfig, log=print) -> Path:
    """Sweep, runs, long runs; then the report. Returns the report's path."""
    from megatron_spo.experiments.quickstart import QuickstartTrainConfig
    from megatron_spo.experiments.study_report import write_report

    root = Path(study.out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "study.json").write_text(study.model_dump_json(indent=2) + "\n")
    _check_quickstart(study)
    _check_reference(study, root)
    chosen = choose(study, root, log) if study.sweep.enabled else study.fixed_settings()
    (root / "chosen.json").write_text(json.dumps(chosen, indent=2) + "\n")
    for seed in study.seeds:  # seed-major: a stopped study has every arm at its first seeds
        for arm in study.arms:
            run_one(study, RunSpec("runs", arm, seed, tuple(chosen[arm]["settings"].items())), root, log)
    steps = int(study.quickstart.get("train", {}).get("steps", QuickstartTrainConfig().steps))
    for seed in study.long_run.seeds:
        for arm in [a for a in study.long_run.arms if a in study.arms]:
            settings = tuple(chosen[arm]["settings"].items()) + (("train.steps", steps * study.long_run.steps_factor),)
            run_one(study, RunSpec("long", arm, seed, settings), root, log)
    return write_report(study, root, chosen)


# study.json fields that say where and how a study runs, not what it measures: they may differ between a study's
# study.json and the command line
_OPERATIONAL = ("out_dir", "progress", "retry_failed")


def _pin_steps(data: dict, root: Path) -> None:
    """A study.json without quickstart.train.steps ran at the quickstart's default of its day, which names the long
    runs' folders (steps x steps_factor): take it from the finished runs (their results.json's train_steps), so an
    archive still reads after the default changes. Unchanged when the runs disagree or say nothing."""
    quick = data.get("quickstart")
    if not isinstance(quick, dict) or not isinstance(quick.get("train", {}), dict) or "steps" in quick.get("train", {}):
        return
    steps = set()
    for path in root.glob("runs/*/*/*/results.json"):
        try:
            steps.add(json.loads(path.read_text()).get("train_steps"))
        except (ValueError, AttributeError, OSError):
            return
    if len(steps) == 1 and isinstance(n := steps.pop(), int) and n > 0:
        quick.setdefault("train", {})["steps"] = n


def stored_study(root: Path) -> dict | None:
    """The settings a study's out_dir (or its archive) was run with: its study.json, which every compare run writes
    before its first run and --archive copies, with out_dir set to where it is now (an archive has moved) and
    quickstart.train.steps filled in from the runs where study.json leaves it to the default. None without one."""
    path = root / "study.json"
    if not path.is_file():
        return None
    data = read_yaml(path)  # JSON; size-limited, duplicate keys refused
    if not isinstance(data, dict):
        raise ConfigError(f"compare: {path}: not a study's settings (a JSON object)")
    data["out_dir"] = str(root)
    _pin_steps(data, root)
    return data


def _leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def study_differences(old: StudyConfig, new: StudyConfig) -> list[tuple[str, Any, Any]]:
    """(dotted field, old value, new value) for every setting that differs, the operational ones aside."""
    a = dict(_leaves({k: v for k, v in old.model_dump().items() if k not in _OPERATIONAL}))
    b = dict(_leaves({k: v for k, v in new.model_dump().items() if k not in _OPERATIONAL}))
    unset = "unset"
    return [(k, a.get(k, unset), b.get(k, unset)) for k in [*a, *(k for k in b if k not in a)]
            if a.get(k, unset) != b.get(k, unset)]


def load_study(overrides: list[str], report_only: bool = False, log=print) -> StudyConfig:
    """The study the command line names: its out_dir's study.json (when there is one) with the overrides on top.
    report_only: an override that changes a stored setting is refused in one line (the runs were made with the
    stored ones), as is an out_dir without study.json; otherwise the change is run and said in one line."""
    asked = build_config(StudyConfig, apply_overrides({}, list(overrides)), "compare")
    root = Path(asked.out_dir)
    stored = stored_study(root)
    if stored is None:
        if report_only:
            raise ConfigError(f"compare --report-only: {root} holds no study (no study.json): name a study's out_dir "
                              "or an archive of one")
        return asked
    source = str(root / "study.json")
    before = build_config(StudyConfig, json.loads(json.dumps(stored)), source)
    study = build_config(StudyConfig, apply_overrides(stored, list(overrides)), f"compare (on {source})")
    changed = study_differences(before, study)
    if changed:
        what = "; ".join(f"{k} {quote(new)} given, {quote(old)} in the study" for k, old, new in changed)
        if report_only:
            raise ConfigError(f"compare --report-only: the overrides change {source}: {what} (the runs were made "
                              "with the study's settings: drop the overrides)")
        log(f"compare: resuming {root} with changed settings: {what}")
    return study


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the study, e.g. seeds=[0,1] "
                        "quickstart.train.steps=60")
    parser.add_argument("--report-only", action="store_true", help="write the report from the finished runs, with "
                        "the settings out_dir's study.json holds (no other override needed; one that changes them "
                        "is refused)")
    parser.add_argument("--archive", metavar="DIR", help="copy what the report reads (results, per-problem "
                        "evaluations, the metrics it plots; tens of KB per run) to DIR, from which --report-only "
                        "rewrites the report and compare resumes; runs nothing")
    args = parser.parse_args(argv)
    if args.archive:
        study = build_config(StudyConfig, apply_overrides({}, args.overrides), "compare")
        from megatron_spo.experiments.study_report import archive

        done = archive(Path(study.out_dir), Path(args.archive))
        print(f"archived {done['runs']} finished runs of {study.out_dir} to {args.archive} ({done['bytes'] / 1e6:.2f} MB)")
        return 0
    study = load_study(args.overrides, report_only=args.report_only)
    if args.report_only:
        from megatron_spo.experiments.study_report import write_report

        root = Path(study.out_dir)
        chosen = choose(study, root, print, run=False) if study.sweep.enabled else study.fixed_settings()
        path = write_report(study, root, chosen)
    else:
        path = run_study(study)
    print(f"report: {path}")
    return 0
