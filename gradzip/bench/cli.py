"""``gradzip bench {compress,engine,train,sync,overlap,fsdp}``: each benchmark is a module of this package that
provides ``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib

from gradzip.subcommands import add_subcommands

BENCHMARKS = {
    "compress": ("gradzip.bench.compress", "compress+decompress time of every compressor vs memcpy"),
    "engine": ("gradzip.bench.engine", "engine overhead and overlap vs torch DDP (multi-process Gloo)"),
    "train": ("gradzip.bench.train", "tokens/s of BERT models on this machine"),
    "sync": ("gradzip.bench.sync", "local work of one DiLoCo sync vs memcpy, and its memory"),
    "overlap": ("gradzip.bench.overlap", "wall time per round of rare syncs with and without overlap=1, on the "
                "network testbed (root)"),
    "fsdp": ("gradzip.bench.fsdp", "fsdp_compress vs plain FSDP2: step time and bytes (multi-process Gloo)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    add_subcommands(sub, BENCHMARKS, "_bench_module")


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(args._bench_module).run(args)
