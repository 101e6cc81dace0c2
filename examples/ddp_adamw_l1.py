"""Plain DDP + AdamW whose global batch grows with the l1 gradient noise scale.

    torchrun --nproc_per_node=2 examples/ddp_adamw_l1.py      # a launcher's ranks
    python examples/ddp_adamw_l1.py --ranks 2                 # spawns CPU ranks (gloo)

The lines marked `# <-- gns` are all that adaptive batching adds to a DDP loop. The
batch is B = ranks x micro-batches x b with the micro-batch size b fixed; the loader's
items are single micro-batches, and the coordinator decides how many each step takes.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk


def dataset(n=4096, dim=32, classes=10, noise=0.5, seed=0):
    """A noisy linear classification task (its GNS is large enough for the batch to grow)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    logits = x @ torch.randn(dim, classes, generator=g) + noise * torch.randn(n, classes, generator=g) * 4
    return TensorDataset(x, logits.argmax(1))


def train(args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    coord = gk.AdaptiveBatching(ddp, opt, micro_batch_size=args.micro, every=args.every,     # <-- gns
                                initial_batch_size=args.batch, max_batch_size=args.max_batch)
    ds = dataset()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)),                  # <-- gns
                        num_workers=args.workers)
    history = []
    for batch in coord.batches(loader, max_samples=args.samples, max_steps=args.steps): # <-- gns
        for x, y in batch:                                # no_sync() on all but the last
            loss = F.cross_entropy(ddp(x), y) / len(batch)   # mean over the global batch
            loss.backward()
        opt.step()
        opt.zero_grad()
        step = batch.step
        m = coord.metrics()
        history.append(m["batch_size"])
        if dist.get_rank() == 0 and m["measured"]:
            print(f"step {step:4d}  B {m['batch_size']:4d} -> {m['next_batch_size']:4d}  "
                  f"gns {m['gns']:8.1f}  lr {m['lr_0']:.2e}", flush=True)
    if dist.get_rank() == 0:
        print(json.dumps({"batch_sizes": history, "next_batch_size": coord.batch_size,
                          "samples_seen": coord.samples_seen,
                          "lr_multiplier": coord.lr_multiplier, "world_size": coord.world_size,
                          "micro_batch_size": coord.micro_batch_size}), flush=True)


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
