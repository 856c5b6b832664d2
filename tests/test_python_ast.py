"""python_ast.parse holds where ast.parse loses the cpython gh-106905 race (a CI failure on 2026-11-25)."""

from __future__ import annotations

import ast
import gc
import sys
import threading
import time
from pathlib import Path

import pytest
import python_ast

SOURCE = Path(__file__).with_name("sglang_source.py").read_text()


def _under_contention(parse, tries: int) -> int:
    """Parse SOURCE ``tries`` times while another thread parses too and every collection yields the GIL (the
    way a finalizer doing I/O does); returns how many parses raised SystemError."""
    stop = threading.Event()

    def other_parser():
        while not stop.is_set():
            try:
                ast.parse("x = (1 + 2) * 3")
            except SystemError:
                pass
            time.sleep(0)

    def yield_gil(phase, info):
        time.sleep(0.0002)

    gc.callbacks.append(yield_gil)
    thread = threading.Thread(target=other_parser, daemon=True)
    thread.start()
    failures = 0
    try:
        for _ in range(tries):
            try:
                parse(SOURCE)
            except SystemError:
                failures += 1
    finally:
        stop.set()
        thread.join()
        gc.callbacks.remove(yield_gil)
    return failures


def test_parse_survives_a_concurrent_parser():
    assert _under_contention(python_ast.parse, 20) == 0
    assert gc.isenabled()  # the collector is paused only during the parse
    assert ast.dump(python_ast.parse(SOURCE)) == ast.dump(ast.parse(SOURCE))


def test_the_race_is_real_on_this_python():
    """Guards the test above from passing vacuously: the contention it makes does break plain ast.parse on the
    Python CI runs (3.11.7: about 49 parses in 50). Python 3.12.1 measured 0 in 20: nothing to show there."""
    failures = _under_contention(ast.parse, 20)
    if sys.version_info[:2] != (3, 11):
        pytest.skip(f"Python {sys.version.split()[0]}: the race is not reproduced here ({failures} failures)")
    assert failures > 0
