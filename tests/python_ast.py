"""``ast.parse`` that survives CPython 3.11's shared AST-constructor depth counter.

CPython <= 3.11.8 / 3.12.2 keeps the depth counter of ``ast.parse``'s object construction in interpreter-wide
state (cpython gh-106905). When another thread parses at the same moment (Python 3.11 tracebacks call
``ast.parse`` to place their ``^^^`` carets, so any server thread logging an exception does), the check at the
end fails with ``SystemError: AST constructor recursion depth mismatch``. Seen once in CI (test_sglang_conformance,
while the local engine's server thread logged a refused request). The parse itself was fine: parse again.
"""

from __future__ import annotations

import ast
import gc

_ATTEMPTS = 5


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)``, retried only on the gh-106905 race (any other error is raised)."""
    for attempt in range(_ATTEMPTS):
        collecting = gc.isenabled()
        gc.disable()
        try:
            return ast.parse(source, filename=filename)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e) or attempt == _ATTEMPTS - 1:
                raise
        finally:
            if collecting:
                gc.enable()
    raise AssertionError("unreachable")
