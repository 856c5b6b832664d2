"""Throughput and peak memory of `offline build` and `offline stats` on a generated store.

    python tools/bench_experience.py                       # 1M records (and 250k, to show how memory grows)
    python tools/bench_experience.py --rows 200000 --sizes 1 --text    # also dedup on decoded text

The store: small records (8-token prompts, 8-24-token responses) over rows/100 prompts, provenance cycling
through online / reference / human / other-model / none, 40% failing, a quarter of the rows exact copies of
an earlier row of their prompt. Build keeps passing rows, deduplicates and caps human at rows/20. Each step runs
in its own process, which reports its peak RSS (VmHWM) and that of a process that only imported the
modules (the fixed cost).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
from megatron_spo.data.experience import BuildOptions, build_store, store_stats

def peak_mb():  # VmHWM: this process's peak RSS (ru_maxrss would carry the parent's over the exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

args = json.loads(sys.argv[1])
rss0 = peak_mb()
t = time.perf_counter()
out = {{}}
if args["op"] == "build":
    decode = None
    if args["text"]:
        from megatron_spo.data.char_tokenizer import build_char_tokenizer
        tok = build_char_tokenizer()
        decode = lambda batch: tok.batch_decode(batch, skip_special_tokens=True)
    stats = build_store([args["store"]], args["out"], BuildOptions(cap={{"human": args["cap"]}}, decode=decode))
    total = stats.total()
    out = {{"read": total.read, "written": total.written, "duplicates": total.duplicates, "capped": total.capped,
           "verdict_dropped": total.verdict_dropped, "keys": stats.keys}}
elif args["op"] == "stats":
    groups = store_stats([args["store"]])
    out = {{"groups": len(groups), "read": sum(g.rows for g in groups.values())}}
out["seconds"] = time.perf_counter() - t
out["peak_rss_mb"] = peak_mb()
out["import_rss_mb"] = rss0
print(json.dumps(out))
"""


def generate(path: Path, rows: int, seed: int = 0) -> float:
    sys.path.insert(0, str(ROOT))
    from megatron_spo.data.offline_store import OfflineStoreWriter
    from megatron_spo.data.trajectory import Provenance, Trajectory

    rng = random.Random(seed)
    prompts = max(rows // 100, 1)
    kinds = [Provenance("online", run_id="run-1", temperature=0.7, top_p=0.95, created=1.7e9),
             Provenance("reference", temperature=0.5, top_p=0.95), Provenance("human", origin="codecontests"),
             Provenance("other-model", model="m70b"), None]
    recent: dict[int, list[int]] = {}
    t = time.perf_counter()
    with OfflineStoreWriter(path, rows_per_shard=65536) as writer:
        for i in range(rows):
            p = rng.randrange(prompts)
            if p in recent and rng.random() < 0.25:
                response = recent[p]
            else:
                response = [rng.randrange(4, 100) for _ in range(rng.randint(8, 24))]
                recent[p] = response
            writer.add(Trajectory(prompt_id=f"codecontests/{p}", prompt_tokens=[1] + [5 + p % 90] * 7,
                                  response_tokens=response, reward=-1.0 if rng.random() < 0.4 else 0.0,
                                  source="offline", policy_version=i % 7, provenance=kinds[i % len(kinds)]))
    return time.perf_counter() - t


def child(op: str, **kw) -> dict:
    code = CHILD.format(root=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code, json.dumps({"op": op, **kw})], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--sizes", type=int, default=2, help="1: only --rows; 2: also --rows / 4")
    parser.add_argument("--text", action="store_true", help="also deduplicate on decoded text (char tokenizer)")
    parser.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_experience."))
    sizes = [args.rows // 4, args.rows] if args.sizes == 2 else [args.rows]
    try:
        for rows in sizes:
            store, out = work / f"store-{rows}", work / f"built-{rows}"
            for p in (store, out):
                shutil.rmtree(p, ignore_errors=True)
            gen_s = generate(store, rows)
            size_mb = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / 2**20
            b = child("build", store=str(store), out=str(out), cap=rows // 20, text=args.text)
            s = child("stats", store=str(store))
            print(f"{rows} records ({size_mb:.0f} MB on disk, generated in {gen_s:.0f} s):")
            print(f"  build: {b['read'] / b['seconds']:,.0f} rows/s ({b['seconds']:.1f} s), peak RSS "
                  f"{b['peak_rss_mb']:.0f} MB ({b['import_rss_mb']:.0f} MB after imports); wrote {b['written']}, "
                  f"dropped {b['verdict_dropped']} failing, {b['duplicates']} duplicates, {b['capped']} capped; "
                  f"{b['keys']} dedup keys")
            print(f"  stats: {s['read'] / s['seconds']:,.0f} rows/s ({s['seconds']:.1f} s), peak RSS "
                  f"{s['peak_rss_mb']:.0f} MB ({s['import_rss_mb']:.0f} MB after imports)")
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
