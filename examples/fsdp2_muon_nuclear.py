"""FSDP2 + Muon (2-D hidden weights) + AdamW (the rest), batch grown by the nuclear GNS.

    torchrun --nproc_per_node=2 examples/fsdp2_muon_nuclear.py
    python examples/fsdp2_muon_nuclear.py --ranks 2           # spawns CPU ranks (gloo)

The ranks are the GNS samples (the measurement rides in FSDP2's reduce-scatter); the
micro-batches of a step accumulate under set_requires_gradient_sync(False), which the
coordinator's context does. One coordinator scales the LR of both optimizers.
Lines marked `# <-- gns` are what adaptive batching adds.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk


class MLP(torch.nn.Module):
    def __init__(self, dim=32, hidden=64, classes=10):
        super().__init__()
        self.inp = torch.nn.Linear(dim, hidden)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(F.gelu(self.mid(F.gelu(self.inp(x)))))


def dataset(n=4096, dim=32, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    logits = x @ torch.randn(dim, classes, generator=g) + 2.0 * torch.randn(n, classes, generator=g)
    return TensorDataset(x, logits.argmax(1))


def train(args):
    torch.manual_seed(0)
    model = MLP()
    for layer in (model.inp, model.mid, model.out):
        fully_shard(layer, shard_placement_fn=gk.fsdp_gns_shard_placement)
    fully_shard(model)
    hidden = [model.mid.weight]                       # Muon: 2-D hidden weights (as the paper)
    other = [p for p in model.parameters() if p is not model.mid.weight]
    muon = torch.optim.Muon(hidden, lr=0.02, momentum=0.95)
    adamw = torch.optim.AdamW(other, lr=3e-3)
    coord = gk.AdaptiveBatching(model, [muon, adamw], micro_batch_size=args.micro,        # <-- gns
                                every=args.every, initial_batch_size=args.batch,
                                max_batch_size=args.max_batch)   # nuclear GNS on Muon's matrices
    ds = dataset()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)),                   # <-- gns
                        num_workers=args.workers)
    history = []
    for batch in coord.batches(loader, max_samples=args.samples, max_steps=args.steps):  # <-- gns
        for x, y in batch:                               # no gradient sync on all but the last
            (F.cross_entropy(model(x), y) / len(batch)).backward()
        muon.step(); adamw.step()
        muon.zero_grad(); adamw.zero_grad()
        step = batch.step
        m = coord.metrics()
        history.append(m["batch_size"])
        if dist.get_rank() == 0 and m["measured"]:
            print(f"step {step:4d}  B {m['batch_size']:4d} -> {m['next_batch_size']:4d}  "
                  f"gns {m['gns']:8.1f}  muon lr {m['lr_0']:.2e}  adamw lr {m['lr_1']:.2e}", flush=True)
    if dist.get_rank() == 0:
        print(json.dumps({"batch_sizes": history, "next_batch_size": coord.batch_size,
                          "samples_seen": coord.samples_seen,
                          "lr_multiplier": coord.lr_multiplier, "world_size": coord.world_size,
                          "micro_batch_size": coord.micro_batch_size,
                          "lrs": [muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]]}), flush=True)


def _rank_main(rank, world, store, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks to spawn (without torchrun)")
    p.add_argument("--batch", type=int, default=16, help="initial global batch B_0")
    p.add_argument("--micro", type=int, default=4, help="micro-batch size b per rank")
    p.add_argument("--max-batch", type=int, default=256, help="cap on B (recommended: always set one)")
    p.add_argument("--every", type=int, default=5, help="measure every F optimizer steps")
    p.add_argument("--samples", type=int, default=20000, help="sample budget")
    p.add_argument("--steps", type=int, default=None, help="optional cap on optimizer steps")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    args = p.parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_rank_main, args=(args.ranks, os.path.join(tmp, "store"), args),
                                    nprocs=args.ranks)


if __name__ == "__main__":
    main()
