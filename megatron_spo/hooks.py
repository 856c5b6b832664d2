"""Dotted-path hooks: user code named in a config ("my_package.module:function"), loaded and checked at start-up.

    fn = load_hook("my_rewards.code:reward", field="task.reward")   # ConfigError naming the field if it fails
    is_hook("my_rewards.code:reward") -> True; is_hook("squared") -> False

A hook is "module.path:attribute" (the attribute may be dotted: "module:Class.method"). The module is
imported as installed, or from the current directory / PYTHONPATH, like `python -m` would.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

from megatron_spo.config import ConfigError

_HOOK = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_hook(value: object) -> bool:
    return isinstance(value, str) and bool(_HOOK.match(value))


def load_hook(path: str, *, field: str, want: str = "callable"):
    """The object ``path`` names; one-line ConfigError naming ``field`` when it cannot be imported, does not
    exist, or is not callable (want="callable") / not a class (want="class")."""
    if not is_hook(path):
        raise ConfigError(f"{field}: '{path}' is not a hook of the form 'package.module:name'")
    module_name, attr = path.split(":", 1)
    if os.getcwd() not in sys.path:  # a console script does not put the working directory first, as -m does
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module itself failing at import: both are the user's to fix
        raise ConfigError(f"{field}: cannot import '{module_name}' ({type(err).__name__}: {err})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{field}: module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if want == "class" and not isinstance(obj, type):
        raise ConfigError(f"{field}: '{path}' is not a class")
    if want == "callable" and not callable(obj):
        raise ConfigError(f"{field}: '{path}' is not callable")
    return obj
