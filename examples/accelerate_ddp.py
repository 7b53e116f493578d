"""accelerate + gradzip: prepare the model, then register the hook on it. BERT (masked LM).

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --compressor onebit --out runs/accelerate

`DistributedDataParallelKwargs(comm_hook=...)` takes only torch's built-in hooks; a prepared
model is a plain DistributedDataParallel, so gradzip's hook is registered on it directly.
"""

import argparse
import os

import torch

import gradzip
from gradzip.integrations import exit_if_missing

with exit_if_missing("examples/accelerate_ddp.py", "hf"):  # without the extra: one line, exit code 2
    from accelerate import Accelerator
    from toy_mlm import Patterns, save_replica, tiny_bert


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="onebit")
    ap.add_argument("--out", default="runs/accelerate")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()

    accelerator = Accelerator(cpu=True)
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = torch.utils.data.DataLoader(Patterns(), batch_size=8, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    state, hook = gradzip.ddp_hook(a.compressor)  # after prepare: the model is DDP now
    model.register_comm_hook(state, hook)

    losses: list[float] = []
    while len(losses) < a.steps:  # epochs until --steps
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == a.steps:
                break
    figures = state.stats()  # this rank's bytes per step, compression ratio, compression time
    accelerator.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; gradzip: {figures}")
    os.makedirs(a.out, exist_ok=True)
    save_replica(accelerator.unwrap_model(model), a.out, accelerator.process_index)
    torch.save({"losses": losses, "figures": figures}, f"{a.out}/losses-rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main()
