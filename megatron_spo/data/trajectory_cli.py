"""`megatron-spo trajectories import|export|check`: trajectory JSONL files <-> offline stores.

    megatron-spo trajectories import samples.jsonl STORE [--kind reference --model M ...]   (appends shards)
    megatron-spo trajectories export STORE out.jsonl
    megatron-spo trajectories check samples.jsonl | STORE
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from megatron_spo.checkpoint_digest import set_verify, verify_enabled
from megatron_spo.cli import non_negative_float, positive_float, positive_int
from megatron_spo.data.offline_store import OfflineStore, StoreError, write_store
from megatron_spo.data.trajectory import (
    PROVENANCE_KINDS,
    ImportReport,
    RecordError,
    read_jsonl,
    validate_provenance,
    write_jsonl,
)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="megatron-spo trajectories",
                                     description="Convert and check trajectory files (JSONL <-> offline store).")
    sub = parser.add_subparsers(dest="op", required=True)
    imp = sub.add_parser("import", help="JSONL file(s) -> a new or existing offline store (appends shards)")
    imp.add_argument("inputs", nargs="+", help="trajectory JSONL files (one record a line)")
    imp.add_argument("store", help="the offline store folder (created, or appended to)")
    imp.add_argument("--rows-per-shard", type=positive_int, default=65536, help="records per shard")
    g = imp.add_argument_group("provenance", "given to every record that has none (records keep their own); "
                               "created = the time of the import")
    g.add_argument("--kind", choices=PROVENANCE_KINDS, default=None,
                   help="e.g. reference for estimate-q0 --trajectories-out, pts for pts output")
    g.add_argument("--model", default=None, help="the producing model")
    g.add_argument("--run-id", default=None, help="the producing run")
    g.add_argument("--temperature", type=non_negative_float, default=None, help="the sampling temperature")
    g.add_argument("--top-p", type=positive_float, default=None, help="the sampling top-p, in (0, 1]")
    g.add_argument("--origin", default=None, help="a label of the input (default: the file name)")
    exp = sub.add_parser("export", help="offline store -> JSONL")
    exp.add_argument("store", help="the offline store folder")
    exp.add_argument("output", help="the JSONL file to write")
    exp.add_argument("--force", action="store_true", help="overwrite OUTPUT if it exists")
    chk = sub.add_parser("check", help="validate a JSONL file or a store and print counts")
    chk.add_argument("path", help="a JSONL file or an offline store folder")
    for p in (imp, exp, chk):
        p.add_argument("--skip-invalid", action="store_true", help="skip bad records (counted and reported)")
    for p in (exp, chk):
        p.add_argument("--no-verify", action="store_true",
                       help="do not compare store files with their checksums (for a store you edited yourself); a "
                       "mismatch is otherwise refused naming the file")
    args = parser.parse_args(argv)

    report = ImportReport()
    verify = verify_enabled()
    set_verify(verify and not getattr(args, "no_verify", False))
    try:
        if args.op == "import":
            stamp = None
            if args.kind is not None:
                stamp = {"kind": args.kind, "model": args.model, "run_id": args.run_id,
                         "temperature": args.temperature, "top_p": args.top_p, "created": time.time()}
            elif any(v is not None for v in (args.model, args.run_id, args.temperature, args.top_p, args.origin)):
                parser.error("--model / --run-id / --temperature / --top-p / --origin describe a --kind: give it")
            records = []
            for path in args.inputs:
                loaded, rep = read_jsonl(path, skip_invalid=args.skip_invalid)
                if stamp is not None:
                    given = validate_provenance({**stamp, "origin": args.origin or Path(path).name},
                                                "the command line")
                    for rec in loaded:
                        if rec.provenance is None:
                            rec.provenance = given
                records += loaded
                report.add(rep)
            write_store(records, args.store, rows_per_shard=args.rows_per_shard)
            print(f"imported {report.read} records into {args.store}")
        elif args.op == "export":
            out = Path(args.output)
            if out.is_dir() or (out.exists() and not args.force):
                what = "is a folder" if out.is_dir() else "exists (--force overwrites it)"
                raise FileExistsError(f"trajectories export: output '{out}' {what}")
            store = OfflineStore(args.store, skip_invalid=args.skip_invalid)
            report = store.report
            write_jsonl(store.trajectories(), args.output)
            print(f"exported {report.read} records to {args.output}")
        else:
            path = Path(args.path)
            if path.is_dir():
                report = OfflineStore(path, skip_invalid=args.skip_invalid).report
            else:
                report = read_jsonl(path, skip_invalid=args.skip_invalid)[1]
            print(f"{args.path}: {report.read} valid records")
    except (RecordError, FileNotFoundError, FileExistsError, StoreError) as err:
        print(f"megatron-spo trajectories: {err}", file=sys.stderr)
        return 1
    finally:
        set_verify(verify)
    report.print_skipped()
    return 0
