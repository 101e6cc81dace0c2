"""Triton fused-op kernels run by Triton's interpreter on CPU tensors, against reference.py.

Fresh random data every run (seed printed); float64 oracle on the same dtype-rounded
inputs. bfloat16 is tested here too: the kernels do no bf16 arithmetic (they load, convert
to float32 and store raw values), which the interpreter supports (triton 3.9); the bf16
code generation is checked by the AOT tests (test_aot.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from gns_kernels import ops, reference as ref  # noqa: E402
from gns_kernels.triton import fused  # noqa: E402

pytestmark = pytest.mark.triton

SIZES = (1, 7, 4096, 65537)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _vn_inputs(n, dtype, gen, shift):
    """mean_grad d, mean_sq q with q - d^2 of either sign (clamp exercised), optional shift."""
    d = torch.randn(n, generator=gen, dtype=torch.float64)
    var = torch.rand(n, generator=gen, dtype=torch.float64) - 0.1  # ~10% negative -> clamped
    q = d * d + var
    s = torch.randn(n, generator=gen, dtype=torch.float64) if shift else None
    return d.to(dtype), q.to(dtype), None if s is None else s.to(dtype)


def _close(got, want, rtol=1e-5):
    assert got.dtype == torch.float32
    want = want.to(torch.float64)
    atol = 1e-6 * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [False, True])
def test_variance_norms(n, dtype, shift, gen):
    d, q, s = _vn_inputs(n, dtype, gen, shift)
    scale = 3.5
    got = fused.variance_norms(d, q, scale, s)
    _close(got, ref.variance_norms(d, q, scale, s))
    assert torch.equal(got, fused.variance_norms(d, q, scale, s))  # run-to-run identical


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [False, True])
def test_square_pack(n, dtype, shift, gen):
    g = torch.randn(n, generator=gen).to(dtype)
    s = torch.randn(n, generator=gen).to(dtype) if shift else None
    out = torch.full((2 * n,), float("nan"))
    assert fused.square_pack(g, out, s) is out
    torch.testing.assert_close(out.double(), ref.square_pack(g, s), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prev_f32", [False, True])
def test_accumulate_sq(n, dtype, prev_f32, gen):
    g = torch.randn(n, generator=gen).to(dtype)
    prev = torch.randn(n, generator=gen).to(torch.float32 if prev_f32 else dtype)
    sq = torch.rand(n, generator=gen)
    want_sq, _ = ref.accumulate_sq(g, prev, sq)
    assert fused.accumulate_sq(g, prev, sq) is None
    torch.testing.assert_close(sq.double(), want_sq, rtol=1e-6, atol=1e-30)
    assert torch.equal(prev, g.to(prev.dtype))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy on inf - inf
@pytest.mark.parametrize("where", [3, 4096 + 5])  # a full tile, the masked tail tile
def test_variance_norms_nonfinite(where, gen):
    n = 4096 + 9
    for kind in ("nan_grad", "nan_sq", "inf_sq", "inf_grad", "inf_minus_inf_shift"):
        d, q, s = _vn_inputs(n, torch.float32, gen, shift=True)
        if kind == "nan_grad":
            d[where] = float("nan")
        elif kind == "nan_sq":
            q[where] = float("nan")
        elif kind == "inf_sq":
            q[where] = float("inf")
        elif kind == "inf_grad":
            d[where] = float("inf")
        else:
            d[where], s[where] = float("inf"), float("-inf")
        want = ref.variance_norms(d, q, 2.0, s)
        got = fused.variance_norms(d, q, 2.0, s)
        assert not torch.isfinite(want).all(), kind  # the oracle is non-finite somewhere ...
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (kind, got, want)  # ... and so are we
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (kind, got, want)
        _close(got, want)


def test_nan_propagates_through_clamp():
    """A NaN variance (q = NaN) must not be clamped to 0: ||s||_1 and sum s2 are NaN."""
    d = torch.zeros(7)
    q = torch.full((7,), -1.0)  # all clamped to 0 ...
    q[2] = float("nan")  # ... except the NaN, which must survive max(., 0)
    got = fused.variance_norms(d, q, 1.0)
    assert torch.isnan(got[0]) and torch.isnan(got[2]), got
    assert got[1] == 0 and got[3] == 0, got


def test_elementwise_nonfinite(gen):
    n = 1030
    g = torch.randn(n, generator=gen)
    g[[1, 1029]] = torch.tensor([float("nan"), float("inf")])
    out = torch.empty(2 * n)
    fused.square_pack(g, out)
    torch.testing.assert_close(out.double(), ref.square_pack(g), equal_nan=True, rtol=1e-6, atol=0)
    prev, sq = torch.zeros(n), torch.zeros(n)
    fused.accumulate_sq(g, prev, sq)
    assert torch.isnan(sq[1]) and torch.isinf(sq[1029]) and torch.isfinite(sq[2:1029]).all()
    assert torch.equal(prev.isnan(), g.isnan())


def test_longest_lane_sum_accuracy(gen, monkeypatch):
    """The longest sequential float32 sum per lane the production split allows
    (MAX_TILES_PER_PROGRAM = 256 tiles, reached at 2^30 elements) stays within 1e-6 of
    float64: forced here on 2^18 elements by allowing a single program."""
    monkeypatch.setattr(fused, "MAX_PROGRAMS", 1)
    n = fused.MAX_TILES_PER_PROGRAM * fused.BLOCK
    assert fused.plan(n // fused.BLOCK) == (fused.MAX_TILES_PER_PROGRAM, 1)
    d, q, s = _vn_inputs(n, torch.float32, gen, shift=True)
    got = fused.variance_norms(d, q, 1.0, s).double()
    want = ref.variance_norms(d, q, 1.0, s)
    assert ((got - want).abs() / want.abs()).max() < 1e-6, (got, want)


# ------------------------------------------------------------------------------- lists
LIST_SIZES = (0, 1, 7, 1024, 1025, 4099, 0, 3000, 2048)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is NOT 16-byte aligned."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    v = buf[1:]
    v.copy_(t.reshape(-1))
    assert v.data_ptr() % 16 != 0
    return v


@pytest.mark.parametrize("max_programs", [1024, 3])  # 3: programs walk across many tensors
@pytest.mark.parametrize("misaligned", [False, True])
def test_variance_norms_multi(max_programs, misaligned, gen, monkeypatch):
    monkeypatch.setattr(fused, "MAX_PROGRAMS", max_programs)
    ds, qs, ss = [], [], []
    for i, n in enumerate(LIST_SIZES):
        dt = DTYPES[i % 3]
        d, q, s = _vn_inputs(n, dt, gen, shift=i % 2 == 0)
        if s is not None:
            s = s.to(DTYPES[(i + 1) % 3])  # shift dtype may differ from mean_grad's
        if misaligned and n:
            d, q = _misaligned(d), _misaligned(q)
        ds.append(d)
        qs.append(q)
        ss.append(s)
    scale = 1.25
    want = sum(ref.variance_norms(d, q, scale, s) for d, q, s in zip(ds, qs, ss))
    got = fused.variance_norms_multi(ds, qs, scale, ss)
    _close(got, want)
    assert torch.equal(got, fused.variance_norms_multi(ds, qs, scale, ss))
    # no shifts at all
    want0 = sum(ref.variance_norms(d, q, scale) for d, q in zip(ds, qs))
    _close(fused.variance_norms_multi(ds, qs, scale), want0)


def test_variance_norms_multi_nan_and_empty(gen):
    ds = [torch.randn(n, generator=gen) for n in (0, 100, 5000)]
    qs = [d * d + 1 for d in ds]
    ds[2][4999] = float("nan")
    got = fused.variance_norms_multi(ds, qs, 2.0)
    assert torch.isnan(got).all(), got
    assert torch.equal(fused.variance_norms_multi([], [], 2.0), torch.zeros(4))
    only_empty = fused.variance_norms_multi([torch.empty(0)], [torch.empty(0)], 2.0, [None])
    assert torch.equal(only_empty, torch.zeros(4))


@pytest.mark.parametrize("max_programs", [1024, 2])
@pytest.mark.parametrize("misaligned", [False, True])
def test_accumulate_sq_multi(max_programs, misaligned, gen, monkeypatch):
    monkeypatch.setattr(fused, "MAX_PROGRAMS", max_programs)
    gs, ps, sqs = [], [], []
    for i, n in enumerate(LIST_SIZES):
        dt = DTYPES[i % 3]
        g = torch.randn(n, generator=gen).to(dt)
        p = torch.randn(n, generator=gen).to(torch.float32 if i % 2 else dt)
        sq = torch.rand(n, generator=gen)
        if misaligned and n:
            g, p, sq = _misaligned(g), _misaligned(p), _misaligned(sq)
        gs.append(g)
        ps.append(p)
        sqs.append(sq)
    want = [ref.accumulate_sq(g, p, s)[0] for g, p, s in zip(gs, ps, sqs)]
    assert fused.accumulate_sq_multi(gs, ps, sqs) is None
    for i, (g, p, s, w) in enumerate(zip(gs, ps, sqs, want)):
        torch.testing.assert_close(s.double(), w, rtol=1e-6, atol=1e-30, msg=f"sqs[{i}]")
        assert torch.equal(p, g.to(p.dtype)), f"prevs[{i}]"
    fused.accumulate_sq_multi([], [], [])


# -------------------------------------------------------------------- contract details
def test_same_as_ops_backend_triton(gen):
    d, q, s = _vn_inputs(3000, torch.float32, gen, shift=True)
    assert torch.equal(ops.variance_norms(d, q, 2.0, s, backend="triton"), fused.variance_norms(d, q, 2.0, s))


def test_no_input_sized_temporaries(gen, monkeypatch):
    """Only O(programs) allocations: partial slots, the 4 outputs, the pointer table."""
    sizes = []

    class _Recorder:
        def __getattr__(self, name):
            attr = getattr(torch, name)
            if name in ("empty", "zeros", "full", "tensor", "empty_like", "zeros_like", "cat", "stack"):
                def wrapped(*a, **k):
                    r = attr(*a, **k)
                    sizes.append(r.numel())
                    return r
                return wrapped
            return attr

    monkeypatch.setattr(fused, "torch", _Recorder())
    n = 65537
    d, q, s = _vn_inputs(n, torch.float32, gen, shift=True)
    fused.variance_norms(d, q, 2.0, s)
    fused.variance_norms_multi([d, q], [q, d], 2.0, [s, None])
    fused.accumulate_sq(d, q.clone(), torch.zeros(n))
    fused.square_pack(d, torch.empty(2 * n), s)
    assert sizes and max(sizes) <= 4 * fused.plan(2 * (n // fused.BLOCK + 1))[1] + 16, sizes
    assert max(sizes) < n // 100


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: fused.variance_norms(torch.zeros(4), torch.zeros(5), 1.0), "mean_sq"),
        (lambda: fused.variance_norms(torch.zeros(4, dtype=torch.float64), torch.zeros(4), 1.0), "mean_grad"),
        (lambda: fused.variance_norms(torch.zeros(4), torch.zeros(4, dtype=torch.half), 1.0), "mean_sq"),
        (lambda: fused.variance_norms(torch.zeros(4), torch.zeros(4), 1.0, torch.zeros(3)), "shift"),
        (lambda: fused.variance_norms(torch.zeros(4, 4).t(), torch.zeros(4, 4), 1.0), "contiguous"),
        (lambda: fused.variance_norms(torch.zeros(4), torch.zeros(4), "x"), "scale"),
        (lambda: fused.square_pack(torch.zeros(4), torch.zeros(7)), "out"),
        (lambda: fused.square_pack(torch.zeros(4), torch.zeros(8, dtype=torch.half)), "out"),
        (lambda: fused.accumulate_sq(torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.half)), "sq"),
        (lambda: fused.accumulate_sq(torch.zeros(4), torch.zeros(3), torch.zeros(4)), "prev"),
        (lambda: fused.variance_norms_multi([torch.zeros(2)], [], 1.0), "mean_sqs"),
        (lambda: fused.variance_norms_multi([torch.zeros(2)], [torch.zeros(3)], 1.0), r"mean_sqs\[0\]"),
        (lambda: fused.accumulate_sq_multi([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(1)]), r"sqs\[0\]"),
        (lambda: fused.variance_norms(torch.zeros(4, device="meta"), torch.zeros(4, device="meta"), 1.0),
         "mean_grad"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_outputs_must_not_overlap(gen):
    n = 5000
    g1, g2, p0, p1, s = (torch.randn(n, generator=gen) for _ in range(5))
    snap = s.clone()
    with pytest.raises(ValueError, match=r"^sqs\[1\]: must not share memory with sqs\[0\]"):
        fused.accumulate_sq_multi([g1, g2], [p0, p1], [s, s])
    with pytest.raises(ValueError, match=r"^prevs\[0\]: must not share memory with grads\[1\]"):
        fused.accumulate_sq_multi([g1, g2], [g2, p1], [s, torch.zeros(n)])
    assert torch.equal(s, snap)
    buf = torch.zeros(3 * n)
    with pytest.raises(ValueError, match="^out: must not share memory with grad"):
        fused.square_pack(buf[:n], buf[: 2 * n])
    with pytest.raises(ValueError, match="^sq: must not share memory with prev"):
        fused.accumulate_sq(g1, buf[:n], buf[n - 1 : 2 * n - 1])


def test_interpreter_independent_of_env_and_import_order():
    """In a fresh process where triton is imported first WITHOUT TRITON_INTERPRET (so its
    standard library is compiled-mode), the kernels still run on CPU tensors."""
    code = textwrap.dedent(
        """
        import triton, torch
        from gns_kernels.triton import _runtime, fused
        from gns_kernels import reference as ref
        assert not _runtime.interpreter_mode_at_import()
        d = torch.randn(5000); q = d * d + torch.rand(5000)
        got = fused.variance_norms_multi([d, d[:7]], [q, q[:7]], 2.0)
        want = ref.variance_norms(d, q, 2.0) + ref.variance_norms(d[:7], q[:7], 2.0)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        print("OK")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


