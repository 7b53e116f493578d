"""``gradzip simulate``'s command line: its flags, the encode costs from a ``gradzip bench compress
--json`` file, and the table it prints. The cost model itself, and its description (the epilog
of ``gradzip simulate --help``), is :mod:`gradzip.cluster.simulate`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from gradzip.cluster import sharded, simulate
from gradzip.cluster.auto import plan
from gradzip.cluster.goodput import Faults, Goodput, json_fields, mtbf_from_rate, predict_goodput
from gradzip.cluster.models import MODELS
from gradzip.cluster.network import ALGORITHMS, Cluster, CodecCost
from gradzip.cluster.simulate import DTYPES, Prediction, Workload, exchanged_spec, parse_sync, predict
from gradzip.compress.registry import create
from gradzip.errors import GradzipError
from gradzip.plan.auto import AutoSpec, is_auto, parse_auto
from gradzip.units import parse_bandwidth, parse_duration, parse_latency


# ------------------------------------------------------------------------------ encode costs
def _param_set(spec: str) -> tuple[str, frozenset[str]]:
    """(name, {"k=v", ...}) of a spec, ignoring ``ef`` (bench rows may repeat it)."""
    name, _, rest = spec.strip().lower().partition(":")
    return name, frozenset(p.strip() for p in rest.split(",") if p.strip() and not p.strip().startswith("ef="))


def codec_from_bench(path: str, spec: str) -> CodecCost:
    """Per-element costs of ``spec`` from a ``gradzip bench compress --json`` file.

    Rows: ``{"name", "spec", "numel", "time_s"}`` (compress + decompress of one payload), or with
    separate ``compress_s``/``decompress_s``. The row with the same name and parameters (``ef``
    ignored) is used, else the first row with the same name. encode = time / numel; aggregate
    (per other rank, allgather compressors) = decompress time / numel, or half the round trip
    when the row does not separate them.
    """
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GradzipError(f"--encode-cost file {path} does not exist "
                           "(write it with `gradzip bench compress --json > FILE.json`)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GradzipError(f"--encode-cost file {path} is not JSON: {e}") from None
    except OSError as e:  # a directory, unreadable
        raise GradzipError(f"--encode-cost {path}: cannot read it ({e.strerror or type(e).__name__}); give the JSON "
                           "file of `gradzip bench compress --json`") from None
    rows = data.get("results", []) if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise GradzipError(f"--encode-cost file {path}: expected a list of rows")
    comp = create(spec)
    want = _param_set(getattr(comp, "inner", comp).spec)
    rows = [r for r in rows if isinstance(r, dict) and r.get("numel") and "error" not in r]
    named = [r for r in rows if _param_set(str(r.get("spec") or r.get("name") or ""))[0] == want[0]]
    exact = [r for r in named if _param_set(str(r.get("spec") or r.get("name")))[1] == want[1]]
    for r in exact or named:
        name = r.get("spec") or r.get("name")
        numel, where = _row_number(r, "numel", path, name), f"{path} ({name}, {r['numel']} elements)"
        if numel <= 0:
            raise GradzipError(f"--encode-cost file {path}: row {name}: numel must be positive, got {r['numel']!r}")
        if r.get("compress_s") is not None and r.get("decompress_s") is not None:
            enc, dec = _row_number(r, "compress_s", path, name), _row_number(r, "decompress_s", path, name)
            return CodecCost((enc + dec) / numel, dec / numel, where)
        key = "time_s" if "time_s" in r else "seconds"
        if r.get(key) is not None:
            total = _row_number(r, key, path, name)
            return CodecCost(total / numel, total / 2 / numel, where)
    raise GradzipError(f"--encode-cost file {path} has no timing for {want[0]}; "
                       f"run `gradzip bench compress --json --compressor {want[0]}`")


def _row_number(row: dict, key: str, path: str, name: object) -> float:
    """``row[key]`` of a bench JSON row as a finite number, or a one-line error naming the file and row."""
    v = row[key]
    try:
        if isinstance(v, bool):
            raise TypeError
        x = float(v)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise GradzipError(f"--encode-cost file {path}: row {name}: {key} must be a number, got {v!r} "
                           "(write the file with `gradzip bench compress --json > FILE.json`)")
    return x


def codec_for(spec: str, encode: str | None, aggregate: str | None) -> CodecCost:
    """The codec cost of ``spec`` from the flags (``none``: zero, it sends the gradient itself)."""
    is_file = encode is not None and (Path(encode).suffix == ".json" or Path(encode).exists())
    enc = None if encode is None or is_file else _nonneg(encode, "--encode-cost")
    agg = None if aggregate is None else _nonneg(aggregate, "--aggregate-cost")
    comp = create(spec)
    if comp.identity:
        return CodecCost(0.0, 0.0, "none: nothing to encode")
    if is_file:
        base = codec_from_bench(str(encode), spec)
    elif enc is not None:
        base = CodecCost(enc, 0.0, f"--encode-cost {encode} s/element")
    else:
        base = CodecCost()
    if agg is not None:
        base = CodecCost(base.encode_s, agg, base.source + f", --aggregate-cost {aggregate}")
    return base


def _nonneg(text: str, flag: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise GradzipError(f"{flag} takes a JSON file from `gradzip bench compress --json` or seconds per "
                           f"element, got {text!r}") from None
    if v < 0 or not math.isfinite(v):
        raise GradzipError(f"{flag} must be a finite number >= 0, got {text!r}")
    return v


# ------------------------------------------------------------------------------ CLI
EPILOG = (simulate.__doc__ or "").split("\n\n", 1)[1] + """
Example (the projection in docs/simulator.md):
  gradzip simulate --model bert-large --nodes 8 --gpus-per-node 4 --inter-bandwidth 10gbit \\
      --intra-bandwidth 100gbit --tokens-per-second 5600 --batch-size 32 --seq-len 128 \\
      --compressor none --compressor fp16 --compressor topk:ratio=0.01,ef=true --tokens 16.75e9 --epochs 40
