"""`megatron-spo router ARGS`: sglang-router's Rust router, started as `python -m sglang_router.launch_router ARGS`
starts it, without importing sglang.

sglang_router/launch_router.py imports its Python MiniLB (a debugging-only balancer) at module level, and that
imports the whole sglang package when sglang is installed: ~16 CPU s per router start on a CPU core, for a
router that is a Rust binary. Here: the same parser (RouterArgs.add_cli_args / from_cli_args, as
launch_router's parse_router_args builds it), the same RouterArgs._validate_router_args and
Router.from_args(...).start() (sglang-router 0.3.2, setup.py's pin). `--mini-lb` goes to launch_router itself.
The process keeps its command line (launch_router renames itself "sglang::router").
"""

from __future__ import annotations

import argparse
import runpy
import sys


def parse_router_args(argv: list[str]):
    """RouterArgs from ``argv`` as sglang_router.launch_router.parse_router_args parses it (SystemExit(2) on a
    bad flag)."""
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="megatron-spo router", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)


def main(argv: list[str]) -> int:
    try:
        from sglang_router.router import Router
    except ImportError as err:
        print(f"megatron-spo router: sglang-router is not installed ({err}); pip install sglang-router",
              file=sys.stderr)
        return 2
    if "--mini-lb" in argv:  # the Python balancer: launch_router itself (it imports sglang for it anyway)
        sys.argv = ["sglang_router.launch_router", *argv]
        runpy.run_module("sglang_router.launch_router", run_name="__main__", alter_sys=True)
        return 0
    args = parse_router_args(argv)
    args._validate_router_args()
    Router.from_args(args).start()  # serves until the process is stopped
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
