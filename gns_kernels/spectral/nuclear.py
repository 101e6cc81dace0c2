"""Per-layer nuclear (S1) statistics from reduced Grams: noise tr(C^{1/2}) and signal ||G||_S1.

Notation: per layer a gradient matrix G (m x n), samples j = 1..R (ranks, or ranks x
micro-batches), each the mean gradient over B/R examples, and an optional shift S
identical on all samples.

    Gram side      'row' (m x m) or 'col' (n x n); the package uses the smaller side
                   (row when m <= n), k = min(m, n)
    covariance     C = scale * (mean_j (G^j - S)(G^j - S)^T - D D^T) on that side,
                   D = mean_j G^j - S, scale = B/(R-1)
    noise          tr(C^{1/2})     (units: gradient units x sqrt(examples))
    signal         ||G||_S1 = tr((G G^T)^{1/2}) = tr((G^T G)^{1/2})   (gradient units)

The signal is the same on both sides. The noise is not in general: C_row and C_col have
the same nonzero eigenvalues only for R = 2 (then C = scale/2 E E^T with E = G^1 - G^2 on
the row side, and scale/2 E^T E on the column side); for R > 2 the two sides differ, and
this package's definition is the smaller side. (The paper's analysis does not fix a side.)

Entry points: ``nuclear_stats`` (mean gradients D given: DDP, MicroBatchGNS, single
process) and ``nuclear_stats_from_grams`` (only the Gram D D^T given: FSDP2, where each
rank holds a shard of D).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ._checks import check_square, validate_requested, validate_symmetric
from .eigh import EIGH_TOL
from .grams import grams64_on_sides, grams_on_sides
from .hints import EigHints
from .newton import check_newton_args, newton_min_iters
from .trace import METHODS, NEWTON_METHODS, newton_precision, resolve_method
from .._validation import check_signal

# (iters, eps) of the noise matrices' Newton solve (float64 matmuls, positive-part
# projection): the shift 1e-11 relative to ||C||_F -- four decades below the rounding of
# the float32 operands C is formed from (6e-8 ||scale mean Gram||_F >= 6e-8 ||C||_F),
# where the eigenvalues it soft-thresholds are noise already -- and one iteration past
# newton_min_iters(1e-11) = 19 (the smallest eigenvalue's scalar recursion is then at
# 1 - 1e-14). Measured on a random family of steep spectra (tests/spectral/
# test_newton_steep.py, 45 cases, sides 64-256): within max(1e-3, 2 e_in) of float64
# eigh of the same inputs, worst err / bound 5.5e-5 (error 5.5e-8), the same as the
# earlier (24 iterations, 1e-12) chain, with 20 instead of 24 coupled, 35 instead of 38
# sign steps and 30 instead of 32 pair nodes (bench/RESULTS.md, "fewer float64
# products"); the float32 iteration with the shift relative to the subtraction's
# operands was up to 13x over that bound.
NOISE_EPS = 1e-11
NOISE_NEWTON = check_newton_args(newton_min_iters(NOISE_EPS) + 1, NOISE_EPS, "float64")

Tensor = torch.Tensor

__all__ = ["nuclear_stats", "nuclear_stats_from_grams", "nuclear_stats_select", "nuclear_stats_from_grams_select"]


def _check_common(scale, bias_correction, num_samples, method: str, eig_hints) -> None:
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    if bias_correction and num_samples is None:
        raise ValueError("num_samples: bias_correction=True needs the number of samples R")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number (B/(R-1)), got {scale!r}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    if eig_hints is not None and not isinstance(eig_hints, EigHints):
        raise ValueError(f"eig_hints: expected a gns_kernels.spectral.EigHints, got {type(eig_hints).__name__}")


def _debias(signal: str, scale: float, batch_size) -> float | None:
    """c = scale / B for signal='debiased' (the signal matrix G G^T - C / B), else None."""
    if check_signal(signal) == "raw":
        return None
    try:
        B = float(batch_size)
    except (TypeError, ValueError):
        B = math.nan
    if not (math.isfinite(B) and B > 0):
        raise ValueError(f"batch_size: signal='debiased' needs the global batch size B > 0, got {batch_size!r}")
    return float(scale) / B


def _check_gram(A, name: str) -> int:
    check_square(A, name)
    if A.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D k x k matrix, got shape {tuple(A.shape)}")
    return A.shape[-1]


def _merge_other_dims(other_dims, others: list, L: int) -> list:
    if other_dims is None:
        return others
    other_dims = list(other_dims)
    if len(other_dims) != L:
        raise ValueError(f"other_dims: expected {L} entries, got {len(other_dims)}")
    return [o if o is not None else d for o, d in zip(other_dims, others)]


def nuclear_stats(
    mean_grams: Sequence[Tensor],
    mean_grads: Sequence[Tensor],
    scale: float = 1.0,
    shifts: Sequence[Tensor | None] | None = None,
    *,
    side: str = "auto",
    bias_correction: bool = False,
    num_samples: int | None = None,
    batch_size: float | None = None,
    other_dims: Sequence[int | None] | None = None,
    dof_model: str = "columns",
    method: str = "auto",
    validate: bool = False,
    eig_hints: EigHints | None = None,
    signal: str = "raw",
) -> tuple[Tensor, Tensor]:
    """Per layer l: (noise tr(C_l^{1/2}), signal ||G_l||_S1); two float32 Tensor[L].

    C_l = scale * (mean_grams[l] - D_l D_l^T) on the Gram side of mean_grams[l] (k x k):
      mean_grams[l]  mean over samples of the (shifted) local Grams, k x k, e.g. the
                     all-reduced output of gram() divided by R;
      mean_grads[l]  D_l = mean over samples of G^j - S_l, 2-D (m x n). The side is that
                     of mean_grams[l] (k == m: row, k == n: col; ``side`` only breaks the
                     tie of a square matrix whose Grams were taken on the column side);
      shifts[l]      S_l or None: the signal is ||D_l + S_l||_S1.
    scale = B/(R-1) (global batch over samples minus one).
    bias_correction: False (default: the paper's raw tr(C^{1/2})) or True: the noise is
      gns_kernels.bias.nuclear_sqrt_trace_corrected(eigenvalues of C, num_samples,
      batch_size, other_dim=other_dims[l] (default: the other side of mean_grads[l]),
      dof_model=dof_model); needs num_samples (R). Method 'eigh' corrects from the
      eigenvalues; method 'newton' from the Newton trace and the pair sum
      sum_ij s_i s_j / (s_i + s_j) (gns_kernels.spectral.sqrt_trace_pair_sum), the same
      value to about 1e-4 relative, with matmuls only (no eigensolver, no host sync).
    method: sqrt-trace method for noise and signal ('auto' | 'eigh' | 'newton'), see
      sqrt_trace. With 'newton' the shift of C is relative to ||scale * mean_grams||_F
      (the subtraction's rounding level), not to ||C||_F.
    eig_hints (method 'eigh', CPU): a gns_kernels.spectral.EigHints keyed by the shape of
      mean_grads[l]: hinted layers are solved in float64 directly, and what each layer
      needed is recorded into it (applied at its apply(); nothing is recorded when the
      'newton' method is used). Reads the solver's flags (not traceable by
      torch.compile); leave None there.
    C may come out slightly indefinite (float32 subtraction): eigenvalues below 0 count 0.
    A layer with k = 0 (an empty side) contributes noise 0 and signal 0.
    Layers are batched by Gram size (one op call per size). No host synchronization
    unless validate=True (or env GNS_KERNELS_VALIDATE=1): then inputs are checked for
    finiteness and symmetry. Non-finite inputs give NaN for that layer.
    signal: 'raw' (default): ||G_l||_S1; 'debiased': tr((G_l G_l^T - C_l / B)_+^{1/2}) on
      the Gram side (G G^T - C / B is unbiased for E[G] E[G]^T; needs batch_size B;
      gns_kernels.nuclear_dof.nuclear_signal_debiased).
    """
    noise, sig, _ = nuclear_stats_select(
        mean_grams, mean_grads, scale, shifts, side=side, bias_correction=bias_correction,
        num_samples=num_samples, batch_size=batch_size, other_dims=other_dims,
        dof_model=dof_model, method=method, validate=validate, eig_hints=eig_hints,
        signal=signal)
    return noise, sig


def nuclear_stats_select(
    mean_grams: Sequence[Tensor],
    mean_grads: Sequence[Tensor],
    scale: float = 1.0,
    shifts: Sequence[Tensor | None] | None = None,
    *,
    side: str = "auto",
    bias_correction: bool = False,
    num_samples: int | None = None,
    batch_size: float | None = None,
    other_dims: Sequence[int | None] | None = None,
    dof_model: str = "columns",
    method: str = "auto",
    validate: bool = False,
    eig_hints: EigHints | None = None,
    select: tuple[Sequence[bool], Sequence[bool]] | None = None,
    record_hints: bool = True,
    signal: str = "raw",
    return_sums: bool = False,
    cov_out: list | None = None,
):
    """nuclear_stats solving only the selected sqrt-traces: (noise[L], signal[L], used64).

    select: None (all) or (noise_mask, signal_mask), L bools each: only the selected noise
      tr(C_l^{1/2}) / signal ||G_l||_S1 are computed; the others are 0 (no work is done for
      them: a layer with neither selected costs nothing but its argument checks).
    record_hints: True records the eigensolver report into eig_hints (a host read of the
      solver's flags, as nuclear_stats); False leaves eig_hints untouched and returns the
      report instead, so a caller can combine the reports of several processes first.
    used64: bool Tensor[L] on the Grams' device, True where a selected eigenproblem of layer
      l was solved in float64 (method 'eigh'; None with 'newton', which reports nothing).
    return_sums: True returns (noise, signal, used64, sums): noise is then the raw
      tr(C_l^{1/2}) (no correction here, whatever bias_correction says) and sums a float64
      Tensor[4, L] of the selected noise matrices' [tr C^{1/2}, pair sum
      sum_ij s_i s_j / (s_i + s_j), tr C, ||C||_F^2] (0 elsewhere): what a correction with
      a dof known only later needs (bias.nuclear_sqrt_trace_corrected_from_sums; the
      hooks' 'gauss-sums' dof, formed after their share all-reduce).
    cov_out: None, or a list to which (l, C_l) is appended for every selected noise matrix
      in ascending l, C_l = scale (mean_gram_l - D_l D_l^T) (k x k, float32, or float64
      when a Gram is): the covariance the noise solves, for a caller that keeps it (the
      hooks' noise pool).
    Everything else as nuclear_stats.
    """
    mean_grams = list(mean_grams)
    L = len(mean_grams)
    if mean_grads is None:
        raise ValueError("mean_grads: expected one 2-D tensor per mean_grams entry, got None "
                         "(with only the Gram of the mean gradient use nuclear_stats_from_grams)")
    mean_grads = list(mean_grads)
    if len(mean_grads) != L:
        raise ValueError(f"mean_grads: expected {L} tensors (one per mean_grams entry), got {len(mean_grads)}")
    if shifts is not None:
        shifts = list(shifts)
        if len(shifts) != L:
            raise ValueError(f"shifts: expected {L} entries (tensor or None), got {len(shifts)}")
    if side not in ("auto", "row", "col"):
        raise ValueError(f"side: expected 'auto', 'row' or 'col', got {side!r}")
    _check_common(scale, bias_correction, num_samples, method, eig_hints)

    sides: list[str] = []
    others: list[int | None] = []
    for l, A in enumerate(mean_grams):
        k = _check_gram(A, f"mean_grams[{l}]")
        D = mean_grads[l]
        if not isinstance(D, Tensor) or D.dim() != 2:
            raise ValueError(f"mean_grads[{l}]: expected a 2-D tensor, got "
                             f"{tuple(D.shape) if isinstance(D, Tensor) else type(D).__name__}")
        if not D.is_floating_point():
            raise ValueError(f"mean_grads[{l}]: expected a floating dtype, got {D.dtype}")
        m, n = D.shape
        if m == n == k:
            s = "col" if side == "col" else "row"
        elif m == k:
            s = "row"
        elif n == k:
            s = "col"
        else:
            raise ValueError(f"mean_grams[{l}]: {k}x{k} does not match either side of mean_grads[{l}] "
                             f"of shape {(m, n)}")
        sides.append(s)
        others.append(n if s == "row" else m)
        if shifts is not None and shifts[l] is not None and tuple(shifts[l].shape) != (m, n):
            raise ValueError(f"shifts[{l}]: expected shape {(m, n)} like mean_grads[{l}], got "
                             f"{tuple(shifts[l].shape)}")
    others = _merge_other_dims(other_dims, others, L)
    want_n, want_s = _check_select(select, L)
    if L == 0:
        z = torch.zeros(0, dtype=torch.float32)
        return (z, z.clone(), None) + ((torch.zeros((4, 0), dtype=torch.float64),) if return_sums else ())

    if validate_requested(validate):
        for l in range(L):
            validate_symmetric(mean_grams[l], f"mean_grams[{l}]")
            if not bool(torch.isfinite(mean_grads[l]).all()):
                raise ValueError(f"mean_grads[{l}]: contains non-finite values")

    # D D^T (for the noise, and the signal when unshifted) and G G^T (G = D + S), batched by
    # shape; only those a selected sqrt-trace needs
    shifted = {l for l in range(L) if shifts is not None and shifts[l] is not None}
    debias = _debias(signal, scale, batch_size)  # the debiased signal also needs D D^T
    need_dd = [l for l in range(L) if want_n[l] or (want_s[l] and (l not in shifted or debias is not None))]
    dd: list = [None] * L
    meth = resolve_method(method, mean_grams[0].device)
    # the Newton path: D D^T in float64 (grams64_on_sides; NOISE_NEWTON)
    on_sides = grams64_on_sides if meth in NEWTON_METHODS else grams_on_sides
    for l, G in zip(need_dd, on_sides([mean_grads[l] for l in need_dd], [sides[l] for l in need_dd])):
        dd[l] = G
    gg = list(dd)
    need_gg = [l for l in sorted(shifted) if want_s[l]]
    if need_gg:
        gs = grams_on_sides([mean_grads[l].float() + shifts[l].float() for l in need_gg],
                            [sides[l] for l in need_gg])
        for l, G in zip(need_gg, gs):
            gg[l] = G
    shapes = [tuple(D.shape) for D in mean_grads]
    _covariances(mean_grams, dd, float(scale), want_n, cov_out)
    return _solve(mean_grams, dd, gg, float(scale), others, meth,
                  bias_correction, num_samples, batch_size, dof_model, eig_hints, shapes,
                  want_n, want_s, record_hints, bool(return_sums), debias)


def _covariances(mean_grams: list, dd: list, scale: float, want_n: list, cov_out) -> None:
    """Append (l, scale (mean_grams[l] - dd[l])) for the selected noise matrices to cov_out."""
    if cov_out is None:
        return
    for l, want in enumerate(want_n):
        if want:
            A = _plain(mean_grams[l])
            cdt = torch.float64 if A.dtype == torch.float64 or dd[l].dtype == torch.float64 else torch.float32
            cov_out.append((l, (A.to(cdt) - _plain(dd[l]).to(cdt)).mul_(scale)))


def _check_select(select, L: int) -> tuple[list, list]:
    """(noise_mask, signal_mask) of select (None: everything), checked."""
    if select is None:
        return [True] * L, [True] * L
    if not (isinstance(select, (tuple, list)) and len(select) == 2):
        raise ValueError("select: expected (noise_mask, signal_mask), two sequences of bools")
    out = []
    for name, mask in zip(("noise_mask", "signal_mask"), select):
        mask = list(mask)
        if len(mask) != L or not all(isinstance(b, bool) for b in mask):
            raise ValueError(f"select: expected {name} as {L} bools (one per layer), got {mask!r}")
        out.append(mask)
    return out[0], out[1]


def nuclear_stats_from_grams(
    mean_grams: Sequence[Tensor],
    mean_grad_grams: Sequence[Tensor],
    scale: float = 1.0,
    *,
    signal_grams: Sequence[Tensor] | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    bias_correction: bool = False,
    num_samples: int | None = None,
    batch_size: float | None = None,
    other_dims: Sequence[int | None] | None = None,
    dof_model: str = "columns",
    method: str = "auto",
    validate: bool = False,
    eig_hints: EigHints | None = None,
    signal: str = "raw",
) -> tuple[Tensor, Tensor]:
    """nuclear_stats when only the Gram of the mean gradient exists (FSDP2: each rank holds
    a shard of D). Two float32 Tensor[L].

    mean_grams[l]       mean over samples of the (shifted) local Grams, k x k;
    mean_grad_grams[l]  D_l D_l^T on the same side, k x k (D_l = mean shifted gradient;
                        under sharding, the sum of the shards' Grams);
    signal_grams[l]     the Gram of G_l = D_l + S_l on the same side, or None when no shift
                        was used (the signal then uses mean_grad_grams[l]);
    shapes[l]           the parameter shape (m, n) of layer l, one side equal to k: the
                        key of eig_hints (required with it) and the default other_dims
                        (the side that is not k).
    Everything else as nuclear_stats.
    """
    noise, sig, _ = nuclear_stats_from_grams_select(
        mean_grams, mean_grad_grams, scale, signal_grams=signal_grams, shapes=shapes,
        bias_correction=bias_correction, num_samples=num_samples, batch_size=batch_size,
        other_dims=other_dims, dof_model=dof_model, method=method, validate=validate,
        eig_hints=eig_hints, signal=signal)
    return noise, sig


def nuclear_stats_from_grams_select(
    mean_grams: Sequence[Tensor],
    mean_grad_grams: Sequence[Tensor],
    scale: float = 1.0,
    *,
    signal_grams: Sequence[Tensor] | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    bias_correction: bool = False,
    num_samples: int | None = None,
    batch_size: float | None = None,
    other_dims: Sequence[int | None] | None = None,
    dof_model: str = "columns",
    method: str = "auto",
    validate: bool = False,
    eig_hints: EigHints | None = None,
    select: tuple[Sequence[bool], Sequence[bool]] | None = None,
    record_hints: bool = True,
    signal: str = "raw",
    return_sums: bool = False,
    cov_out: list | None = None,
    project: bool = False,
    pool_fold=None,
):
    """nuclear_stats_from_grams solving only the selected sqrt-traces: (noise[L],
    signal[L], used64); select, record_hints, used64, signal, return_sums and cov_out as
    nuclear_stats_select. project: kept for callers; no effect since the Newton path
    solves the noise matrices' positive part in float64 (NOISE_NEWTON; with method
    'newton-tf32' only when a correction needs their pair sums, else in the TF32 chain), which the
    pool's averaged covariances needed already (their negative rounding eigenvalues made
    the old shifted float32 iteration lose the pair sum: inf / NaN at a negative
    eigenvalue of 1e-4 ||C||). The eigenvalue path clamps them either way.
    pool_fold (method 'newton' only, with return_sums): None, or a callable
    (ls, C) -> P called once per Gram size with the selected noise matrices' layer indices
    ls (ascending) and their covariances C (len(ls), k, k, float64); it returns the pooled
    matrices P (same shape) whose sqrt-traces and pair sums join the same Newton chain as
    the noise and signal matrices. Their float64 [tr P^{1/2}, pair sum] per layer (0 where
    not selected) are then appended to the returned tuple (a Tensor[2, L])."""
    mean_grams = list(mean_grams)
    L = len(mean_grams)
    if mean_grad_grams is None:
        raise ValueError("mean_grad_grams: expected one k x k Gram per mean_grams entry, got None")
    mean_grad_grams = list(mean_grad_grams)
    if len(mean_grad_grams) != L:
        raise ValueError(f"mean_grad_grams: expected {L} tensors, got {len(mean_grad_grams)}")
    if signal_grams is not None:
        signal_grams = list(signal_grams)
        if len(signal_grams) != L:
            raise ValueError(f"signal_grams: expected {L} tensors, got {len(signal_grams)}")
    _check_common(scale, bias_correction, num_samples, method, eig_hints)
    if shapes is not None:
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if len(shapes) != L:
            raise ValueError(f"shapes: expected {L} parameter shapes, got {len(shapes)}")
    elif eig_hints is not None:
        raise ValueError("shapes: eig_hints needs the parameter shape of every layer")
    others: list[int | None] = []
    for l, A in enumerate(mean_grams):
        k = _check_gram(A, f"mean_grams[{l}]")
        for name, lst in (("mean_grad_grams", mean_grad_grams), ("signal_grams", signal_grams)):
            if lst is not None and (not isinstance(lst[l], Tensor) or tuple(lst[l].shape) != (k, k)):
                got = tuple(lst[l].shape) if isinstance(lst[l], Tensor) else type(lst[l]).__name__
                raise ValueError(f"{name}[{l}]: expected shape {(k, k)} like mean_grams[{l}], got {got}")
        if shapes is not None:
            if len(shapes[l]) != 2 or k not in shapes[l]:
                raise ValueError(f"shapes[{l}]: expected a 2-D shape with one side {k} like mean_grams[{l}], "
                                 f"got {shapes[l]}")
            m, n = shapes[l]
            others.append(n if m == k else m)
        else:
            others.append(None)
    others = _merge_other_dims(other_dims, others, L)
    want_n, want_s = _check_select(select, L)
    if L == 0:
        z = torch.zeros(0, dtype=torch.float32)
        return (z, z.clone(), None) + ((torch.zeros((4, 0), dtype=torch.float64),) if return_sums else ())
    if validate_requested(validate):
        for l in range(L):
            validate_symmetric(mean_grams[l], f"mean_grams[{l}]")
            validate_symmetric(mean_grad_grams[l], f"mean_grad_grams[{l}]")
            if signal_grams is not None:
                validate_symmetric(signal_grams[l], f"signal_grams[{l}]")
    gg = signal_grams if signal_grams is not None else mean_grad_grams
    meth = resolve_method(method, mean_grams[0].device)
    if pool_fold is not None and not (meth in NEWTON_METHODS and return_sums):
        raise ValueError("pool_fold: needs method 'newton' and return_sums=True")
    _covariances(mean_grams, mean_grad_grams, float(scale), want_n, cov_out)
    return _solve(mean_grams, mean_grad_grams, list(gg), float(scale), others,
                  meth, bias_correction, num_samples,
                  batch_size, dof_model, eig_hints, shapes, want_n, want_s, record_hints,
                  bool(return_sums), _debias(signal, scale, batch_size), pool_fold)


def _solve(mean_grams: list, dd: list, gg: list, scale: float, others: list, meth: str,
           bias_correction: bool, num_samples, batch_size, dof_model: str,
           eig_hints: EigHints | None, shapes: list | None, want_n: list, want_s: list,
           record_hints: bool, sums: bool = False, debias: float | None = None,
           pool_fold=None):
    """noise / signal per layer from C_l = scale (mean_grams[l] - dd[l]) and gg[l] (the
    Gram of G_l), all k_l x k_l; noise and signal matrices of one size in one op call.
    Only the sqrt-traces selected by want_n / want_s are solved (the others are 0).
    sums: the noise is the raw tr(C^{1/2}) and a float64 (4, L) tensor of the selected
    noise matrices' [tr C^{1/2}, pair sum, tr C, ||C||_F^2] is returned as well (0 where
    not selected), for a correction formed later (the hooks' 'gauss-sums' dof).
    debias: None, or c = scale / B: the signal is tr((G G^T - C / B)_+^{1/2}) of the
    indefinite gg - c (mean_grams - dd) instead of ||G||_S1. (The Newton path projects the
    noise matrices always: NOISE_NEWTON.)
    Returns (noise, signal, used64) as nuclear_stats_select (plus the sums when sums)."""
    from ..stats.bias import pair_sum as _pair_sum

    L = len(mean_grams)
    hint = eig_hints.lookup(shapes) if eig_hints is not None else [False] * L
    cdt = torch.float64 if any(A.dtype == torch.float64 for A in mean_grams) else torch.float32
    noise: list = [None] * L
    signal: list = [None] * L
    dev0 = mean_grams[0].device
    extra: list = []  # the sums' [4, L] and the pool's [2, L] per Gram size, added at the end
    pooled: list = []
    correct = bias_correction and not sums  # correct here, from this solve's spectra

    def sig_matrix(l: int) -> Tensor:
        """The signal's matrix: gg, or gg - c (mean_gram - dd) (debias)."""
        if debias is None:
            return _plain(gg[l])
        A = _plain(gg[l]).to(cdt)
        return A - debias * (_plain(mean_grams[l]).to(cdt) - _plain(dd[l]).to(cdt))

    by_k: dict[int, list[tuple[str, int]]] = {}
    zeros: dict = {}
    for l in range(L):
        k = mean_grams[l].shape[-1]
        d = mean_grams[l].device
        zero = zeros.get(d)
        if zero is None:
            zero = zeros[d] = torch.zeros((), dtype=torch.float32, device=d)
        noise[l] = signal[l] = zero  # an empty side or not selected: 0
        if k == 0:  # an empty side: no noise, no signal
            continue
        by_k.setdefault(k, []).extend(
            ([("n", l)] if want_n[l] else []) + ([("s", l)] if want_s[l] else []))
    flagged: list[tuple[list, Tensor]] = []  # (items, solved-in-float64 flags) per size
    for k, items in by_k.items():
        if not items:
            continue
        # noise matrices first, then signal ones: each kind is a contiguous run of the
        # stacked batch below, taken as a slice (a list index would copy the index to the
        # device: a host sync inside the hooks' collective callbacks)
        items.sort(key=lambda it: it[0] != "n")
        if meth == "eigh":
            # C_l = scale * (mean_gram - D D^T) formed per matrix inside the op's workers
            lam, wide = torch.ops.gns_kernels.psd_eigvalsh_list(
                [(_plain(mean_grams[l]) if w == "n" else sig_matrix(l)) for w, l in items],
                [_plain(dd[l]) if w == "n" else None for w, l in items],
                [scale if w == "n" else 1.0 for w, l in items], float(EIGH_TOL),
                [bool(hint[l]) for w, l in items])
            flagged.append((items, wide))
            res = lam.clamp_min(0).sqrt().sum(-1)
            for i, (w, l) in enumerate(items):
                if w == "n" and correct:
                    from ..stats.bias import nuclear_sqrt_trace_corrected

                    noise[l] = nuclear_sqrt_trace_corrected(
                        lam[i], int(num_samples), batch_size, other_dim=others[l], dof_model=dof_model)
                elif w == "n":
                    noise[l] = res[i]
                    if sums:
                        lam64 = lam[i].to(torch.float64)
                        sq = lam64.clamp_min(0).sqrt()
                        if not extra:
                            extra.append(torch.zeros((4, L), dtype=torch.float64, device=dev0))
                        extra[0][:, l] = torch.stack([sq.sum(), _pair_sum(sq), lam64.sum(),
                                                      (lam64 * lam64).sum()]).to(dev0)
                else:
                    signal[l] = res[i]
            continue
        # newton: ONE chain per Gram size (float64 matmuls, positive-part projection,
        # NOISE_NEWTON) for the noise matrices C_l = scale (mean_gram - D D^T) (formed in
        # float64 from the float32 operands: accurate on steep spectra, where a float32
        # iteration with a shift at the subtraction's rounding level came out 2-13% low),
        # the pooled matrices (pool_fold) and the signal matrices, stacked in that order;
        # the pair sum only for the first two groups (when a correction needs it).
        n_ls = [l for w, l in items if w == "n"]
        # signal matrices: those that need the positive-part step first (the debiased
        # signal's indefinite matrix, a float32 Gram: rounding far above the 1e-11 shift),
        # then float64 Grams of float32 data (PSD to float64 rounding: no projection)
        s_all = [l for w, l in items if w != "n"]
        s_proj = [l for l in s_all if debias is not None or gg[l].dtype != torch.float64]
        s_ls = s_proj + [l for l in s_all if debias is None and gg[l].dtype == torch.float64]
        dev_k = mean_grams[items[0][1]].device
        parts = []
        if n_ls:
            Cn = torch.stack([_plain(mean_grams[l]) for l in n_ls]).double()
            Cn = Cn.sub_(torch.stack([_plain(dd[l]) for l in n_ls]).double()).mul_(scale)
            parts.append(Cn)
            if pool_fold is not None:
                parts.append(pool_fold(n_ls, Cn).to(dtype=torch.float64))
        n_rows = sum(p.shape[0] for p in parts)  # the noise and pooled rows, first
        n_pair = n_rows if (correct or sums) else 0
        smats = torch.stack([sig_matrix(l) for l in s_ls]).to(device=dev_k, dtype=torch.float64) if s_ls else None
        prec = newton_precision(meth)
        if prec == "tf32" and n_pair:
            # the pair sum needs S = A_+^{1/2} positive semidefinite to rounding; TF32
            # iterates perturb its near-zero eigenvalues by ~2^-11 ||S||, which its
            # quadrature (e^{-tS}) amplifies without bound: the matrices whose pair sum is
            # needed stay in the float64 chain, the others take the TF32 one
            mats = parts[0] if len(parts) == 1 else torch.cat(parts)
            it, ep = NOISE_NEWTON
            tr, pair = torch.ops.gns_kernels.newton_sqrt_trace_pair(mats, it, ep, None, True, "float64",
                                                                   "float64", n_pair)
            if smats is not None:
                it, ep = check_newton_args(None, None, prec)
                tr = torch.cat([tr, torch.ops.gns_kernels.newton_sqrt_trace(smats, it, ep, None, True, prec)])
        else:
            n_proj = n_rows + len(s_proj)
            if smats is not None:
                parts.append(smats)
            mats = parts[0] if len(parts) == 1 else torch.cat(parts)
            it, ep = NOISE_NEWTON if prec == "float64" else check_newton_args(None, None, prec)
            tr, pair = torch.ops.gns_kernels.newton_sqrt_trace_pair(
                mats, it, ep, None, True, prec, "float64", n_pair, n_proj if prec == "float64" else -1)
        nn = len(n_ls)
        if s_ls:
            _put(signal, s_ls, tr[n_rows:])
        if not n_ls:
            continue
        if sums:
            _put(noise, n_ls, tr[:nn])
            cols = torch.stack([tr[:nn], pair[:nn], Cn.diagonal(dim1=-2, dim2=-1).sum(-1),
                                (Cn * Cn).sum((-2, -1))])
            extra.append(_scatter_cols(cols.to(dev0), n_ls, L))
        elif correct:
            from ..stats.bias import nuclear_sqrt_trace_corrected_from_sums

            for j, l in enumerate(n_ls):
                noise[l] = nuclear_sqrt_trace_corrected_from_sums(
                    tr[j], pair[j], int(num_samples), batch_size, gram_dim=k,
                    other_dim=others[l], dof_model=dof_model)
        else:
            _put(noise, n_ls, tr[:nn])
        if pool_fold is not None:
            pooled.append(_scatter_cols(torch.stack([tr[nn:2 * nn], pair[nn:2 * nn]]).to(dev0), n_ls, L))
    used: Tensor | None = None
    if meth == "eigh":
        dev = mean_grams[0].device
        per = [torch.zeros((), dtype=torch.bool, device=dev)] * L
        for items, wide in flagged:  # device ops only: no host read here
            for i, (w, l) in enumerate(items):
                per[l] = per[l] | wide[i].to(device=dev, dtype=torch.bool)
        used = torch.stack(per)
        if eig_hints is not None and record_hints:  # reads the flags; newton tells nothing
            eig_hints.record(shapes, used.tolist())
    out = (_gather(noise), _gather(signal), used)
    if sums:
        out = out + (_add_parts(extra, 4, L, dev0),)
    return out + (_add_parts(pooled, 2, L, dev0),) if pool_fold is not None else out


def _add_parts(parts: list, rows: int, L: int, device) -> Tensor:
    """The sum of the per-Gram-size float64 [rows, L] parts (zeros without any; one part
    is returned as it is)."""
    if not parts:
        return torch.zeros((rows, L), dtype=torch.float64, device=device)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _plain(t: Tensor) -> Tensor:
    """t without autograd history (detach() only where there is some: each call is an aten
    op, and the hooks' solve stacks a few per matrix)."""
    return t.detach() if t.requires_grad else t


def _put(dst: list, ls: list, vals: Tensor) -> None:
    """dst[l] = vals[j] for l = ls[j]; a run that covers the whole list (the hooks' case)
    is kept as one tensor (``_gather`` then takes it as it is)."""
    if len(ls) == len(dst) and ls == list(range(len(dst))):
        dst[:] = [vals]
        return
    for j, l in enumerate(ls):
        dst[l] = vals[j]


def _gather(vals: list) -> Tensor:
    """float32 Tensor[L] of the per-layer values (or the one tensor ``_put`` kept)."""
    if len(vals) == 1 and vals[0].dim() == 1:
        return vals[0] if vals[0].dtype == torch.float32 else vals[0].float()
    return torch.stack(vals).float()


def _scatter_cols(part: Tensor, cols: list, L: int) -> Tensor:
    """[rows, L] with part[:, j] in column cols[j] (ascending) and 0 elsewhere: slices of
    part and of one zero block (runs of consecutive columns stay one slice; no index
    tensor from the host)."""
    if len(cols) == L:
        return part
    zero = torch.zeros((part.shape[0], L), dtype=part.dtype, device=part.device)
    pieces = []
    prev = j = 0
    n = len(cols)
    while j < n:
        e = j
        while e + 1 < n and cols[e + 1] == cols[e] + 1:
            e += 1
        if cols[j] > prev:
            pieces.append(zero[:, prev:cols[j]])
        pieces.append(part[:, j:e + 1])
        prev = cols[e] + 1
        j = e + 1
    if prev < L:
        pieces.append(zero[:, prev:L])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
