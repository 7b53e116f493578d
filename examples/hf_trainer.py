"""Hugging Face Trainer + gradzip: BERT (masked LM) trained with compressed gradients.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --compressor onebit --out runs/hf

The one gradzip line is `callbacks=[GradzipCallback(...)]`: it registers the compressor as DDP's
communication hook, adds `gradzip/` figures to the Trainer's logs, and keeps the error memory in
the Trainer's checkpoints (`--save-steps`, then `--resume`).
"""

import argparse

from gradzip.integrations import exit_if_missing

with exit_if_missing("examples/hf_trainer.py", "hf"):  # without the extra: one line, exit code 2
    from toy_mlm import Patterns, save_replica, tiny_bert
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradzip.integrations.transformers import GradzipCallback


class StopAt(TrainerCallback):
    """Stop after step N (the schedule still runs to --steps), as a job killed after a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save, control.should_training_stop = True, True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="onebit")
    ap.add_argument("--out", default="runs/hf-trainer")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stop-at", type=int, default=0, help="stop (with a checkpoint) after this step")
    ap.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in --out")
    a = ap.parse_args()

    model = tiny_bert()
    args = TrainingArguments(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=8, learning_rate=2e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False, seed=0, data_seed=0, dataloader_num_workers=0,
    )
    callbacks = [GradzipCallback(a.compressor)] + ([StopAt(a.stop_at)] if a.stop_at else [])
    trainer = Trainer(model=model, args=args, train_dataset=Patterns(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    trainer.save_state()  # trainer_state.json: the log history, gradzip/ figures included
    save_replica(model, a.out, args.process_index)


if __name__ == "__main__":
    main()
