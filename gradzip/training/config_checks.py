"""Checks of a ``gradzip train`` configuration that span several settings: sharded training
(``--fsdp``/``--hsdp``), ``--compressor auto``, a generated corpus and the link (``--bandwidth``, ``--netem``,
``--netem-trace``). Called by :meth:`TrainConfig.validate`; every failure is one line."""

from __future__ import annotations

from typing import Any

from gradzip.compress.ef import ErrorFeedback
from gradzip.compress.registry import create
from gradzip.data.hmm import HMMSpec, is_generated
from gradzip.engine.modes import sharded_outer
from gradzip.errors import GradzipError, SpecError
from gradzip.netem.spec import UNSHAPED, parse_netem
from gradzip.netem.trace import read_trace, resolve_trace
from gradzip.plan.auto import parse_auto
from gradzip.units import parse_bandwidth

SHARDINGS = ("none", "fsdp", "hsdp")


def _pre(source: str) -> str:
    return f"{source}: " if source else ""


def _flat_memory(comp: Any) -> bool:
    """The compressor keeps a flat error memory (error feedback, not per matrix)."""
    return isinstance(comp, ErrorFeedback) and not comp.per_tensor


def check_generated(cfg: Any, source: str) -> None:
    """``--corpus hmm[:options]`` (a generated language): its options, and no ``--tokenizer`` or
    ``--whole-word-masking``."""
    if not is_generated(cfg.corpus):
        return
    if cfg.whole_word_masking:
        raise GradzipError(f"{_pre(source)}--whole-word-masking: a generated language (--corpus hmm) has one token "
                           "per word, no word pieces to mask together; drop --whole-word-masking")
    try:
        HMMSpec.parse(cfg.corpus)
    except GradzipError as e:
        raise GradzipError(f"{_pre(source)}--corpus {e}") from None
    if cfg.tokenizer:
        raise GradzipError(f"{_pre(source)}--tokenizer: a generated language (--corpus hmm) brings its own "
                           "vocabulary; drop --tokenizer")


def check_auto(cfg: Any, source: str) -> None:
    """``--compressor auto``: its spec, and the modes it plans for (the per-step exchange, flat or
    hierarchical)."""
    try:
        parse_auto(cfg.compressor)
    except SpecError as e:
        raise GradzipError(f"{_pre(source)}--compressor: {e}") from None
    clash = ("--exchange (each candidate brings its own)" if cfg.exchange is not None else
             f"--sync {cfg.sync}" if cfg.sync_spec.outer else
             f"--{cfg.sharding}" if cfg.sharding != "none" else
             f"--optimizer {cfg.optimizer}" if cfg.optimizer.startswith("onebit-") or cfg.optimizer == "demo"
             else None)
    if clash:
        raise GradzipError(f"{_pre(source)}--compressor auto plans the per-step exchange of plain data-parallel "
                           f"training; it does not combine with {clash}")


def check_sharding(cfg: Any, source: str) -> None:
    """``--fsdp``/``--hsdp``: the combinations sharded training can honour (the node size is checked
    against the world size at start-up, :func:`gradzip.training.sharding.ranks_per_node`)."""
    if cfg.sharding not in SHARDINGS:
        raise GradzipError(f"{_pre(source)}sharding must be one of {', '.join(SHARDINGS)}, got {cfg.sharding!r}")
    if cfg.ef_dtype not in ("fp32", "bf16"):
        raise GradzipError(f"{_pre(source)}--ef-dtype must be fp32 or bf16, got {cfg.ef_dtype!r}")
    if cfg.sharding == "none":
        if cfg.ef_dtype != "fp32":
            own = (f"; --sync sparseloco keeps its memory in {cfg.ef_dtype} with --sync "
                   f"sparseloco:ef_dtype={cfg.ef_dtype}" if cfg.sync_spec.mode == "sparseloco" else "")
            raise GradzipError(f"{_pre(source)}--ef-dtype {cfg.ef_dtype} applies to --fsdp and --hsdp only{own}")
        return
    flag, why = f"--{cfg.sharding}", ""
    if cfg.backend not in ("gloo", "nccl"):
        why = (f"needs --backend gloo or nccl (FSDP2 runs on torch.distributed, one process per rank), "
               f"not {cfg.backend}; launch with torchrun, mpirun or srun, or let gradzip train start the ranks")
    elif cfg.sync_spec.outer and not sharded_outer(cfg.sync_spec, cfg.sharding):
        also = "; --sync sparseloco runs sharded with --hsdp" if sharded_outer(cfg.sync_spec, "hsdp") else ""
        why = f"takes --sync step (FSDP reduces gradients every step), not --sync {cfg.sync}{also}"
    elif cfg.sync_spec.outer and cfg.sync_spec.overlap:
        why = f"with --sync {cfg.sync_spec.mode} waits for each sync's exchange: drop overlap=1, or drop {flag}"
    elif cfg.sync_spec.outer and cfg.ef_dtype != "fp32":
        why = (f"--ef-dtype {cfg.ef_dtype} is the per-step compressor's; --sync {cfg.sync_spec.mode} sets its own: "
               f"--sync {cfg.sync_spec.mode}:ef_dtype={cfg.ef_dtype}")
    elif cfg.hierarchical:
        why = "and --hierarchical both split the reduction by node; use --hsdp --ranks-per-node K alone"
    elif cfg.optimizer not in ("adamw", "sgd"):
        why = (f"steps an element-wise optimizer on each rank's shard (adamw, sgd), not --optimizer "
               f"{cfg.optimizer}, which needs whole tensors or its own exchange")
    elif cfg.ef_dtype != "fp32" and not _flat_memory(create(cfg.spec)):
        why = (f"--ef-dtype {cfg.ef_dtype} sets the flat error memory's dtype, but --compressor {cfg.compressor} "
               "keeps none (or keeps it per matrix); add ef=true to an element-wise compressor or drop --ef-dtype")
    elif cfg.sharding == "fsdp" and cfg.exchange is not None:
        why = (f"compresses the reduce-scatter chunk by chunk (an alltoall), so --exchange {cfg.exchange} does "
               "not apply; use --hsdp, whose replica all-reduce takes any scheme, or drop --exchange")
    if why:
        raise GradzipError(f"{_pre(source)}{flag} {why}")