DiLoCo beside per-step exchange (every --sync with every --compressor, one row each):
  gradzip simulate --model bert-large --nodes 4 --gpus-per-node 1 --tokens-per-second 5600 \\
      --compressor none --compressor fp16 --sync step --sync diloco:every=100
Goodput of DiLoCo through failures (a failure a minute in the cluster; the model: the docstring of
gradzip/cluster/goodput.py):
  gradzip simulate --model bert-tiny --nodes 4 --gpus-per-node 1 --inter-bandwidth 100mbit \\
      --tokens-per-second 5600 --compressor topk:ratio=0.01,ef=true --sync diloco:every=32 \\
      --failures-per-minute 1 --recovery 20s --min-replicas 3
Sharded training beside DDP (--fsdp or --hsdp, one row each per compressor, with per-GPU memory;
the model: the docstring of gradzip/cluster/sharded.py):
  gradzip simulate --model bert-large --nodes 8 --gpus-per-node 4 --tokens-per-second 5600 \\
      --compressor fp16 --compressor topk:ratio=0.01,ef=true --hsdp
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    a = parser.add_argument
    a("--model", default="bert-large", help=f"one of {', '.join(MODELS)} (default bert-large)")
    a("--vocab-size", type=int, default=None, help="override the model's vocabulary size")
    a("--nodes", type=int, default=8, help="number of nodes (default 8)")
    a("--gpus-per-node", type=int, default=4, help="GPUs (workers) per node (default 4)")
    a("--inter-bandwidth", default="10gbit", help="network bandwidth per node (NIC), e.g. 10gbit (default)")
    a("--intra-bandwidth", default="100gbit", help="GPU-to-GPU bandwidth inside a node (default 100gbit)")
    a("--latency", default="50us", help="α per message between nodes (default 50us)")
    a("--intra-latency", default="5us", help="α per message inside a node (default 5us)")
    a("--algorithm", default="hierarchical", choices=ALGORITHMS,
      help="the collectives' algorithm, NCCL-style hierarchical or flat ring (default hierarchical)")
    a("--hierarchical", action="store_true",
      help="the engine's hierarchical exchange (gradzip train --hierarchical): reduce in full precision inside "
           "each node, compress only between nodes")
    a("--link-efficiency", type=float, default=1.0,
      help="fraction of the bandwidth that carries payload (default 1; TCP over Ethernet MTU 1500: 0.956)")
    a("--tokens-per-second", type=float, required=True, help="one GPU's training throughput alone (tokens/s)")
    a("--batch-size", type=int, default=32, help="sequences per GPU per micro-batch (default 32)")
    a("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    a("--accumulation", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    a("--compressor", action="append", default=None, metavar="SPEC",
      help="compressor spec; repeat for a table (default none)")
    a("--overlap", type=float, default=0.0,
      help="fraction of the last backward that hides communication, 0..1 (default 0)")
    a("--backward-fraction", type=float, default=2 / 3, help="backward share of compute time (default 2/3)")
    a("--bucket-cap-mb", type=float, default=25.0, help="engine bucket size in MiB (default 25)")
    a("--min-compress-numel", type=int, default=1024, help="smaller tensors are sent uncompressed (default 1024)")
    a("--grad-dtype", default="fp32", choices=list(DTYPES), help="gradient dtype (default fp32)")
    a("--encode-cost", default=None, metavar="FILE.json|S",
      help="`gradzip bench compress --json` output, or seconds per element for encode+decode (default 0)")
    a("--aggregate-cost", default=None, metavar="S",
      help="seconds per element per other rank to decode+sum allgathered payloads (default: from the JSON, else 0)")
    a("--tokens", type=float, default=None, help="tokens per epoch, for the days-to-train column (e.g. 16.75e9)")
    a("--epochs", type=float, default=1.0, help="epochs over --tokens (default 1)")
    a("--sync", action="append", default=None, metavar="SPEC",
      help="how often workers synchronise: step (default), diloco:every=H[,fragments=P,delay=T,...], "
           "sparseloco[:every=30,...] (its own codec: no --compressor) or "
           "localsgd:every=H; repeat for a table (every --sync with every --compressor)")
    a("--memory-bandwidth", default=None, metavar="BW",
      help="GPU memory bandwidth (e.g. 320GB/s) for the outer step's local work of diloco/localsgd "
           "(default: not charged)")
    a("--fsdp", action="store_true",
      help="also model FSDP (parameters, gradients and optimizer state sharded over all GPUs): a row per "
           "compressor beside DDP's, with per-GPU memory columns")
    a("--hsdp", action="store_true",
      help="also model HSDP (sharded inside each node, replicated across nodes; needs >= 2 GPUs per node)")
    a("--mtbf", default=None, metavar="TIME",
      help="mean time between failures of one replica (each worker is one), e.g. 30min: adds goodput and "
           "participation to the outer --sync rows (model: gradzip/cluster/goodput.py)")
    a("--failures-per-minute", type=float, default=None, metavar="F",
      help="failures a minute in the whole cluster, instead of --mtbf (an MTBF of 60 * replicas / F s each)")
    a("--recovery", default=None, metavar="TIME",
      help="a failed replica's restart time, before its heal from a live peer (default 0s; needs a failure rate)")
    a("--min-replicas", type=int, default=None, metavar="M",
      help="replicas a sync needs to commit, else the round is retried (default 1; needs a failure rate)")
    a("--json", action="store_true", help="print JSON instead of a table")


