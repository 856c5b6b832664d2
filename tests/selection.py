"""What this session's selected tests ask of a shared fixture.

A module fixture that computes many cases in one spawned group (every layout, every family, every algorithm) computes
only the cases its selected tests read: the whole suite selects them all, while the second CI leg (``-m
newest_megatron``) or ``pytest -k`` selects a few, and building the others would only cost time. A test that reads a
case the fixture did not compute fails on the missing key, so nothing is skipped silently.
"""
from __future__ import annotations

import pytest


def selected_params(request: pytest.FixtureRequest, test_name: str, *params: str) -> set:
    """The values of ``params`` (one: the value; several: a tuple) over the selected items of ``test_name`` in the
    requesting module."""
    items = [item for item in request.session.items
             if item.module is request.module and getattr(item, "originalname", None) == test_name]
    values = [tuple(item.callspec.params[p] for p in params) for item in items]
    return {v[0] if len(params) == 1 else v for v in values}


def is_selected(request: pytest.FixtureRequest, *test_names: str) -> bool:
    """Whether any of ``test_names`` (function names in the requesting module) is selected."""
    return any(item.module is request.module and getattr(item, "originalname", None) in test_names
               for item in request.session.items)
