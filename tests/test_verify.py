"""`megatron-spo verify`: the table a person reads, the PNG and JSON it writes, its exit status."""

from __future__ import annotations

import json

import pytest

from megatron_spo import cli


def test_verify_prints_table_and_writes_png_and_json(tmp_path, capsys):
    out = tmp_path / "verify"
    status = cli.main(
        ["verify", "--out", str(out), "--tasks", "bandit", "--methods", "terminal/squared,kl-regularised"]
    )
    printed = capsys.readouterr().out
    assert status == 0
    assert "KL(pi || pi*)" in printed and "spo terminal/squared" in printed and "kl-regularised pg" in printed
    assert "Thm 2.2 Bellman" in printed and "verify: all checks passed" in printed

    png = (out / "kl_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    summary = json.loads((out / "results.json").read_text())
    assert summary["passed"] is True
    runs = {r["method"]: r for r in summary["runs"]}
    assert set(runs) == {"spo terminal/squared", "spo terminal/squared centred", "spo terminal/squared centred "
                         "(on-policy)", "kl-regularised pg"}
    assert runs["spo terminal/squared"]["kl_end"] < 1e-3 <= 1e-1 <= runs["kl-regularised pg"]["kl_end"]
    assert runs["spo terminal/squared"]["reduction"] >= 100
    assert all(c["passed"] for c in summary["checks"]) and len(summary["checks"]) == 8


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tasks", "gridworld"], "--tasks: unknown task(s) gridworld; choose from bandit, ar, ar-eos"),
        (["--tasks", "bandit", "--methods", "dpo"], "--methods 'dpo' matches no method"),
    ],
)
def test_verify_rejects_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["verify", "--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
