"""Print the pip constraint that keeps the installed torch: ``torch==<its distribution version>``.

tools/bootstrap.sh installs the package with this constraint so that pip never replaces an installed torch.
The version comes from the installed distribution's metadata, not ``torch.__version__``: PyPI's CUDA wheel
reports ``2.13.0+cu130`` at run time while its distribution is ``2.13.0``, and pip cannot satisfy
``torch==2.13.0+cu130`` with it (ResolutionImpossible). The CPU wheel's distribution is ``2.13.0+cpu``, and
the metadata says so too. Standard library only: it runs before anything else is installed.

    python tools/torch_constraint.py   # -> torch==2.13.0
"""

from __future__ import annotations

import importlib.metadata


def torch_constraint(distribution_version: str | None = None) -> str:
    """The constraint line for torch at ``distribution_version`` (default: the installed distribution's)."""
    if distribution_version is None:
        distribution_version = importlib.metadata.version("torch")
    return f"torch=={distribution_version}"


if __name__ == "__main__":
    print(torch_constraint())
