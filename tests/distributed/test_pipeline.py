"""Pipeline parallelism is not measured yet: torch.distributed.pipelining reduces an FSDP2
stage's gradients outside the autograd backward (perform_reduce_grad), and the GNS hook
refuses that with a message naming it (before this, torch's own "Final callbacks can only
be installed during backward pass" came out of the schedule). 4 gloo ranks, 2 stages x 2
data-parallel ranks; rank-side code in _pp_workers.py."""
from __future__ import annotations

import pytest

from _harness import run_world

pytestmark = pytest.mark.distributed


def test_pipeline_stage_refused_with_a_clear_error():
    res = run_world("_pp_workers", "pipeline", 4, timeout=120)
    for rank, r in enumerate(res):
        assert r["error"] is not None and "pipeline parallelism is not measured" in r["error"], (rank, r)
        assert r["state_step"] == 0  # nothing counted
