"""The hooks' post-collective path reads no device value on the host.

On CPU: the statistics -> estimate-tensors functions run on fake tensors
(torch._subclasses.fake_tensor.FakeTensorMode), where any data-dependent read (bool(),
float(), .item(), .tolist(), nonzero()) raises. On a GPU (marked ``cuda``): a DDP-hook
measurement step under torch.cuda.set_sync_debug_mode("error").
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import gns_kernels as gk
from gns_kernels import spectral
from gns_kernels.distributed import GNSHookState, ddp as ddp_mod
from gns_kernels.distributed._measurement import Measurement
from gns_kernels.distributed._share import SolveShare, assign_solves, share_totals


def test_fake_mode_rejects_host_reads():
    """The premise: each kind of host read the hook path must avoid raises here."""
    reads = [lambda t: bool(torch.isfinite(t).all()), lambda t: float(t.sum()),
             lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: t.nonzero()]
    for read in reads:
        with FakeTensorMode():
            x = torch.randn(3, 4)
            with pytest.raises(Exception):
                read(x)


def _fake_bucket(shift: bool):
    grads = [torch.randn(7, 11), torch.randn(9, 5), torch.randn(6, 6)]
    grams = [torch.randn(7, 7), torch.randn(5, 5), torch.randn(6, 6)]
    shifts = [torch.randn(7, 11), None, torch.randn(6, 6)] if shift else None
    return grams, grads, shifts


@pytest.mark.parametrize("method", ["newton", "eigh"])
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("world,rank", [(1, 0), (2, 0), (2, 1), (3, 2)])
def test_nuclear_share_path_is_sync_free(method, bias_correction, world, rank):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a swallowed solver error would warn
        with FakeTensorMode():
            share = SolveShare(world, rank, 3.0, bias_correction, 4, 8.0,
                               hints=spectral.EigHints(), method=method)
            for shift in (True, False):
                share.add_grads(*_fake_bucket(shift))
            share.add_grams([torch.randn(8, 8), torch.randn(4, 4)],
                            [torch.randn(8, 8), torch.randn(4, 4)], [(8, 20), (30, 4)])
            vec = share.vector()
            totals = share_totals(vec)
    assert vec.shape == (3 * 8,) and vec.dtype == torch.float64
    assert totals.shape == (2,)


@pytest.mark.parametrize("dof,signal", [("columns", "raw"), ("gauss-sums", "debiased")])
@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1)])
def test_host_route_staging_is_sync_free(dof, signal, pooled, world, rank):
    """The host route up to its job's submit (issue 43): the owned matrices formed, the
    noise pool folded, the device rows written (``SolveShare.stage``), all on fake tensors
    (the job's solve runs on a host thread, on host data, outside the hooks' path)."""
    from gns_kernels.stats.pool import NoisePool

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            share = SolveShare(world, rank, 3.0, True, 4, 8.0, hints=spectral.EigHints(), method="host",
                               dof=dof, signal=signal, pool=NoisePool(0.9) if pooled else None,
                               owners={} if pooled else None)
            for i, shift in enumerate((True, False)):
                grams, grads, shifts = _fake_bucket(shift)
                devs = [torch.randn(g.shape) for g in grads] if dof == "gauss-sums" else None
                share.add_grads(grams, grads, shifts, devs, [(i, j) for j in range(3)] if pooled else None)
            assert share.is_host()
            share.stage()
            st = share.staged
    rows = len(share.rows)
    assert st.device.shape == (rows, 6) and st.device.dtype == torch.float64
    kinds = 2 + pooled + (signal == "debiased")  # noise, signal, pooled, debiased per owned matrix
    assert len(st.items) == kinds * len(set(j for _, j in st.spread)) == len(st.pair) == len(st.spread)
    assert st.event is None and share.job is None
    assert st.items or world > 1


@pytest.mark.parametrize("method", ["newton", "eigh"])
@pytest.mark.parametrize("signal", ["raw", "debiased"])
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 1)])
def test_gauss_sums_share_path_is_sync_free(method, signal, world, rank):
    """The 'gauss-sums' dof: this rank's deviation sums, the solver's pair sums and the
    correction formed from the reduced vector (share totals), all on fake tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            share = SolveShare(world, rank, 3.0, True, 4, 8.0, hints=spectral.EigHints(),
                               method=method, dof="gauss-sums", signal=signal)
            for shift in (True, False):
                grams, grads, shifts = _fake_bucket(shift)
                share.add_grads(grams, grads, shifts, [torch.randn(g.shape) for g in grads])
            vec = share.vector()
            totals = share.totals(vec)
    rows = 3 + (signal == "debiased") + 5
    assert vec.shape == (rows * 6,) and vec.dtype == torch.float64
    assert totals.shape == (2 + (signal == "debiased"),)


