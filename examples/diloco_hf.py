"""DiLoCo on a Hugging Face BERT with an unchanged training loop: gradzip syncs from a post-hook.

    torchrun --nproc-per-node 2 examples/diloco_hf.py --sync-every 8 --compressor intk:bits=8 --out runs/diloco

Each rank takes --sync-every AdamW steps on its own batches; then the ranks average the
pseudo-gradient (θ_global − θ_local, sent through --compressor) and take one outer Nesterov step.
The loop below is the plain PyTorch loop: `loss.backward(); inner.step(); inner.zero_grad()`.
"""

import argparse
import os

import torch

import gradzip
from gradzip.comm import init_communicator
from gradzip.integrations import exit_if_missing

with exit_if_missing("examples/diloco_hf.py", "hf"):  # without the extra: one line, exit code 2
    from toy_mlm import Patterns, save_replica, tiny_bert


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compressor", default="none")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default="runs/diloco")
    a = ap.parse_args()

    comm = init_communicator("gloo")  # reads torchrun's environment
    model = tiny_bert()
    inner = torch.optim.AdamW(model.parameters(), lr=2e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    gradzip.DiLoCo(model, inner, outer, comm, sync_every=a.sync_every, compressor=a.compressor,
                   fragments=a.fragments, fragment_sync_delay=a.delay, bucket_cap_mb=0.05)
    data = Patterns(seed=comm.rank)  # each rank its own data
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)

    losses: list[float] = []
    while len(losses) < a.steps:
        for batch in loader:  # the unchanged loop
            loss = model(**batch).loss
            loss.backward()
            inner.step()  # every --sync-every steps, this also syncs
            inner.zero_grad()
            losses.append(loss.item())
            if len(losses) == a.steps:
                break
    sent = comm.stats.bytes_sent
    if comm.rank == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {sent:,} bytes sent by rank 0 in {a.steps} steps")
    os.makedirs(a.out, exist_ok=True)
    save_replica(model, a.out, comm.rank)
    torch.save({"losses": losses, "bytes_sent": sent}, f"{a.out}/losses-rank{comm.rank}.pt")
    comm.close()


if __name__ == "__main__":
    main()