def _build(args: argparse.Namespace) -> tuple[Workload, Cluster]:
    if args.model not in MODELS:
        raise GradzipError(f"unknown model {args.model!r}; choose one of {', '.join(MODELS)}")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise GradzipError(f"--vocab-size must be >= 1, got {args.vocab_size}")
    if args.tokens is not None and not args.tokens > 0 or not args.epochs > 0:
        raise GradzipError("--tokens and --epochs must be positive")
    work = Workload(args.model, args.tokens_per_second, args.batch_size, args.seq_len, args.accumulation,
                    args.overlap, args.backward_fraction, args.bucket_cap_mb, args.min_compress_numel,
                    args.grad_dtype, args.vocab_size, args.hierarchical)
    cl = Cluster(args.nodes, args.gpus_per_node, _bandwidth(args.inter_bandwidth, "--inter-bandwidth"),
                 _bandwidth(args.intra_bandwidth, "--intra-bandwidth"), parse_latency(args.latency),
                 parse_latency(args.intra_latency), args.algorithm, args.link_efficiency)
    return work, cl


def _bandwidth(text: str, flag: str) -> float:
    if str(text).strip().startswith("-"):
        raise GradzipError(f"{flag} must be positive, got {text!r} (e.g. 10gbit)")
    try:
        return parse_bandwidth(text)
    except GradzipError as e:
        raise GradzipError(f"{flag}: {e}") from None


