"""Attack suite: the fused ops (public faces on every CPU backend, and the raw torch ops).

Every rejected input must raise a clear error that names the argument; every accepted
input must agree with gns_kernels.reference (float64). Inputs: wrong types and dtypes,
meta and mixed devices, wrong sizes, non-contiguous views, aliasing (also across the
lists of the *_multi ops), empty tensors, huge / tiny values, NaN and inf.
"""
from __future__ import annotations

import math

import pytest
import torch

import gns_kernels as gk
from gns_kernels.stats import estimate_from_stats
from gns_kernels import ops
from gns_kernels import reference as ref

pytestmark = pytest.mark.skipif(not ops.cpp_available(), reason="C++ extension not built")

BACKENDS = ["cpp", "eager"]
N = 37


def _close(got, want, rtol=1e-5):
    """got (float32 op result) against the float64 reference: equal where the reference is
    finite in float32; non-finite (inf or NaN: float32 intermediates such as d^2 may
    overflow where float64 does not, turning inf - inf into NaN) where it is not."""
    want = want.to(torch.float32).double()
    got = got.double()
    bad = ~torch.isfinite(want)
    assert (~torch.isfinite(got[bad])).all(), (got, want)
    got, want = got[~bad], want[~bad]
    atol = 1e-6 * max(1.0, float(want.abs().max()) if want.numel() else 1.0)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------------------
# bad arguments: (op, which argument, replacement, expected exception, message pattern)
# ----------------------------------------------------------------------------------------
def _vn_args():
    return {"mean_grad": torch.randn(N), "mean_sq": torch.rand(N) + 1, "shift": torch.randn(N)}


def _sp_args():
    return {"grad": torch.randn(N), "out": torch.empty(2 * N), "shift": torch.randn(N)}


def _acc_args():
    return {"grad": torch.randn(N), "prev": torch.randn(N), "sq": torch.rand(N)}


def _call(op, a, backend):
    if op == "variance_norms":
        return gk.variance_norms(a["mean_grad"], a["mean_sq"], 2.0, a["shift"], backend=backend)
    if op == "square_pack":
        return gk.square_pack(a["grad"], a["out"], a["shift"], backend=backend)
    if op == "accumulate_sq":
        return gk.accumulate_sq(a["grad"], a["prev"], a["sq"], backend=backend)
    raise AssertionError(op)


_ARGS = {"variance_norms": _vn_args, "square_pack": _sp_args, "accumulate_sq": _acc_args}
_FLOAT32_ONLY = {("square_pack", "out"), ("accumulate_sq", "sq")}


def _bad_cases():
    for op, make in _ARGS.items():
        for name in make():
            size = 2 * N if name == "out" else N
            yield op, name, "float64", lambda s=size: torch.randn(s, dtype=torch.float64), TypeError, "expected dtype"
            yield op, name, "int32", lambda s=size: torch.ones(s, dtype=torch.int32), TypeError, "expected dtype"
            yield op, name, "bool", lambda s=size: torch.ones(s, dtype=torch.bool), TypeError, "expected dtype"
            yield op, name, "list", lambda s=size: [0.0] * s, TypeError, "expected a torch.Tensor"
            yield op, name, "noncontig", lambda s=size: torch.randn(2 * s)[::2], ValueError, "contiguous"
            if name not in ("mean_grad", "grad"):  # the first tensor sets the size
                yield op, name, "short", lambda s=size: torch.randn(s - 1), ValueError, "elements"
            if name not in ("mean_grad", "grad"):
                yield op, name, "meta", lambda s=size: torch.empty(s, device="meta"), ValueError, "device"
            if (op, name) not in _FLOAT32_ONLY:
                continue
            yield op, name, "bfloat16", lambda s=size: torch.randn(s).bfloat16(), TypeError, "float32"


_BAD = list(_bad_cases())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,name,kind,make,exc,pat", _BAD, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in _BAD])
def test_bad_argument_named(op, name, kind, make, exc, pat, backend):
    a = _ARGS[op]()
    a[name] = make()
    with pytest.raises(exc, match=rf"^{name}: .*{pat}|^{name}: {pat}"):
        _call(op, a, backend)


@pytest.mark.parametrize("op", ["variance_norms", "variance_norms_multi", "square_pack", "accumulate_sq",
                                "accumulate_sq_multi"])
def test_scale_and_list_types(op):
    x = torch.randn(N)
    if op.startswith("variance_norms"):
        for bad, exc in ((True, TypeError), ("2", TypeError), (None, TypeError), (torch.tensor(2.0), TypeError)):
            with pytest.raises(exc, match="^scale"):
                if op == "variance_norms":
                    gk.variance_norms(x, x, bad)
                else:
                    gk.variance_norms_multi([x], [x], bad)
    if op.endswith("_multi"):
        fn = (lambda a: gk.variance_norms_multi(a, [x], 1.0)) if op.startswith("variance") else \
             (lambda a: gk.accumulate_sq_multi(a, [x.clone()], [x.clone()]))
        first = "mean_grads" if op.startswith("variance") else "grads"
        with pytest.raises(TypeError, match=f"^{first}: expected a list"):
            fn(x)
        second = "mean_sqs" if op.startswith("variance") else "prevs"
        with pytest.raises(ValueError, match=f"^{second}: expected 2 tensors like {first}, got 1"):
            fn([x, x])


