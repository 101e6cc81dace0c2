"""One process, gradient accumulation + Signum, batch grown by the l1 GNS.

    python examples/one_rank_signum_l1.py

With one rank the GNS samples are the accumulated micro-batches (gk.MicroBatchGNS), so
every step accumulates A >= 2 micro-batches of b examples: B = A x b. The coordinator
calls MicroBatchGNS.micro_step() after each micro-batch's backward.
Lines marked `# <-- gns` are what adaptive batching adds.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gns_kernels as gk


def dataset(n=4096, dim=32, classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    logits = x @ torch.randn(dim, classes, generator=g) + 2.0 * torch.randn(n, classes, generator=g)
    return TensorDataset(x, logits.argmax(1))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16, help="initial batch B_0 (>= 2 micro-batches)")
    p.add_argument("--micro", type=int, default=4, help="micro-batch size b")
    p.add_argument("--max-batch", type=int, default=256, help="cap on B (recommended: always set one)")
    p.add_argument("--every", type=int, default=5, help="measure every F optimizer steps")
    p.add_argument("--samples", type=int, default=20000, help="sample budget")
    p.add_argument("--steps", type=int, default=None, help="optional cap on optimizer steps")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    opt = gk.Signum(model.parameters(), lr=1e-3, momentum=0.9)
    coord = gk.AdaptiveBatching(model, opt, micro_batch_size=args.micro, every=args.every,   # <-- gns
                                initial_batch_size=args.batch, max_batch_size=args.max_batch)
    ds = dataset()
    loader = DataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)),                   # <-- gns
                        num_workers=args.workers)
    history = []
    for batch in coord.batches(loader, max_samples=args.samples, max_steps=args.steps):  # <-- gns
        for x, y in batch:
            (F.cross_entropy(model(x), y) / len(batch)).backward()   # mean over the global batch
        opt.step()
        opt.zero_grad()
        step = batch.step
        m = coord.metrics()
        history.append(m["batch_size"])
        if m["measured"]:
            print(f"step {step:4d}  B {m['batch_size']:4d} -> {m['next_batch_size']:4d}  "
                  f"gns {m['gns']:8.1f}  lr {m['lr_0']:.2e}", flush=True)
    print(json.dumps({"batch_sizes": history, "next_batch_size": coord.batch_size,
                      "samples_seen": coord.samples_seen,
                      "lr_multiplier": coord.lr_multiplier, "world_size": coord.world_size,
                      "micro_batch_size": coord.micro_batch_size}), flush=True)


if __name__ == "__main__":
    main()