def _faults(args: argparse.Namespace, cl: Cluster, syncs: list) -> Faults | None:
    """The failure process of the flags, or None without them; one-line errors for what the
    goodput model cannot take."""
    given = [flag for flag, v in (("--mtbf", args.mtbf), ("--failures-per-minute", args.failures_per_minute),
                                  ("--recovery", args.recovery), ("--min-replicas", args.min_replicas))
             if v is not None]
    if not given:
        return None
    if not any(sync.outer for _, sync in syncs):
        raise GradzipError(f"{given[0]} models the rounds of an outer sync: add --sync diloco:every=H "
                           "(or localsgd:every=H)")
    if args.mtbf is not None and args.failures_per_minute is not None:
        raise GradzipError("give one of --mtbf (per replica) and --failures-per-minute (the whole cluster), not both")
    if args.mtbf is None and args.failures_per_minute is None:
        raise GradzipError(f"{given[0]} needs a failure rate: add --mtbf TIME (per replica, e.g. 30min) or "
                           "--failures-per-minute F (the whole cluster)")
    if args.mtbf is not None:
        mtbf = _duration(args.mtbf, "--mtbf")
        if mtbf == 0:
            raise GradzipError(f"--mtbf must be positive (e.g. 60s, 30min), got {args.mtbf!r}")
    else:
        mtbf = mtbf_from_rate(args.failures_per_minute, cl.workers)
    faults = Faults(mtbf, 0.0 if args.recovery is None else _duration(args.recovery, "--recovery"),
                    1 if args.min_replicas is None else args.min_replicas)
    if faults.min_replicas > cl.workers:
        raise GradzipError(f"--min-replicas {faults.min_replicas} is more than the {cl.workers} replicas "
                           f"(nodes x gpus-per-node); give at most {cl.workers}")
    return faults


def _duration(text: str, flag: str) -> float:
    if str(text).strip().startswith("-"):
        raise GradzipError(f"{flag} must be positive (e.g. 60s, 30min), got {text!r}"
                           if flag == "--mtbf" else f"{flag} must not be negative (e.g. 20s), got {text!r}")
    try:
        value = parse_duration(text)
    except GradzipError as e:
        raise GradzipError(f"{flag}: {e}") from None
    if not math.isfinite(value):
        raise GradzipError(f"{flag} must be finite, got {text!r}")
    return value


def _sharded_mode(args: argparse.Namespace, cl: Cluster, syncs: list) -> str | None:
    """The sharded mode asked for (``fsdp``, ``hsdp``) or None; one-line errors for what it cannot model."""
    if args.fsdp and args.hsdp:
        raise GradzipError("--fsdp and --hsdp are two layouts of the same model; give one (each prints DDP beside it)")
    mode = "fsdp" if args.fsdp else "hsdp" if args.hsdp else None
    if mode is None:
        return None
    if args.hierarchical:
        raise GradzipError(f"--{mode} has its own exchange; --hierarchical is the DDP engine's, drop it")
    if args.memory_bandwidth is not None:
        raise GradzipError(f"--memory-bandwidth is for --sync diloco/localsgd, not --{mode}")
    sharded.check_mode(mode, cl, any(sync.outer for _, sync in syncs))
    return mode