# ------------------------------------------------------------ square_pack_multi, plans
@pytest.mark.parametrize("max_programs", [1024, 2])  # 2: programs walk across many tensors
@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("shift", [False, True])
def test_square_pack_multi(max_programs, misaligned, shift, gen, monkeypatch):
    monkeypatch.setattr(fused, "MAX_PROGRAMS", max_programs)
    gs, ss = [], []
    for i, n in enumerate(LIST_SIZES):
        g = torch.randn(n, generator=gen).to(DTYPES[i % 3])
        s = torch.randn(n, generator=gen).to(DTYPES[(i + 1) % 3]) if shift and i % 3 != 1 else None
        if misaligned and n:
            g = _misaligned(g)
            s = None if s is None else _misaligned(s)
        gs.append(g)
        ss.append(s)
    pack = torch.full((2 * sum(LIST_SIZES) + 1,), float("nan"))
    outs, off = [], 1 if misaligned else 0
    for n in LIST_SIZES:
        outs.append(pack[off:off + 2 * n])
        off += 2 * n
    assert fused.square_pack_multi(gs, outs, ss if shift else None) is None
    for i, (g, s, o) in enumerate(zip(gs, ss, outs)):
        torch.testing.assert_close(o.double(), ref.square_pack(g, s), rtol=1e-6, atol=1e-30,
                                   msg=f"outs[{i}]")


