"""The DDP hook's pack / unpack of an l1/l2 bucket (single process, no collective).

_pack_l must write [x, x^2] (x = g - S) for every measured parameter and a plain copy for
the others, with ONE square_pack_multi call for the whole bucket (no per-parameter
square_pack), and _unpack_l must give back the mean gradient and the variance terms of the
packed halves, one row per measured parameter. Checked against gns_kernels.reference on odd sizes, in every bucket dtype.
"""
from __future__ import annotations

import pytest
import torch

from gns_kernels import ops
from gns_kernels import reference as ref
from gns_kernels.distributed import ddp
from gns_kernels.distributed._measurement import Measurement
from gns_kernels.distributed.state import GNSHookState

pytestmark = pytest.mark.skipif(not ops.cpp_available(), reason="needs the C++ extension")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_shift", [False, True])
def test_pack_l_one_multi_call_matches_reference(dtype, with_shift, gen, monkeypatch):
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in ((7, 3), (5,), (33, 2), (1,))]
    measured = params[:1] + params[2:]  # params[1] is not measured
    shifts = {p: torch.randn(p.shape, generator=gen).to(dtype) for p in measured} if with_shift else None
    state = GNSHookState(geometry="l2", every=1, batch_size=8, shift=shifts, params=measured)
    n_buf = sum(p.numel() for p in params)
    buf = torch.randn(n_buf, generator=gen).to(dtype)
    ctx = Measurement(state, 2, 2)  # 2 ranks (simulated below), rank 0
    segs, off = [], 0
    for p in params:
        segs.append((off, p.numel(), p, ctx.plan.of(p)))
        off += p.numel()
    calls = []
    real = ops.square_pack_multi
    monkeypatch.setattr(ops, "square_pack_multi", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(ops, "square_pack", lambda *a, **k: pytest.fail("per-parameter square_pack"))
    pack, rows = ddp._pack_l(buf, segs, None)
    assert len(calls) == 1
    q = 0
    for (o, n, p, pp) in segs:
        g = buf[o:o + n]
        if pp.measured:
            s = None if shifts is None else shifts[p].reshape(-1)
            torch.testing.assert_close(pack[q:q + 2 * n].double(), ref.square_pack(g, s), rtol=3e-7, atol=0)
            q += 2 * n
        else:
            assert torch.equal(pack[q:q + n], g.float())
            q += n
    assert q == pack.numel()

    # two simulated ranks: the all-reduce average of two packs, then unpack
    buf2 = torch.randn(n_buf, generator=gen).to(dtype)
    pack2, _ = ddp._pack_l(buf2, segs, None)
    avg = (pack + pack2) / 2
    ds = [avg[q0:q0 + n].clone() for (_, n, q0, _, pp) in rows if pp.measured]
    qs = [avg[q0 + n:q0 + 2 * n].clone() for (_, n, q0, _, pp) in rows if pp.measured]
    ss = [None if pp.shift is None else pp.shift.reshape(-1) for (*_, pp) in rows if pp.measured]
    out = torch.full_like(buf, float("nan"))
    ddp._unpack_l(out, avg, rows, ctx)
    want = sum(ref.variance_norms(d, qq, ctx.scale, s) for d, qq, s in zip(ds, qs, ss))
    # one row per measured parameter (summed when the estimate is read)
    assert len(ctx.l_rows) == len(ds)
    eps = torch.finfo(torch.float32).eps
    bound = torch.zeros(4, dtype=torch.float64)
    for row, d, qq, s in zip(ctx.l_rows, ds, qs, ss):
        # float32 forms q - d^2 with a rounding of about eps (q + d^2) per element: s2 is
        # then good to 4 eps scale (q + d^2) and its root to the root of that (a parameter
        # whose two samples nearly agree loses all of s's digits, not only 1e-5 of them)
        e2 = 4 * eps * ctx.scale * (qq.double() + d.double() ** 2)
        tol = torch.stack([e2.sqrt().sum(), torch.zeros((), dtype=torch.float64), e2.sum(),
                           torch.zeros((), dtype=torch.float64)])
        want_row = ref.variance_norms(d, qq, ctx.scale, s)
        err = (row.double() - want_row).abs()
        assert (err <= tol + 1e-5 * want_row.abs() + 1e-12).all(), (err, tol, want_row)
        bound += tol
    err = (torch.stack(ctx.l_rows).sum(0).double() - want).abs()
    assert (err <= bound + 1e-5 * want.abs() + 1e-12).all(), (err, bound, want)
    mean = (buf.double() + buf2.double()) / 2  # the mean gradient, rounded once to the bucket dtype
    tol = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    torch.testing.assert_close(out.double(), mean, rtol=tol, atol=tol)