@pytest.mark.parametrize("geometry", ["l1", "l2", "nuclear"])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("signal", ["raw", "debiased"])
def test_ddp_unpack_and_finish_are_sync_free(geometry, shift, signal):
    """The DDP hook's work after a bucket's all-reduce (unpack: statistics of the bucket,
    mean gradient written back) and after the last one (finish), on fake tensors; one
    rank, so finish issues no collective."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with FakeTensorMode():
            params = [torch.nn.Parameter(torch.randn(7, 11)), torch.nn.Parameter(torch.randn(5)),
                      torch.nn.Parameter(torch.randn(9, 4))]
            shifts = {p: torch.randn(p.shape) for p in params} if shift else None
            state = GNSHookState(geometry, every=1, batch_size=16, signal=signal,
                                 shift=(lambda p: shifts.get(p)) if shift else None)
            ctx = Measurement(state, 1, 4)
            n_buf = sum(p.numel() for p in params)
            buf = torch.randn(n_buf)
            segs, off = [], 0
            for p in params:
                segs.append((off, p.numel(), p, ctx.plan.of(p)))
                off += p.numel()
            if geometry == "nuclear":
                # the hook's own pack (the bucket-layout path unshifted, per matrix shifted)
                pack, rows = ddp_mod._pack_nuclear(buf, segs, None)
                assert (rows[0] is None) == shift
                pack = torch.randn(pack.shape)
                ddp_mod._unpack_nuclear(buf, pack, rows, ctx)
            else:
                rows, q = [], 0
                for off, n, p, pp in segs:
                    rows.append((off, n, q, p, pp))
                    q += 2 * n
                pack = torch.randn(q)
                ddp_mod._unpack_l(buf, pack, rows, ctx)
            ddp_mod._finish(ctx, None)
    assert state._pending is not None and state.estimate_step == 0


def test_estimate_reads_once_after_backward():
    """record_measurement keeps device values; the first read of estimate builds the
    GNSEstimate (the same numbers as building it at once), later reads return it."""
    st = GNSHookState("nuclear", every=1, batch_size=8, bias_correction=False)
    calls = []

    def noise():
        calls.append("n")
        return torch.tensor(2.0, dtype=torch.float64)

    st.record_measurement(4, None, noise, torch.tensor([3.0], dtype=torch.float64)[0], 5)
    assert calls == [] and st.estimate_step == 5
    est = st.estimate
    ref = gk.stats.estimate_from_stats("nuclear", 2.0, 3.0, 4, 8, False)
    assert (est.gns, est.noise, est.signal, est.valid) == (ref.gns, ref.noise, ref.signal, ref.valid)
    assert st.estimate is est and calls == ["n"]


# --------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("geometry", ["l1", "nuclear"])
def test_cuda_hook_measurement_has_no_host_sync(geometry):
    """A measurement step of MicroBatchGNS under DDP (NCCL, one rank, 2 micro-batches) with
    torch.cuda.set_sync_debug_mode('error') around the synchronized backward, plus the
    share all-reduce of a 2-rank assignment on the same group; the estimate read after
    it matches gk.estimate on the micro-batch gradients (float64)."""
    import torch.distributed as dist

    dev = torch.device("cuda")
    A, b = 2, 8
    # the Newton route, solved in the measurement (the hooks' CUDA default is the lagged
    # host route: test_cuda_pooled_measurements_have_no_host_sync covers it)
    with _one_rank_micro(geometry, (37, 64, 21), A, b, bias_correction=False,
                         method="newton") as (model, ddp, mb):
        xs = torch.randn(A, b, 37, device=dev)
        ys = torch.randn(A, b, 21, device=dev)
        samples, prev = [], None
        for a in range(A):
            sync = a == A - 1
            guard = contextlib.nullcontext() if not sync else _sync_error()
            with (ddp.no_sync() if not sync else contextlib.nullcontext()), guard:
                loss = torch.nn.functional.mse_loss(ddp(xs[a]), ys[a]) / A
                loss.backward()
            if not sync:
                mb.micro_step()
                prev = [p.grad.detach().clone() for p in model.parameters()]
                samples.append([A * g.double() for g in prev])
        torch.cuda.synchronize()
        local = [p.grad.detach().double() * A - s for p, s in zip(model.parameters(), samples[0])]
        samples.append(local)
        mb.micro_step()
        est = mb.estimate
        mats = [[s[i] for i in range(len(s)) if s[i].dim() == 2 or geometry != "nuclear"]
                for s in samples]
        ref = gk.estimate(mats, batch_size=A * b, geometry=geometry, bias_correction=False)
        assert est.valid and ref.valid
        for a_, b_ in ((est.noise, ref.noise), (est.signal, ref.signal)):
            assert abs(a_ - b_) <= 1e-3 * abs(b_)

        # the share path of a 2-rank assignment: solves on the side stream, the share
        # all-reduce on it, nothing read on the host until read()
        grads = [torch.randn(48, 70, device=dev), torch.randn(30, 20, device=dev)]
        grams = [g @ g.T + torch.eye(g.shape[0], device=dev) if g.shape[0] <= g.shape[1]
                 else g.T @ g + torch.eye(g.shape[1], device=dev) for g in grads]
        share = SolveShare(2, 0, 1.0, False, 2, 2.0, hints=None)
        with _sync_error():
            share.add_grads(grams, grads, None)
            share.launch(dist.group.WORLD, dist.all_reduce)
        noise, signal, _ = share.read()
        # C_l = mean Gram - D D^T = I (k_l x k_l): noise_l = k_l; signal_l = ||G_l||_S1;
        # rank 0 holds the sum of its own share (the other rank's entries are 0)
        ks = [min(g.shape) for g in grads]
        owners = assign_solves([2 * k ** 3 for k in ks], [0, 0])  # noise + signal together
        want_n = sum(k for k, o in zip(ks, owners) if o == 0)
        want_s = sum(float(torch.linalg.svdvals(g.double()).sum())
                     for g, o in zip(grads, owners) if o == 0)
        assert abs(noise - want_n) <= 1e-3 * max(want_n, 1)
        assert abs(signal - want_s) <= 1e-3 * max(want_s, 1)


@contextlib.contextmanager
def _sync_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@contextlib.contextmanager
def _one_rank_micro(geometry: str, sizes: tuple, A: int, b: int, **kw):
    """(model, ddp, mb) on cuda: a Linear-Tanh-Linear model of `sizes` under DDP over NCCL
    with one rank (tiny buckets), MicroBatchGNS(A micro-batches of b) as its comm hook."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'store')}",
                                rank=0, world_size=1)
        try:
            torch.manual_seed(0)
            d_in, d_hid, d_out = sizes
            model = torch.nn.Sequential(torch.nn.Linear(d_in, d_hid), torch.nn.Tanh(),
                                        torch.nn.Linear(d_hid, d_out)).to("cuda")
            ddp = DDP(model, bucket_cap_mb=0.001)
            mb = gk.MicroBatchGNS(list(model.parameters()), geometry=geometry, every=1,
                                  batch_size=A * b, micro_batches=A, **kw)
            ddp.register_comm_hook(mb, gk.ddp_gns_hook)
            yield model, ddp, mb
        finally:
            dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("geometry,method", [("l1", "auto"), ("nuclear", "newton"), ("nuclear", "auto")])