def test_plans_validate_once_and_tables_follow_addresses(gen, monkeypatch):
    """A list signature is validated on its first call only, and a later call on new
    buffers of the same signature reads the new buffers (tables are keyed by address)."""
    from gns_kernels import _validation

    calls = []
    real = _validation.check_vn
    monkeypatch.setattr(_validation, "check_vn", lambda *a, **k: calls.append(1) or real(*a, **k))
    sizes = (1031, 7, 2050)
    mk = lambda: ([torch.randn(n, generator=gen) for n in sizes], [torch.rand(n, generator=gen) + 2 for n in sizes])
    ds, qs = mk()
    monkeypatch.setattr(fused, "MAX_PROGRAMS", 4097)  # a signature no other test used
    got = ops.variance_norms_multi(ds, qs, 2.0, backend="triton")
    assert len(calls) == len(sizes)  # the face did not check a second time
    _close(got, sum(ref.variance_norms(d, q, 2.0) for d, q in zip(ds, qs)))
    ds2, qs2 = mk()
    got2 = ops.variance_norms_multi(ds2, qs2, 2.0, backend="triton")
    assert len(calls) == len(sizes)  # cached plan: no per-tensor checks
    _close(got2, sum(ref.variance_norms(d, q, 2.0) for d, q in zip(ds2, qs2)))
    # same signature, new addresses that overlap: the overlap check still runs
    g = torch.randn(10, generator=gen)
    buf = torch.zeros(40)
    fused.square_pack_multi([g, g], [buf[:20], buf[20:]])
    with pytest.raises(ValueError, match=r"^outs\[1\]: must not share memory with outs\[0\]"):
        fused.square_pack_multi([g, g], [buf[:20], buf[10:30]])


