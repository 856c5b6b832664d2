"""`megatron-spo plot` on what is not a run says what it is in one line (a study report folder, a folder of runs)."""

import json
from pathlib import Path

from megatron_spo.training.metrics import plot_main

REPO = Path(__file__).resolve().parents[1]


def _run(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": s, "loss": 1.0 / s,
                                                              "logprob_gap/mean_abs": 1e-7 * s}) + "\n"
                                                  for s in (1, 2)))


def test_plot_on_a_study_folder_or_a_folder_of_runs_says_why_in_one_line(tmp_path, capsys):
    study = next(p for p in sorted(REPO.glob("docs/study-*")) if (p / "report.md").exists())  # an archived report
    assert plot_main([str(study)]) == 1
    assert capsys.readouterr().err == (f"megatron-spo plot: {study} is a study report (its plots are the PNGs beside "
                                       "report.md; it keeps no metrics): plot a run of the study's out_dir instead\n")
    _run(tmp_path / "runs" / "spo" / "seed0")
    _run(tmp_path / "runs" / "spo" / "seed1")
    assert plot_main([str(tmp_path / "runs")]) == 1
    assert capsys.readouterr().err == (f"megatron-spo plot: {tmp_path / 'runs'} is a folder of 2 runs, not a run: plot "
                                       f"each one (e.g. megatron-spo plot {tmp_path / 'runs' / 'spo' / 'seed0'})\n")
    assert plot_main([str(tmp_path / "runs" / "spo" / "seed0")]) == 0
    written = capsys.readouterr().out.split()
    assert str(tmp_path / "runs" / "spo" / "seed0" / "plots" / "engine_vs_trainer_log_prob_gap_per_token.png") in written
