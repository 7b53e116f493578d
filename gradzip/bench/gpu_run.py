"""``python -m gradzip.bench.gpu_run OUT``: the GPU evidence, as one prepared command for a device session.

Written for one CUDA GPU (an NVIDIA H200) and a session that allows one command of at most 10
minutes: everything runs in order inside ``--budget`` seconds (default 540). Each step is a child
process with its own time limit; one that runs over is killed with its process group, one that
fails is recorded, and the next step runs either way:

1. ``prepare``: builds the built-in corpus (or ``--corpus``), and the tokenizer and examples of
   every (model, sequence length) the later steps train (:data:`PREPARE`), so no later limit pays
   for them.
2. ``check``: ``python -m gradzip.bench.gpu_check`` (NCCL collectives, every compressor on CUDA
   against the CPU, ``gradzip train --device cuda --precision fp16`` with a NaN injected, ``--backend
   nccl``, and every compressor's time against a memcpy at 2^22 elements).
3. ``compress-targets``: ``gradzip bench compress --device cuda`` on a gradient the size of
   BERT-base's (110,106,428 fp32 elements) against a device-to-device copy of the same bytes, for
   the compressors the issue sets targets for (:data:`ISSUE_TARGETS`: fp16/bf16 <= 2x the copy,
   1-bit + EF <= 4x, top-k 1% + EF <= 10x, also shown against ``torch.topk`` alone, PowerSGD rank 4
   + EF <= 1.5x its matmuls), judged pass/miss in the summary (:func:`target_rows`).
4. ``train-bert-base`` and ``train-bert-large``: ``gradzip bench train --device cuda``, one GPU's MLM
   tokens/s at fp16 and bf16, batch 32 x 128 tokens.
5. ``evidence-calibrate``, ``evidence`` and ``evidence-plot``: the shipped spec ``gpu-evidence``
   (4 sim workers on the GPU; held-out MLM loss and masked-token accuracy against steps and bytes).
   Its step count is an estimate, so a copy of it first runs ``--calibrate-steps`` steps of every
   cell; the time per step read from each cell's ``metrics.jsonl`` (``host_s``) sizes the real run
   (:func:`scaled_steps`) to the budget left, a multiple of 64 steps (the DiLoCo cell's H).

What comes back from a device session is at most 8 files, no deeper than two folders, so OUT holds:
``summary.md`` (also printed at the end), ``summary.json`` (rewritten after every step, so a run cut
short keeps what it measured), ``gpu_run.log`` (every step's output), ``gpu_run.tar.gz`` (the whole
work directory: each step's JSON, the sweep with its figures, tables and metrics; checkpoints and
files over 4 MiB left out) and the three evidence figures as PNG.

``--cpu`` runs a tiny version of every step on the CPU (gloo for NCCL; gpu_check's collectives and
compressors, its CPU train checks being tests/test_bench.py's; bert-tiny at fp32 and bf16; a
65,536-element gradient; the evidence spec on bert-tiny with DiLoCo every 8 steps) in about 3
minutes on 2 cores, to test this script where there is no GPU. Exit status: 0 when every step
finished with status 0, else 1 (a missed speed target is reported, not an error); 2 for bad
arguments or no CUDA without ``--cpu``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from gradzip.models.bert import bert_config, num_parameters

SPEC = Path(__file__).resolve().parents[1] / "experiments" / "specs" / "gpu-evidence.toml"
FIGURES = ("eval_mlm_loss_steps", "eval_mlm_acc_steps", "eval_mlm_loss_bytes")
DILOCO_H = 64
# (label, compressor name, with error feedback, reference, max ratio to it): the issue's speed targets
ISSUE_TARGETS = (("fp16", "fp16", False, "memcpy", 2.0), ("bf16", "bf16", False, "memcpy", 2.0),
                 ("1-bit + EF", "onebit", True, "memcpy", 4.0), ("top-k 1% + EF", "topk", True, "memcpy", 10.0),
                 ("PowerSGD rank 4 + EF", "powersgd", True, "matmul", 1.5))
TARGET_SPECS = ("fp16", "bf16", "onebit:ef=true", "topk:ratio=0.01,ef=true", "powersgd:rank=4,ef=true")
# step -> its time limit (s) on cuda and on cpu; the evidence sweep gets the budget left
LIMITS = {"prepare": (150, 90), "check": (120, 60), "compress-targets": (45, 30), "evidence-calibrate": (90, 40),
          "evidence-plot": (30, 30)}
# the (model, sequence length) pairs the steps train, whose tokenizer and examples ``prepare`` builds
PREPARE = {"cuda": "bert-tiny:64,bert-small:128,bert-base:128", "cpu": "bert-tiny:32"}
TRAIN_MODELS = {"cuda": (("bert-base", 75), ("bert-large", 45)), "cpu": (("bert-tiny", 40),)}
RESERVE_S = (45, 15)  # cuda, cpu: kept back from the sweep for the plot step and the packing


def override(text: str, values: dict[str, Any]) -> str:
    """``text`` (a spec's TOML) with each ``key = value`` line of its ``[base]`` table replaced by
    ``values[key]`` (written as TOML: a string, number or bool), or added after ``[base]`` when absent."""
    head, sep, rest = text.partition("\n[base]\n")
    if not sep:
        raise ValueError("the spec has no [base] table")
    body, nxt, tail = rest.partition("\n[")
    for key, value in values.items():
        line = f"{key} = {json.dumps(value)}"
        body, n = re.subn(rf"^{re.escape(key)}\s*=.*$", lambda _m, line=line: line, body, count=1, flags=re.M)
        if not n:
            body = f"{line}\n{body}"
    return head + sep + body + nxt + tail


def step_seconds(metrics: Path, skip: int = 3) -> float | None:
    """Median seconds per training step of one run (``host_s`` deltas after ``skip`` warm-up steps)."""
    if not metrics.is_file():
        return None
    host = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "host_s" in rec and "step" in rec:
            host[rec["step"]] = rec["host_s"]
    steps = sorted(host)[skip:]
    deltas = [host[b] - host[a] for a, b in zip(steps, steps[1:])]
    return statistics.median(deltas) if deltas else None


def scaled_steps(per_step: list[float], fixed_s: float, available_s: float, cap: int, multiple: int = DILOCO_H,
                 overhead: float = 1.15) -> int:
    """Steps per cell so that all cells (``per_step``: each cell's seconds per step) finish within
    ``available_s``: ``fixed_s`` (start-up, model build, evaluations outside the steps, for all
    cells together) plus ``steps * sum(per_step) * overhead`` (held-out evaluations during the run).
    Rounded down to a multiple of ``multiple``; at least ``multiple``, at most ``cap``."""
    per = sum(per_step) * overhead
    n = int((available_s - fixed_s) / per) if per > 0 else cap
    return max(multiple, min(cap, n // multiple * multiple))


class Runner:
    """Runs the steps, each with a time limit inside the budget, logging to ``OUT/gpu_run.log`` and
    recording each step in ``OUT/summary.json`` as it ends."""

    def __init__(self, out: Path, work: Path, budget: float, env: dict[str, str]) -> None:
        self.out, self.work, self.env = out, work, env
        self.deadline = time.monotonic() + budget
        self.log = (out / "gpu_run.log").open("a", encoding="utf-8")
        self.steps: dict[str, dict[str, Any]] = {}
        self.results: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, argv: list[str], limit: float, stdout_to: Path | None = None) -> dict[str, Any]:
        """Run ``argv`` for at most ``limit`` seconds (and never past the budget); its stdout goes to
        ``stdout_to`` when given (a JSON result), everything else to the log and this process's stdout."""
        limit = min(limit, self.left())
        if limit < 5:
            return self.record(name, {"status": "skipped", "detail": "no time left in the budget", "seconds": 0.0})
        self.say(f"\n==> {name} (limit {limit:.0f} s): {' '.join(argv)}")
        t0, killed = time.monotonic(), threading.Event()
        sink = stdout_to.open("w", encoding="utf-8") if stdout_to else None
        proc = subprocess.Popen(argv, stdout=sink or subprocess.PIPE,
                                stderr=subprocess.PIPE if sink else subprocess.STDOUT, text=True, env=self.env,
                                cwd=self.work, start_new_session=True)
        timer = threading.Timer(limit, _kill_group, (proc, killed))
        timer.start()
        tail: deque[str] = deque(maxlen=3)
        stream = proc.stderr if sink else proc.stdout
        assert stream is not None
        for line in stream:
            self.say(f"[{name}] {line.rstrip()}")
            if line.strip():
                tail.append(line.strip())
        rc = proc.wait()
        timer.cancel()
        if sink:
            sink.close()
        status = "timed out" if killed.is_set() else "ok" if rc == 0 else "failed"
        return self.record(name, {"status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
                                  "limit_s": round(limit), "detail": tail[-1][:300] if tail else ""})

    def record(self, name: str, res: dict[str, Any]) -> dict[str, Any]:
        self.steps[name] = res
        self.say(f"<== {name}: {res['status']} ({res['seconds']} s) {res.get('detail', '')}")
        self.save()
        return res

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def save(self) -> None:
        (self.out / "summary.json").write_text(json.dumps({"steps": self.steps, **self.results}, indent=2) + "\n")


def _kill_group(proc: subprocess.Popen[str], killed: threading.Event) -> None:
    """SIGTERM to the step's process group, SIGKILL 5 s later if it is still there."""
    killed.set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _gz(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradzip", *args]


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_checks(r: Runner, cpu: bool, corpus: str | None) -> None:
    """Steps 1-4: the corpus, gpu_check, the compress benchmarks and the train benchmark."""
    dev, i = ("cpu", 1) if cpu else ("cuda", 0)
    corpus_arg = ["--corpus", corpus] if corpus else []
    r.step("prepare", [sys.executable, "-m", "gradzip.bench.gpu_run", "--prepare", PREPARE[dev], *corpus_arg, "-"],
           LIMITS["prepare"][i])
    only = ["--only", "collectives,compressors"] if cpu else []  # its CPU train checks: tests/test_bench.py
    r.step("check", [sys.executable, "-m", "gradzip.bench.gpu_check", "--device", dev, *only, *corpus_arg,
                     "--out", str(r.work / "gpu_check.json")], LIMITS["check"][i])
    r.results["check"] = _load(r.work / "gpu_check.json")
    numel = str(65536 if cpu else num_parameters(bert_config("bert-base")))
    common = ["bench", "compress", "--device", dev, "--numel", numel, "--json", "--stat", "min",
              "--repeat", "1" if cpu else "5"]
    r.step("compress-targets", _gz(*common, "--only", *TARGET_SPECS), LIMITS["compress-targets"][i],
           stdout_to=r.work / "compress_targets.json")
    r.results["targets"] = target_rows(_load(r.work / "compress_targets.json") or [])
    train = ["bench", "train", "--device", dev, "--precision", "fp32,bf16" if cpu else "fp16,bf16", "--loss-steps",
             "0", "--json", *corpus_arg, *(["--batch-size", "4", "--seq-len", "32", "--steps", "3", "--skip", "1"]
                                           if cpu else ["--batch-size", "32", "--seq-len", "128", "--steps", "20",
                                                        "--skip", "5"])]
    rows = []
    for m, limit in TRAIN_MODELS[dev]:
        name = f"train-{m}"
        r.step(name, _gz(*train, "--models", m), limit, stdout_to=r.work / f"{name}.json")
        rows += (_load(r.work / f"{name}.json") or {}).get("throughput", [])
    r.results["train"] = rows
    r.save()


def prepare_data(pairs: str, corpus: str | None) -> None:
    """Build (or load from the cache) the corpus, and the tokenizer and training examples of each
    ``MODEL:SEQ_LEN`` in ``pairs`` (comma-separated; the model's default vocabulary, seed 0), as
    ``gradzip train`` would; prints one line with the time of each."""
    from gradzip.data.pretrain import PretrainData

    for pair in pairs.split(","):
        model, _, seq_len = pair.partition(":")
        t0 = time.monotonic()
        data = PretrainData.build(corpus, seq_len=int(seq_len), vocab_size=bert_config(model).vocab_size, seed=0,
                                  progress=False)
        print(f"{model}, {seq_len} tokens: {data.describe()} ({time.monotonic() - t0:.1f} s)", flush=True)


def target_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets (:data:`ISSUE_TARGETS`) against ``gradzip bench compress`` rows: one
    row per target with the measured ratio and ``meets`` (None when the compressor has no row)."""
    out = []
    for label, name, ef, ref, limit in ISSUE_TARGETS:
        got = next((x for x in rows if x.get("name") == name and ("ef=true" in x.get("spec", "")) == ef), None)
        ratio = got.get(f"ratio_to_{ref}") if got else None
        row = {"target": label, "spec": got["spec"] if got else None, "numel": got.get("numel") if got else None,
               "reference": ref, "limit": limit,
               "ratio": ratio, "meets": None if ratio is None else ratio <= limit,
               "error": got.get("error") if got else "no row"}
        if got and "ratio_to_torch_topk" in got:
            row["ratio_to_torch_topk"] = got["ratio_to_torch_topk"]
        out.append(row)
    return out


def evidence_overrides(cpu: bool, corpus: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """[base] values and grid text replacements that make the spec's run for this machine: on the
    CPU a tiny bert-tiny version (DiLoCo every 8 steps instead of 64)."""
    base: dict[str, Any] = {"corpus": corpus} if corpus else {}
    if not cpu:
        return base, {}
    base.update(model="bert-tiny", device="cpu", batch_size=4, seq_len=32, warmup=2, eval_every=8, eval_batches=2)
    return base, {"diloco:every=64": "diloco:every=8"}


def run_evidence(r: Runner, cpu: bool, corpus: str | None, calibrate_steps: int) -> None:
    """Step 5: calibrate the gpu-evidence spec, run it at the scaled step count, draw its figures."""
    base, grid = evidence_overrides(cpu, corpus)
    text = SPEC.read_text(encoding="utf-8")
    for old, new in grid.items():
        text = text.replace(old, new)
    spec_steps = int(re.search(r"^steps\s*=\s*(\d+)", text, re.M).group(1))  # type: ignore[union-attr]
    multiple = 8 if cpu else DILOCO_H
    cap = 32 if cpu else spec_steps
    in_process = ["--in-process"] if cpu else []  # on the GPU each cell in its own process, as gradzip run does
    calib_spec = r.work / "gpu-evidence-calibrate.toml"
    calib_spec.write_text(override(text, {**base, "steps": calibrate_steps, "eval_every": calibrate_steps,
                                          "warmup": 1}))
    t0 = time.monotonic()
    res = r.step("evidence-calibrate", _gz("sweep", str(calib_spec), "--out", str(r.work / "calibrate"),
                                           "--no-plot", *in_process), LIMITS["evidence-calibrate"][1 if cpu else 0])
    wall = time.monotonic() - t0
    cells = sorted(p for p in (r.work / "calibrate").glob("*/") if (p / "metrics.jsonl").is_file())
    per = {c.name: step_seconds(c / "metrics.jsonl", skip=min(3, calibrate_steps // 3)) for c in cells}
    times = [t for t in per.values() if t]
    available = r.left() - RESERVE_S[1 if cpu else 0]
    if res["status"] == "ok" and times:
        fixed = max(0.0, wall - calibrate_steps * sum(times))
        steps = scaled_steps(times, fixed, available, cap, multiple)
        why = f"calibrated: {len(times)} cells, {1e3 * sum(times):.0f} ms per step of all cells, {fixed:.0f} s fixed"
    else:  # no calibration: the spec's estimate, cut to what is left at a guess of 0.3 s per step of all cells
        steps = scaled_steps([0.3], 60.0, available, cap, multiple)
        why = f"calibration {res['status']}: steps from a guess of 0.3 s per step of all cells"
    r.results["evidence"] = {"calibration_s_per_step": per, "steps": steps, "spec_steps": spec_steps, "why": why,
                             "available_s": round(available)}
    r.say(f"evidence: {steps} steps per cell ({why}; {available:.0f} s available)")
    run_spec = r.work / "gpu-evidence.toml"
    run_spec.write_text(override(text, {**base, "steps": steps}))
    sweep = r.work / "evidence"
    r.step("evidence", _gz("sweep", str(run_spec), "--out", str(sweep), *in_process), max(0.0, available))
    if sweep.is_dir() and not all((sweep / "figures" / f"{f}.png").is_file() for f in FIGURES):
        r.step("evidence-plot", _gz("plot", str(sweep)), LIMITS["evidence-plot"][1 if cpu else 0])
    r.results["evidence"]["cells"] = {p.name: {k: s.get(k) for k in ("steps", "final_eval_mlm_loss",
                                                                     "final_eval_mlm_acc", "bytes_total", "host_s")}
                                      for p in sorted(sweep.glob("*/")) if (s := _load(p / "summary.json"))}
    r.save()


def summary_md(r: Runner, device: str) -> str:
    """The end-of-run report: every step's status, the issue's targets, throughput and the evidence."""
    lines = [f"# gradzip GPU run on {device}", "", "| step | status | seconds | limit | detail |",
             "|---|---|---|---|---|"]
    lines += [f"| {k} | {v['status']} | {v['seconds']} | {v.get('limit_s', '')} | {v.get('detail', '')[:120]} |"
              for k, v in r.steps.items()]
    check = r.results.get("check") or {}
    if check.get("checks"):
        lines += ["", "## gpu_check", ""] + [f"- {k}: {'ok' if v['ok'] else 'FAILED'} ({v['detail'][:200]})"
                                             for k, v in check["checks"].items()]
    numel = next((t["numel"] for t in r.results.get("targets", []) if t.get("numel")), None)
    lines += ["", f"## bench compress: the issue's targets ({numel or '?'} fp32 elements on {device})", "",
              "| target | spec | measured | limit | pass/miss | vs torch.topk |", "|---|---|---|---|---|---|"]
    for t in r.results.get("targets", []):
        got = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x {t['reference']}"
        verdict = "n/a" if t["meets"] is None else "pass" if t["meets"] else "MISS"
        topk = f"{t['ratio_to_torch_topk']:.2f}x" if "ratio_to_torch_topk" in t else ""
        lines.append(f"| {t['target']} | {t['spec']} | {got} | <= {t['limit']:g}x {t['reference']} | {verdict} "
                     f"| {topk} |")
    lines += ["", f"## bench train (one {device}, MLM tokens/s)", "",
              "| model | precision | batch x seq | ms/step | tokens/s |", "|---|---|---|---|---|"]
    lines += [f"| {x['model']} | {x['precision']} | {x['batch_size']} x {x['seq_len']} | {x['ms_per_step']:.1f} "
              f"| {x['tokens_per_s']:,.0f} |" for x in r.results.get("train", [])]
    ev = r.results.get("evidence")
    if ev:
        lines += ["", f"## gpu-evidence: {ev['steps']} steps per cell ({ev['why']})", "",
                  "| cell | steps | eval MLM loss | eval MLM acc | bytes sent | host s |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {c['steps']} | {_num(c['final_eval_mlm_loss'])} | {_num(c['final_eval_mlm_acc'])} | "
                  f"{c['bytes_total']} | {_num(c['host_s'])} |" for k, c in ev.get("cells", {}).items()]
    return "\n".join(lines) + "\n"


def _num(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, int | float) else str(x)


def pack(r: Runner) -> None:
    """``OUT/gpu_run.tar.gz`` of the work directory (no checkpoints, nothing over 4 MiB) and the
    evidence figures as PNG beside it."""
    def small(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.isfile() and (info.size > 4 << 20 or info.name.endswith((".pt", ".safetensors"))):
            return None
        return info

    with tarfile.open(r.out / "gpu_run.tar.gz", "w:gz") as tar:
        tar.add(r.work, arcname="gpu_run", filter=small)
    for f in FIGURES:
        png = r.work / "evidence" / "figures" / f"{f}.png"
        if png.is_file():
            shutil.copyfile(png, r.out / f"{f}.png")


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, run the steps, write the summary and pack OUT; the exit status as above."""
    p = argparse.ArgumentParser(prog="python -m gradzip.bench.gpu_run", description=__doc__.splitlines()[0])
    p.add_argument("out", metavar="OUT", help="folder for the results (at most 8 files: see the module docstring)")
    p.add_argument("--cpu", action="store_true", help="a tiny version of everything on the CPU (tests this script)")
    p.add_argument("--budget", type=float, default=None, help="seconds for everything (default: 540, --cpu 180)")
    p.add_argument("--only", default="checks,evidence", help="comma-separated: checks (steps 1-4), evidence (step 5)")
    p.add_argument("--corpus", default=None, help="training corpus (default: the built-in one)")
    p.add_argument("--calibrate-steps", type=int, default=None, help="steps of the calibration run (default: 16, "
                   "--cpu 6)")
    p.add_argument("--work", default=None, help="work directory (default: a new temporary one, kept)")
    p.add_argument("--prepare", help=argparse.SUPPRESS)  # the prepare step's child: MODEL:SEQ_LEN,...
    args = p.parse_args(argv)
    if args.prepare:
        prepare_data(args.prepare, args.corpus)
        return 0
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if not only or only - {"checks", "evidence"}:
        print(f"gpu_run: --only takes checks and/or evidence, not {args.only!r}", file=sys.stderr)
        return 2
    import torch  # after parsing: --help needs no torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_run: no CUDA device here; run it on a GPU machine, or --cpu to test the script", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="gradzip-gpu-run-"))
    work.mkdir(parents=True, exist_ok=True)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GRADZIP_NO_PROGRESS": "1",
           "PYTHONPATH": os.pathsep.join(x for x in (repo, os.environ.get("PYTHONPATH")) if x)}
    r = Runner(out, work, args.budget or (180.0 if args.cpu else 540.0), env)
    device = "cpu" if args.cpu else torch.cuda.get_device_name()
    r.results.update(device=device, torch=torch.__version__, work=str(work), budget_s=args.budget)
    r.say(f"gradzip GPU run on {device} (torch {torch.__version__}): work directory {work}, results in {out}")
    if "checks" in only:
        run_checks(r, args.cpu, args.corpus)
    if "evidence" in only:
        run_evidence(r, args.cpu, args.corpus, args.calibrate_steps or (6 if args.cpu else 16))
    text = summary_md(r, device)
    (out / "summary.md").write_text(text)
    r.say("\n" + text)
    pack(r)
    failed = [k for k, v in r.steps.items() if v["status"] != "ok"]
    r.say(f"gpu_run: {len(r.steps) - len(failed)}/{len(r.steps)} steps ok" + (f"; not ok: {', '.join(failed)}"
                                                                                 if failed else "") + f" -> {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