def test_pointer_tables_handed_out_during_capture_are_never_freed(gen, monkeypatch):
    """A CUDA graph keeps the device address of every table its launches read. A table
    handed out while the stream is capturing must outlive any later cache traffic; one
    handed out outside capture is evicted (and freed) after _TABLES_PER_PLAN newer ones."""
    import gc
    import weakref

    handed = []
    real = fused._tables
    monkeypatch.setattr(fused, "_tables", lambda *a, **k: handed.append(real(*a, **k)) or handed[-1])
    monkeypatch.setattr(fused, "_CUDA", True)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(fused, "MAX_PROGRAMS", 4098)  # a signature no other test used
    n = 33

    def call():
        g = torch.randn(n, generator=gen)
        out = torch.empty(2 * n)
        fused.square_pack_multi([g], [out])
        torch.testing.assert_close(out.double(), ref.square_pack(g), rtol=1e-6, atol=1e-30)
        return g, out  # keep the buffers alive: new calls get new addresses

    keep = [call()]
    plain = weakref.ref(handed[-1][0][1])  # device table handed out outside capture
    capturing[0] = True
    keep.append(call())
    pinned = weakref.ref(handed[-1][0][1])  # handed out during capture
    capturing[0] = False
    for _ in range(fused._TABLES_PER_PLAN + 4):
        keep.append(call())
    handed.clear()
    gc.collect()
    assert plain() is None  # evicted and freed: the cache is bounded
    assert pinned() is not None  # pinned for the process lifetime
    assert any(t[1] is pinned() for t in fused._PINNED_TABLES)