def run(args: argparse.Namespace) -> int:
    work, cl = _build(args)
    specs = args.compressor or ["none"]
    syncs = [(text.strip(), parse_sync(text)) for text in args.sync or ["step"]]
    faults = _faults(args, cl, syncs)
    mode = _sharded_mode(args, cl, syncs)
    autos = [parse_auto(s) for s in specs if is_auto(s)]
    if autos:
        if mode is not None or args.sync is not None:
            raise GradzipError("--compressor auto plans the per-step DDP exchange; drop --fsdp/--hsdp/--sync for it")
        return run_auto(args, work, cl, autos)
    if mode is not None:
        return run_sharded(args, mode, work, cl, specs)
    memory = None if args.memory_bandwidth is None else _bandwidth(args.memory_bandwidth, "--memory-bandwidth")
    # every --sync with every --compressor; a mode with its own codec (sparseloco) sends that instead
    cells = [(exchanged_spec(spec, sync), text, sync) for text, sync in syncs for spec in specs]
    codecs = {spec: codec_for(spec, args.encode_cost, args.aggregate_cost) for spec, _, _ in cells}
    rows = [(spec, text, predict(spec, work, cl, codecs[spec], args.tokens, args.epochs, sync, memory))
            for spec, text, sync in cells]
    goodputs = None if faults is None else [predict_goodput(p, sync, cl, faults)
                                            for (_, _, sync), (_, _, p) in zip(cells, rows)]
    if args.json:
        results = [dict(asdict(p), codec=asdict(codecs[spec])) for spec, _, p in rows]
        for r, g, (_, _, p) in zip(results, goodputs or [], rows):
            r.update(json_fields(g, p.tokens_per_s))
        json.dump({"cluster": asdict(cl), "workload": asdict(work), "results": results}, sys.stdout, indent=1)
        print()
        return 0
    print_table(args, work, cl, rows, goodputs)
    return 0


def print_table(args: argparse.Namespace, work: Workload, cl: Cluster,
                rows: list[tuple[str, str, Prediction]], goodputs: list[Goodput | None] | None = None) -> None:
    """The table of ``gradzip simulate``: one row per (compressor, --sync), under a line that says
    what was modelled; with ``goodputs`` (the failure flags), the goodput model's columns of each row."""
    p0, with_sync = rows[0][2], args.sync is not None  # without --sync: the table as before --sync existed
    print(f"{work.model}: {p0.params / 1e6:.1f} M parameters; {cl.nodes} nodes x {cl.gpus_per_node} GPUs = "
          f"{cl.workers} workers; {args.inter_bandwidth} between nodes, {args.intra_bandwidth} inside; "
          f"{cl.algorithm} collectives{'; hierarchical exchange' if work.hierarchical else ''}; "
          f"{work.tokens_per_step} tokens per GPU per step at {work.tokens_per_second:g} tokens/s")
    width, sw = max(12, *(len(r[0]) for r in rows)), max(4, *(len(r[1]) for r in rows))
    head = (f"{'compressor':<{width}}" + (f" {'sync':<{sw}}" if with_sync else "")
            + f" {'exchange':>9} {'MB/GPU':>8} {'ratio':>7} {'compute':>8} {'compress':>9} "
            f"{'comm':>8} {'exposed':>8} {'step':>8} {'tokens/s':>10} {'util.' if with_sync else 'eff.':>6}"
            + (f" {'MB/sync':>8} {'sync+':>9}" if with_sync else "")
            + (f" {'round':>8} {'absent':>8} {'commit':>7} {'partic.':>7} {'goodput':>7}" if goodputs else "")
            + (f" {'days':>7}" if args.tokens else ""))
    print(head)
    for i, (spec, text, p) in enumerate(rows):
        line = (f"{spec:<{width}}" + (f" {text:<{sw}}" if with_sync else "")
                + f" {p.exchange:>9} {p.payload_bytes / 1e6:>8.2f} {p.compression_ratio:>6.1f}x "
                f"{p.compute_s * 1e3:>6.0f}ms {p.compress_s * 1e3:>7.0f}ms {p.comm_s * 1e3:>6.0f}ms "
                f"{p.exposed_comm_s * 1e3:>6.0f}ms {p.step_s * 1e3:>6.0f}ms {p.tokens_per_s:>10,.0f} "
                f"{p.scaling_efficiency:>5.0%}"
                + (f" {p.bytes_per_sync / 1e6:>8.2f} {p.sync_exposed_s * 1e3:>7.0f}ms" if with_sync else "")
                + (_goodput_columns(goodputs[i]) if goodputs else ""))
        print(line + (f" {p.days:>7.1f}" if p.days is not None else ""))
    if with_sync:
        print("Per step (diloco, localsgd: means over a period of H steps); util. = compute / step.\n"
              "MB/sync: one exchange (one fragment); sync+: what one period's exchanges add to its H steps.")
    if goodputs:
        g = next(g for g in goodputs if g is not None)
        mtbf = "no failures" if math.isinf(g.mtbf_s) else (
            f"MTBF {g.mtbf_s:g} s per replica, {60 * g.replicas / g.mtbf_s:.3g}/min in the cluster")
        print(f"Failures: {mtbf}; a failed replica restarts in {g.recovery_s:g} s, heals from a live peer and "
              f"rejoins at the next round; a sync commits with >= {g.min_replicas} of {g.replicas}.\n"
              "round: H steps and their sync; absent: restart + heal; commit: P(a round commits); partic.: mean "
              "fraction of the\nreplicas in a committed sync; goodput: committed tokens / the fault-free run's"
              + (" (days: fault-free)." if args.tokens else "."))