def test_cuda_pooled_measurements_have_no_host_sync(geometry, method):
    """The hooks' defaults (bias correction and the noise pool on): MicroBatchGNS under DDP
    (NCCL, one rank, 3 micro-batches), 4 measurement steps, every synchronized backward
    under set_sync_debug_mode('error'); the pooled noise read after each step matches
    reference.pooled_noise (float64) on the micro-batch gradients -- for nuclear on CUDA
    "auto" is the lagged host route: after step k the estimate is step k - 1's."""
    from gns_kernels import reference

    dev = torch.device("cuda")
    A, b, steps = 3, 8, 4
    lag = 1 if geometry == "nuclear" and method == "auto" else 0
    with _one_rank_micro(geometry, (23, 40, 13), A, b, method=method) as (model, ddp, mb):
        hist, pooled = [], []
        for k in range(steps):
            model.zero_grad(set_to_none=True)
            xs = torch.randn(A, b, 23, device=dev)
            ys = torch.randn(A, b, 13, device=dev)
            prev = [torch.zeros_like(p) for p in model.parameters()]
            samples = []
            for a in range(A):
                sync = a == A - 1
                guard = _sync_error() if sync else contextlib.nullcontext()
                with (ddp.no_sync() if not sync else contextlib.nullcontext()), guard:
                    loss = torch.nn.functional.mse_loss(ddp(xs[a]), ys[a]) / A
                    loss.backward()
                torch.cuda.synchronize()
                cur = [p.grad.detach().double().clone() for p in model.parameters()]
                samples.append([A * (c - q) for c, q in zip(cur, prev)])
                prev = cur
                mb.micro_step()
            hist.append((samples, A * b))
            est = mb.estimate
            if k < lag:  # the host route's first measurement is read at the next one
                assert est is None or mb.estimate_step != k
                pooled.append(None)
                continue
            assert est.valid and est.step == k - lag
            pooled.append(est.noise_pooled)
        want = reference.pooled_noise(hist, geometry, 0.9)
        for k in range(1 + lag, steps):
            assert pooled[k] == pytest.approx(sum(want[k - lag]) ** 2, rel=1e-3), k