def check_netem(cfg: Any, source: str) -> None:
    """``--bandwidth`` (``unshaped`` only for a real backend: there it names the testbed's link, which
    ``sim`` must model with a number), ``--netem`` (a real backend) and ``--netem-trace`` (with
    ``--netem``; the file, or shipped trace, is read here, so a bad row fails before anything starts)."""
    try:
        if not (cfg.bandwidth == UNSHAPED and cfg.backend != "sim"):
            parse_bandwidth(cfg.bandwidth)
    except SpecError as e:
        hint = f" ({UNSHAPED} names a testbed link: --backend gloo or mpi with --netem)" \
            if cfg.bandwidth == UNSHAPED else ""
        raise GradzipError(f"{_pre(source)}--bandwidth: {e}{hint}") from None
    if cfg.netem is not None:
        if cfg.backend not in ("gloo", "mpi"):
            raise GradzipError(f"{_pre(source)}--netem needs --backend gloo or mpi (real processes), not "
                               f"{cfg.backend!r}")
        try:
            parse_netem(cfg.netem)
        except GradzipError as e:
            raise GradzipError(f"{_pre(source)}{e}") from None
    if cfg.netem_trace is not None:
        if cfg.netem is None:
            raise GradzipError(f"{_pre(source)}--netem-trace {cfg.netem_trace} plays on the network testbed: it "
                               "needs --netem HOSTS:RATE (and --backend gloo or mpi)")
        try:
            read_trace(resolve_trace(cfg.netem_trace, flag="--netem-trace"), flag="--netem-trace")
        except GradzipError as e:
            raise GradzipError(f"{_pre(source)}{e}") from None


SWITCHES = ("fsdp", "hsdp")  # the flags --fsdp/--hsdp, spelled as config keys; the field is ``sharding``


def sharding_switches(d: dict[str, Any], source: str) -> dict[str, Any]:
    """``d`` with the switches ``fsdp = true`` / ``hsdp = true`` (keys spelled as the flags) turned
    into the ``sharding`` field that ``config.toml`` writes. ``false`` says "not this layout": it sets
    nothing, but must not contradict ``sharding`` in the same ``d``. Both switches on, or a switch
    against ``sharding``, is one line, as ``--fsdp --hsdp`` together is on the command line."""
    def norm(key: Any) -> str:
        return str(key).strip().replace("-", "_").lower()

    switches = {norm(k): v for k, v in d.items() if norm(k) in SWITCHES}
    if not switches:
        return d
    out = {k: v for k, v in d.items() if norm(k) not in SWITCHES}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise GradzipError(f"{_pre(source)}{key} must be true or false (the flag --{key}), got {value!r}")
    on = [k for k, v in switches.items() if v]
    if len(on) > 1:
        raise GradzipError(f"{_pre(source)}fsdp = true and hsdp = true: --fsdp and --hsdp are two layouts of the "
                           "same model; give one")
    given = next((v for k, v in d.items() if norm(k) == "sharding"), None)
    if given is not None:
        clash = next((k for k, v in switches.items() if (given == k) != v), None)
        if clash is not None:
            raise GradzipError(f"{_pre(source)}{clash} = {str(switches[clash]).lower()} contradicts sharding = "
                               f"{given!r}; keep one of them")
    elif on:
        out["sharding"] = on[0]
    return out


FT_MODES = ("ftdiloco", "ftsparseloco")  # the fault-tolerant --sync modes: one run per replica group


def check_ft(cfg: Any, source: str) -> None:
    """``--sync ftdiloco``/``ftsparseloco``: each replica group one gloo run of one or more ranks
    (DDP inside the group), its keys in range (torchft and the Lighthouse:
    :meth:`TrainConfig.check_runtime`)."""
    from gradzip.engine.ftdiloco import options

    if cfg.backend != "gloo":
        raise GradzipError(f"{_pre(source)}--sync {cfg.sync_spec.mode} runs each replica group as its own run on "
                           f"--backend gloo (got --backend {cfg.backend})")
    if cfg.sharding != "none":
        raise GradzipError(f"{_pre(source)}--sync {cfg.sync_spec.mode} replicates the model inside a replica group "
                           f"(DDP over its --workers); --{cfg.sharding} is not supported there: drop it")
    options(cfg.sync_spec)
