"""torchdata's StatefulDataLoader over coord.batch_sampler(...): the coordinator's
state_dict keeps the stream position (consumed micro-batches), with or without workers;
the loader's own state agrees with it only without workers (docs/integrations.md)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from gns_kernels.adaptive import AdaptiveBatching

sdl = pytest.importorskip("torchdata.stateful_dataloader",
                          reason="torchdata is not installed (pip install torchdata; in the test extra)")


def _build(workers):
    torch.manual_seed(0)
    m = torch.nn.Linear(12, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    coord = AdaptiveBatching(m, opt, micro_batch_size=4, initial_batch_size=8, every=1,
                             max_batch_size=64)
    x = torch.arange(200).float()[:, None].repeat(1, 12)
    ds = TensorDataset(x, torch.zeros(200, dtype=torch.long))
    loader = sdl.StatefulDataLoader(ds, batch_sampler=coord.batch_sampler(len(ds)), num_workers=workers)
    return m, opt, coord, loader


def _run(m, opt, coord, loader, steps):
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in coord.batches(loader, max_steps=coord.current_step + steps):
            for x, y in batch:
                seen.extend(int(v) for v in x[:, 0])
                (F.cross_entropy(m(x), y) / len(batch)).backward()
            opt.step(); opt.zero_grad()
    return seen


@pytest.mark.parametrize("workers,with_loader_state", [(0, True), (0, False), (2, False)])
def test_stateful_dataloader_resumes_at_the_consumed_position(workers, with_loader_state):
    m, opt, coord, loader = _build(workers)
    _run(m, opt, coord, loader, 3)
    ckpt = {"coord": coord.state_dict(), "loader": loader.state_dict()}
    ref = _run(m, opt, coord, loader, 3)
    m2, opt2, coord2, loader2 = _build(workers)
    if with_loader_state:
        loader2.load_state_dict(ckpt["loader"])
    coord2.load_state_dict(ckpt["coord"])
    assert _run(m2, opt2, coord2, loader2, 3) == ref