def _goodput_columns(g: Goodput | None) -> str:
    if g is None:  # per-step rows: no rounds to model
        return f" {'-':>8} {'-':>8} {'-':>7} {'-':>7} {'-':>7}"
    return (f" {_seconds(g.round_s):>8} {_seconds(g.absent_s):>8} {g.commit_probability:>7.1%} "
            f"{g.participation:>7.1%} {g.goodput:>7.1%}")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.0f}ms" if s < 1 else f"{s:.1f}s" if s < 1000 else f"{s:.0f}s"


# ------------------------------------------------------------------------------ --compressor auto
def run_auto(args: argparse.Namespace, work: Workload, cl: Cluster, autos: list[AutoSpec]) -> int:
    """Each auto spec's plan per bucket, its predicted step, and each allowed candidate alone beside it."""
    out = []
    for auto in autos:
        codecs = {c: codec_for(c, args.encode_cost, args.aggregate_cost) for c in ("none", *auto.allowed)}
        p = plan(auto, work, cl, codecs)
        out.append({"spec": auto.spec, "choice": p.choice, "numels": p.numels, "step_s": p.step_s,
                    "comm_s": p.comm_s, "efficiency": p.compute_s / p.step_s, "fixed_step_s": p.fixed,
                    "none_is_best": p.none_is_best})
    if args.json:
        json.dump({"cluster": asdict(cl), "workload": asdict(work), "auto": out}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{work.model}: {cl.nodes} nodes x {cl.gpus_per_node} GPUs = {cl.workers} workers; {args.inter_bandwidth} "
          f"between nodes, {args.intra_bandwidth} inside; {work.tokens_per_step} tokens per GPU per step at "
          f"{work.tokens_per_second:g} tokens/s")
    for row in out:
        print(f"\n{row['spec']}: plan per bucket (the engine's buckets, in launch order; runs of one choice)")
        print(f"  {'buckets':>9} {'elements':>13}  candidate")
        i = 0
        while i < len(row["choice"]):
            j = i
            while j + 1 < len(row["choice"]) and row["choice"][j + 1] == row["choice"][i]:
                j += 1
            span = f"{i}" if i == j else f"{i}-{j}"
            print(f"  {span:>9} {sum(row['numels'][i:j + 1]):>13,}  {row['choice'][i]}")
            i = j + 1
        compute = row["step_s"] * row["efficiency"]
        print(f"  predicted step {row['step_s'] * 1e3:.0f} ms (exposed comm {row['comm_s'] * 1e3:.0f} ms), "
              f"efficiency {row['efficiency']:.0%}; each candidate alone:")
        for c, t in row["fixed_step_s"].items():
            print(f"    {c:<28} {t * 1e3:>8.0f} ms  {compute / t:>4.0%}")
        if row["none_is_best"]:
            print("  no candidate is predicted faster than none on this link: auto sends every bucket uncompressed")
    return 0


