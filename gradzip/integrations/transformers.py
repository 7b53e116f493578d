"""gradzip in the Hugging Face ``Trainer``: ``callbacks=[GradzipCallback("onebit")]``.

Under ``torchrun`` (or ``accelerate launch``) the Trainer wraps the model in DDP; the callback

1. registers :func:`gradzip.ddp_hook` on that DDP model at ``on_train_begin``, before the first
   step (the compressor then replaces DDP's allreduce);
2. at every logging step adds this rank's figures to the Trainer's logs under ``gradzip/`` keys
   (``gradzip/bytes_per_step``, ``gradzip/compression_ratio``, ``gradzip/compress_s_per_step``,
   ``gradzip/steps``): they reach ``trainer.state.log_history`` and every ``report_to`` sink
   (TensorBoard, W&B, MLflow), since the callback moves itself ahead of the reporting callbacks;
3. saves the hook state (error memory, PowerSGD's Q) of every rank into each checkpoint directory
   as ``gradzip-rank<r>.pt`` (atomically), and restores it when ``trainer.train(
   resume_from_checkpoint=...)`` resumes from a checkpoint of ``args.output_dir``.

A single process has nothing to compress: one warning, and training goes on. DeepSpeed and FSDP
do not use DDP's communication hooks: a one-line error.

Why the callback looks the Trainer up: ``TrainerCallback`` events receive the unwrapped model,
not the DDP wrapper the hook must be registered on, nor the list of callbacks; the callback finds
the one ``Trainer`` that holds it (once, at ``on_train_begin``).
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from gradzip.engine.ddp import GradzipHookState
from gradzip.engine.hooks import ddp_hook
from gradzip.errors import GradzipError
from gradzip.integrations import check_state, log_figures, missing_extra, rank_file
from gradzip.io import atomic_write

try:
    from transformers import Trainer, TrainerCallback
except ModuleNotFoundError as e:
    raise missing_extra("gradzip.integrations.transformers", e, "hf") from None

__all__ = ["GradzipCallback"]


class GradzipCallback(TrainerCallback):
    """Compress the Trainer's gradient exchange with ``spec``; ``hook_options`` go to
    :func:`gradzip.ddp_hook` (``min_compress_numel``, ``timeout``)."""

    hook_state: GradzipHookState  # the DDP hook's state: compressor, error memory, figures

    def __init__(self, spec: str, **hook_options: Any) -> None:
        self.hook_state, self.hook = ddp_hook(spec, **hook_options)  # checks the spec now; binds at the first step
        self.active = False

    # -- events ----------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
            raise GradzipError("GradzipCallback: DeepSpeed and FSDP do not use DDP's communication hooks; "
                               "gradzip supports the Trainer's DDP mode only")
        trainer = self._trainer()
        ddp = trainer.model_wrapped
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            if not dist.is_initialized() or dist.get_world_size() == 1:
                warnings.warn("GradzipCallback: a single process has no gradient exchange to compress; "
                              "training goes on uncompressed (launch with torchrun --nproc-per-node N)", stacklevel=2)
                return
            raise GradzipError(f"GradzipCallback: the Trainer's model is a {type(ddp).__name__}, not "
                               "DistributedDataParallel; gradzip supports the Trainer's DDP mode only")
        if not self.active:
            ddp.register_comm_hook(self.hook_state, self.hook)
            self.active = True
        # Ahead of the reporting callbacks, so that on_log's additions reach them.
        handler = trainer.callback_handler
        handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)
        if state.global_step > 0:
            self._restore(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not self.active or logs is None or "loss" not in logs:  # training logs only, not eval
            return
        figures = log_figures(self.hook_state)
        logs.update(figures)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.active:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        sd = self.hook_state.state_dict()
        atomic_write(os.path.join(folder, rank_file(dist.get_rank())), lambda f: torch.save(sd, f), durable=True)

    # -- helpers ---------------------------------------------------------------------------
    def _restore(self, folder: str) -> None:
        path = os.path.join(folder, rank_file(dist.get_rank()))
        if not os.path.isfile(path):
            warnings.warn(f"GradzipCallback: {path} not found; the error memory starts from zero "
                          "(resume from a checkpoint in args.output_dir to keep it)", stacklevel=2)
            return
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same one-line error
            raise GradzipError(f"GradzipCallback: cannot load {path}: {e}") from None
        self.hook_state.load_state_dict(check_state(sd, path))

    def _trainer(self) -> Trainer:
        with warnings.catch_warnings():  # touching every object wakes deprecated aliases (torch's reduce_op)
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, Trainer) and any(cb is self for cb in obj.callback_handler.callbacks):
                    return obj
        raise GradzipError("GradzipCallback: no Trainer holds this callback; pass it as Trainer(callbacks=[...])")
