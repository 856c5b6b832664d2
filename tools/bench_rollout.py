"""Rollout throughput on this machine, all numbers from one run.

    python tools/bench_rollout.py [--hidden 256 --layers 4] [--requests 24] [--new-tokens 32]

1. tokens/s of 1 vs 2 local engines behind one sglang-router (same concurrent workload, 1 thread per
   engine; the second engine is taken out of / put back into the router in alternating rounds);
2. client + router overhead: each request timed in-process (LocalEngine.generate, 1 thread) and then
   through EngineClient -> router -> engine, interleaved, as a ratio.
The model is a random Llama generated here (no download).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from rollout_helpers import engine_env, make_tiny_llama  # noqa: E402

from megatron_spo.rollout.client import EngineClient  # noqa: E402
from megatron_spo.rollout.fleet import Fleet  # noqa: E402
from megatron_spo.rollout.local_engine import LocalEngine, Req  # noqa: E402
from megatron_spo.rollout.protocol import SamplingParams  # noqa: E402


def prompts(count: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 60, (length,), generator=gen).tolist() for _ in range(count)]


async def concurrent_load(url: str, workload, params: SamplingParams, concurrency: int) -> tuple[int, float]:
    async with EngineClient(url) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one(p):
            async with sem:
                [group] = await client.generate([p], params, return_logprob=True)
                return sum(len(c.output_ids) for c in group)

        await one(workload[0])  # warm-up
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*[one(p) for p in workload]))
        return tokens, time.perf_counter() - start


async def interleaved_overhead(url: str, engine: LocalEngine, workload, params: SamplingParams):
    """Per request, alternately: in-process generate, then the same request through client+router+engine.
    Alternating cancels most of the drift of a shared machine."""
    inproc, http = [], []
    async with EngineClient(url) as client:
        await client.generate([workload[0]], params)
        engine.generate([Req(workload[0], params, f"w{i}") for i in range(params.n)])
        for p in workload:
            start = time.perf_counter()
            engine.generate([Req(p, params, f"r{i}") for i in range(params.n)])
            inproc.append(time.perf_counter() - start)
            start = time.perf_counter()
            await client.generate([p], params, return_logprob=True)
            http.append(time.perf_counter() - start)
    return inproc, http


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.7, top_p=0.95, n=args.n, ignore_eos=True)
    workload = prompts(args.requests, args.prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_llama(os.path.join(tmp, "model"), hidden=args.hidden, layers=args.layers)
        model_dir = os.path.abspath(model_dir)
        nparams = sum(p.numel() for p in LocalEngine(model_dir).model.parameters())
        print(f"model: random Llama {nparams / 1e6:.1f}M params; {args.requests} requests x n={args.n} x "
              f"{args.new_tokens} new tokens, prompt {args.prompt_len}, concurrency {args.concurrency}")

        rates: dict[int, list[float]] = {1: [], 2: []}
        with Fleet(model_dir, 2, env=engine_env(), threads_per_engine=1) as fleet:
            second = fleet.engine_urls[1]
            for _ in range(args.rounds):  # alternate 1 and 2 engines behind the same router
                for engines in (1, 2):
                    if engines == 1:
                        fleet.router_remove(second)
                    else:
                        fleet.router_add(second)
                    tokens, seconds = asyncio.run(concurrent_load(fleet.router_url, workload, params,
                                                                  args.concurrency))
                    rates[engines].append(tokens / seconds)
            fleet.router_remove(second)  # overhead: one engine, so the in-process copy is its twin
            engine = LocalEngine(model_dir)
            inproc, http = asyncio.run(interleaved_overhead(fleet.router_url, engine, workload, params))
        one, two = statistics.median(rates[1]), statistics.median(rates[2])
        print(f"tokens/s via router, median of {args.rounds} alternating rounds: 1 engine {one:.0f} "
              f"{[round(r) for r in rates[1]]}, 2 engines {two:.0f} {[round(r) for r in rates[2]]}")
        print(f"ratio 2 engines / 1 engine tokens/s: {two / one:.2f}")
        ratios = [h / i for i, h in zip(inproc, http)]
        print(f"sequential requests, interleaved: in-process {sum(inproc):.2f} s, client+router+engine "
              f"{sum(http):.2f} s; overhead total {100 * (sum(http) / sum(inproc) - 1):+.1f}%, median per request "
              f"{100 * (statistics.median(ratios) - 1):+.1f}% ({1000 * statistics.median(h - i for i, h in zip(inproc, http)):+.1f} ms)")
        print(f"note: {os.cpu_count()} CPU cores on this machine, shared with other jobs")


if __name__ == "__main__":
    main()