# ------------------------------------------------------------------------------ --fsdp, --hsdp
def run_sharded(args: argparse.Namespace, mode: str, work: Workload, cl: Cluster, specs: list[str]) -> int:
    """DDP and ``mode`` side by side, one row each per compressor, with per-GPU memory."""
    codecs = {spec: codec_for(spec, args.encode_cost, args.aggregate_cost) for spec in specs}
    rows = []
    for spec in specs:
        comp = create(spec)
        ddp = predict(spec, work, cl, codecs[spec], args.tokens, args.epochs)
        own = sharded.predict_sharded(spec, mode, work, cl, codecs[spec], args.tokens, args.epochs)
        rows += [(spec, m, p, sharded.memory(m, comp, work, cl)) for m, p in (("ddp", ddp), (mode, own))]
    if args.json:
        json.dump({"cluster": asdict(cl), "workload": asdict(work),
                   "results": [dict(asdict(p), mode=m, memory_bytes=asdict(mem), codec=asdict(codecs[spec]))
                               for spec, m, p, mem in rows]}, sys.stdout, indent=1)
        print()
        return 0
    p0 = rows[0][2]
    print(f"{work.model}: {p0.params / 1e6:.1f} M parameters; {cl.nodes} nodes x {cl.gpus_per_node} GPUs = "
          f"{cl.workers} workers; {args.inter_bandwidth} between nodes, {args.intra_bandwidth} inside; "
          f"{cl.algorithm} collectives; {work.tokens_per_step} tokens per GPU per step at "
          f"{work.tokens_per_second:g} tokens/s; ddp beside {mode}")
    width = max(12, *(len(r[0]) for r in rows))
    print(f"{'compressor':<{width}} {'mode':<4} {'exchange':>9} {'sent_MB':>8} {'inter_MB':>8} {'compute':>8} "
          f"{'compress':>9} {'comm':>8} {'exposed':>8} {'step':>8} {'tokens/s':>10} {'eff.':>5} "
          f"{'params':>6} {'grads':>6} {'optim':>6} {'EF':>6}" + (f" {'days':>7}" if args.tokens else ""))
    for spec, m, p, mem in rows:
        gb = " ".join(f"{v / sharded.GB:>6.2f}" for v in (mem.params, mem.grads, mem.optim, mem.error))
        print(f"{spec:<{width}} {m:<4} {p.exchange:>9} {p.sent_bytes / 1e6:>8.1f} {p.inter_bytes / 1e6:>8.1f} "
              f"{p.compute_s * 1e3:>6.0f}ms {p.compress_s * 1e3:>7.0f}ms {p.comm_s * 1e3:>6.0f}ms "
              f"{p.exposed_comm_s * 1e3:>6.0f}ms {p.step_s * 1e3:>6.0f}ms {p.tokens_per_s:>10,.0f} "
              f"{p.scaling_efficiency:>5.0%} {gb}" + (f" {p.days:>7.1f}" if p.days is not None else ""))
    print("Per GPU per step: MB sent (flat-ring count) and of it MB crossing nodes; memory per GPU in GB: "
          "fp32 parameters,\ngradients, Adam's two fp32 moments, error-feedback memory (activations not counted).")
    return 0