_BAD_SCALES = [-4.0, -1e-30, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), 3.5e38, 1e300, -2]


@pytest.mark.parametrize("backend", BACKENDS + ["raw"])
@pytest.mark.parametrize("scale", _BAD_SCALES, ids=[repr(s) for s in _BAD_SCALES])
@pytest.mark.parametrize("call", ["single", "multi"])
def test_scale_out_of_range_refused_on_every_path(scale, call, backend):
    """A negative scale gave noise 0 (`variance_norms(m, sq, -4.0)` -> [0, 5.72, 0, 4.97]):
    every path (the public faces on each backend, and the C++ ops called raw) refuses
    scale <= 0, NaN, inf and values float32 cannot hold, as nuclear_stats refuses scale
    <= 0, with a ValueError naming `scale`."""
    m, sq = torch.randn(N), torch.rand(N) + 1
    if backend == "raw":
        fn = {"single": lambda: torch.ops.gns_kernels.variance_norms(m, sq, scale, None),
              "multi": lambda: torch.ops.gns_kernels.variance_norms_multi([m], [sq], scale, [])}[call]
    else:
        fn = {"single": lambda: gk.variance_norms(m, sq, scale, backend=backend),
              "multi": lambda: gk.variance_norms_multi([m, m], [sq, sq], scale, backend=backend)}[call]
    with pytest.raises(ValueError, match=r"^scale: expected a positive finite number"):
        fn()
    if not (scale > 0 and math.isfinite(scale)):  # the rule nuclear_stats already had
        with pytest.raises(ValueError, match=r"^scale: expected a positive finite number"):
            gk.nuclear_stats([torch.eye(3)], [torch.zeros(3, 4)], scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_scale_in_range_accepted(scale, backend):
    m, sq = torch.randn(N, dtype=torch.float64).float(), (torch.rand(N) + 1)
    got = gk.variance_norms(m, sq, scale, backend=backend)
    want = ref.variance_norms(m.double(), sq.double(), scale)
    _close(got, want)


def test_backend_name_and_env(monkeypatch):
    x = torch.randn(N)
    with pytest.raises(ValueError, match="^backend: expected one of"):
        gk.variance_norms(x, x, 1.0, backend="cuda")
    monkeypatch.setenv("GNS_KERNELS_BACKEND", "fast")
    with pytest.raises(ValueError, match="GNS_KERNELS_BACKEND"):
        gk.variance_norms(x, x, 1.0)


# ----------------------------------------------------------------------------------------
# aliasing
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS + ["raw"])
@pytest.mark.parametrize("case", ["sq=sq", "prev=prev", "prev=grad_other", "sq=prev_other", "sq_overlaps_grad_tail"])
def test_multi_aliasing_refused_and_nothing_written(case, backend):
    n = 1000
    g = [torch.randn(n) for _ in range(2)]
    p = [torch.randn(n) for _ in range(2)]
    s = [torch.rand(n) for _ in range(2)]
    if case == "sq=sq":
        s[1] = s[0]
        pat = r"^sqs\[1\]: must not share memory with sqs\[0\]"
    elif case == "prev=prev":
        p[1] = p[0]
        pat = r"^prevs\[1\]: must not share memory with prevs\[0\]"
    elif case == "prev=grad_other":
        p[0] = g[1]
        pat = r"^prevs\[0\]: must not share memory with grads\[1\]"
    elif case == "sq=prev_other":
        s[1] = p[0]
        pat = r"^sqs\[1\]: must not share memory with prevs\[0\]"
    else:
        buf = torch.randn(2 * n)
        g[0] = buf[:n]
        s[1] = buf[n - 1: 2 * n - 1]
        pat = r"^sqs\[1\]: must not share memory with grads\[0\]"
    snap = [t.clone() for t in g + p + s]
    call = torch.ops.gns_kernels.accumulate_sq_multi if backend == "raw" else \
        (lambda *a: gk.accumulate_sq_multi(*a, backend=backend))
    with pytest.raises(ValueError, match=pat):
        call(g, p, s)
    assert all(torch.equal(a, b) for a, b in zip(snap, g + p + s))  # nothing was written


@pytest.mark.parametrize("backend", BACKENDS + ["raw"])
def test_single_op_aliasing(backend):
    buf = torch.zeros(4 * N)
    raw = backend == "raw"
    sp = torch.ops.gns_kernels.square_pack if raw else (lambda *a: gk.square_pack(*a, backend=backend))
    acc = torch.ops.gns_kernels.accumulate_sq if raw else (lambda *a: gk.accumulate_sq(*a, backend=backend))
    with pytest.raises(ValueError, match="^out: must not share memory with grad"):
        sp(buf[N: 2 * N], buf[:2 * N], None)
    with pytest.raises(ValueError, match="^out: must not share memory with shift"):
        sp(torch.randn(N), buf[:2 * N], buf[2 * N - 1: 3 * N - 1])
    with pytest.raises(ValueError, match="^sq: must not share memory with prev"):
        acc(torch.randn(N), buf[:N], buf[N - 1: 2 * N - 1])
    x = torch.randn(N)
    with pytest.raises(ValueError, match="^prev: must not share memory with grad"):
        acc(x, x, torch.zeros(N))
    # inputs may alias each other: variance_norms(d, d) and square_pack(g, out, g)
    out = torch.empty(2 * N)
    sp(x, out, x)
    assert torch.equal(out, torch.zeros(2 * N))


# ----------------------------------------------------------------------------------------
# accepted inputs against the reference: empty, huge, tiny, NaN, inf, every dtype
# ----------------------------------------------------------------------------------------
_VALUES = {
    "unit": lambda g: torch.randn(N, generator=g),
    "tiny": lambda g: torch.randn(N, generator=g) * 1e-20,
    "huge": lambda g: torch.randn(N, generator=g) * 1e15,
    "overflow": lambda g: torch.randn(N, generator=g) * 1e30,
    "nan": lambda g: torch.where(torch.arange(N) == 3, float("nan"), torch.randn(N, generator=g)),
    "inf": lambda g: torch.where(torch.arange(N) == 5, float("inf"), torch.randn(N, generator=g)),
    "-inf": lambda g: torch.where(torch.arange(N) == 0, float("-inf"), torch.randn(N, generator=g)),
    "subnormal": lambda g: torch.full((N,), 1e-40),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", sorted(_VALUES))
def test_values_against_reference(kind, dtype, backend, gen):
    d = _VALUES[kind](gen).to(dtype)
    q = (d.float() * d.float() + torch.rand(N, generator=gen)).to(dtype)
    s = torch.randn(N, generator=gen).to(dtype)
    _close(gk.variance_norms(d, q, 3.0, s, backend=backend), ref.variance_norms(d, q, 3.0, s))
    _close(gk.variance_norms_multi([d, q], [q, q], 3.0, [s, None], backend=backend),
           ref.variance_norms(d, q, 3.0, s) + ref.variance_norms(q, q, 3.0))
    out = torch.empty(2 * N)
    gk.square_pack(d, out, s, backend=backend)
    _close(out, ref.square_pack(d, s), rtol=1e-6)
    prev, sq = torch.randn(N, generator=gen).to(dtype), torch.rand(N, generator=gen)
    want_sq, want_prev = ref.accumulate_sq(d, prev, sq)
    gk.accumulate_sq(d, prev, sq, backend=backend)
    _close(sq, want_sq, rtol=1e-6)
    assert torch.equal(prev.double(), want_prev.to(dtype).double()) or torch.equal(
        prev.isnan(), want_prev.isnan())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_never_becomes_finite(backend):
    d = torch.randn(N)
    q = d * d + 1
    q[4] = float("nan")
    r = gk.variance_norms(d, q, 2.0, backend=backend)
    assert math.isnan(r[0]) and math.isnan(r[2]) and math.isfinite(r[1]) and math.isfinite(r[3])
    est = estimate_from_stats("l2", r[2], r[3], 2, 2)
    assert not est.valid and math.isnan(est.gns)


@pytest.mark.parametrize("backend", BACKENDS + ["raw"])
def test_empty(backend):
    e = torch.empty(0)
    raw = backend == "raw"
    if raw:
        assert torch.equal(torch.ops.gns_kernels.variance_norms(e, e, 2.0, None), torch.zeros(4))
        torch.ops.gns_kernels.accumulate_sq_multi([e, e], [e.clone(), e.clone()], [e.clone(), e.clone()])
        return
    assert torch.equal(gk.variance_norms(e, e, 2.0, e, backend=backend), torch.zeros(4))
    assert torch.equal(gk.variance_norms_multi([], [], 2.0, backend=backend), torch.zeros(4))
    assert torch.equal(gk.variance_norms_multi([e, e], [e, e], 2.0, backend=backend), torch.zeros(4))
    gk.square_pack(e, torch.empty(0), backend=backend)
    gk.accumulate_sq(e, e.clone(), e.clone(), backend=backend)
    gk.accumulate_sq_multi([], [], [], backend=backend)
    # empty tensors share no memory: the same empty tensor everywhere is fine
    gk.accumulate_sq_multi([e, e], [e, e], [e, e], backend=backend)


def test_repeated_calls_bitwise_and_thread_invariant(gen):
    n = (1 << 17) + 11
    d = torch.randn(n, generator=gen)
    q = d * d + torch.rand(n, generator=gen)
    before = torch.get_num_threads()
    try:
        res = []
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            res.append(gk.variance_norms(d, q, 2.0))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(res[0], r) for r in res[1:])
