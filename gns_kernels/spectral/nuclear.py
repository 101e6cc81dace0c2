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

One entry point, ``nuclear_stats``, with two input forms: the mean gradients D given
(``mean_grads``: DDP, MicroBatchGNS, single process) or only their Grams D D^T
(``mean_grad_grams``: FSDP2, where each rank holds a shard of D); the solver is a typed
config (solver.py: EighConfig | NewtonConfig) or a method string standing for one
(ROUTES); ``request=NuclearRequest(...)`` (nuclear_args.py) asks for a subset and more
outputs (a NuclearResult, nuclear_solve.py). The argument checks are in nuclear_args.py,
the solve in nuclear_solve.py. ``nuclear_stats_from_grams``, ``nuclear_stats_select`` and
``nuclear_stats_from_grams_select`` are deprecated aliases (one release; CHANGELOG.md).
"""
from __future__ import annotations

import sys
import warnings
from typing import Sequence

import torch

from .grams import grams64_on_sides, grams_on_sides
from .hints import EigHints
from .nuclear_args import (NuclearRequest, check_common, check_form, check_select, debias_factor, layers_of_grads,
                           layers_of_grams, merge_other_dims, validate_layers)
from .nuclear_solve import (NOISE_CHAIN, NOISE_EPS, NOISE_NEWTON, NoiseCorrection, NuclearLayers, NuclearResult,
                            scatter_cols, solve)
from .solver import EighConfig, HostConfig, NewtonConfig, SolverConfig, resolve_solver

Tensor = torch.Tensor

__all__ = ["nuclear_stats", "NuclearRequest", "NuclearResult", "ROUTES", "NOISE_CHAIN", "NOISE_EPS",
           "NOISE_NEWTON", "nuclear_stats_from_grams", "nuclear_stats_select", "nuclear_stats_from_grams_select"]

# what nuclear_stats's method strings stand for ('auto': 'eigh' on CPU, 'newton' elsewhere)
ROUTES = {"eigh": EighConfig(), "newton": NOISE_CHAIN, "newton-tf32": NewtonConfig(precision="tf32"),
          "host": HostConfig()}
_ALL = NuclearRequest()
_scatter_cols = scatter_cols  # the old private name (imported from here before issue 42; one release)


def nuclear_stats(
    mean_grams: Sequence[Tensor],
    mean_grads: Sequence[Tensor] | None = None,
    scale: float = 1.0,
    shifts: Sequence[Tensor | None] | None = None,
    *,
    mean_grad_grams: Sequence[Tensor] | None = None,
    signal_grams: Sequence[Tensor] | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    side: str = "auto",
    bias_correction: bool = False,
    num_samples: int | None = None,
    batch_size: float | None = None,
    other_dims: Sequence[int | None] | None = None,
    dof_model: str = "columns",
    signal: str = "raw",
    method: str | SolverConfig = "auto",
    eig_hints: EigHints | None = None,
    validate: bool = False,
    request: NuclearRequest | None = None,
):
    """Per layer l: (noise tr(C_l^{1/2}), signal ||G_l||_S1); two float32 Tensor[L].

    C_l = scale * (mean_grams[l] - D_l D_l^T) on the Gram side of mean_grams[l] (k x k):
      mean_grams[l]  mean over samples of the (shifted) local Grams, k x k, e.g. the
                     all-reduced output of gram() divided by R.
    scale = B/(R-1) (global batch over samples minus one).
    D_l in one of two forms:
      gradient form  mean_grads[l] = D_l, the mean over samples of G^j - S_l, 2-D (m x n).
                     The side is that of mean_grams[l] (k == m: row, k == n: col; ``side``
                     only breaks the tie of a square matrix whose Grams were taken on the
                     column side); shifts[l]: S_l or None, the signal is ||D_l + S_l||_S1.
      Gram form      mean_grad_grams[l] = D_l D_l^T on the same side, k x k (FSDP2: under
                     dim-0 sharding the sum of the shards' Grams); signal_grams[l]: the
                     Gram of G_l = D_l + S_l, or None when no shift was used (the signal
                     then uses mean_grad_grams[l]); shapes[l]: the parameter shape (m, n),
                     one side equal to k: the key of eig_hints (required with it) and the
                     default other_dims.
    bias_correction: False (default: the paper's raw tr(C^{1/2})) or True: the noise is
      gns_kernels.bias.nuclear_sqrt_trace_corrected(eigenvalues of C, num_samples,
      batch_size, other_dim=other_dims[l] (default: the gradient's other side),
      dof_model=dof_model); needs num_samples (R). The eigenvalue and host routes correct
      from the eigenvalues; the Newton route from the Newton trace and the pair sum
      sum_ij s_i s_j / (s_i + s_j) (gns_kernels.spectral.sqrt_trace_pair_sum), the same
      value to about 1e-4 relative, with matmuls only (no eigensolver, no host sync).
    signal: 'raw' (default): ||G_l||_S1; 'debiased': tr((G_l G_l^T - C_l / B)_+^{1/2}) on
      the Gram side (G G^T - C / B is unbiased for E[G] E[G]^T; needs batch_size B;
      gns_kernels.nuclear_dof.nuclear_signal_debiased).
    method: the sqrt-trace solver of noise and signal, an EighConfig / NewtonConfig
      (solver.py) or a string standing for one (ROUTES): 'eigh' -> EighConfig(),
      'newton' -> NOISE_CHAIN = NewtonConfig(iters=20, eps=1e-11, precision="float64"),
      'newton-tf32' -> NewtonConfig(precision="tf32") (its TF32 chain takes the matrices
      whose pair sum no correction needs; the others stay in a float64 NOISE_CHAIN
      chain), 'host' -> HostConfig() (C_l formed in float64 on the inputs' device,
      float64 eigvalsh on the CPU: one host sync per Gram size; spectral.host), 'auto' ->
      'eigh' on CPU, 'newton' elsewhere. A NewtonConfig must run "float64" or "tf32"
      products (float32 iterates came out 2-13% low on steep spectra). On every route
      D D^T (gradient form) and C_l are formed in float64 from the float32 operands; on
      the Newton route C_l's shift eps is relative to ||C_l||_F.
    eig_hints (eigenvalue route, CPU): a gns_kernels.spectral.EigHints keyed by the
      parameter shapes: hinted layers are solved in float64 directly, and what each layer
      needed is recorded into it (applied at its apply(); nothing is recorded on the
      Newton and host routes). Reads the solver's flags (not traceable by torch.compile); leave
      None there.
    request: None, or a NuclearRequest (select a subset, the sums a later correction
      needs, the covariances, a pool folded into the Newton or host solve): the call then returns
      a NuclearResult (noise, signal, used64, sums, pooled, covariances).
    C may come out slightly indefinite (rounding of its operands): eigenvalues below 0
    count 0. A layer with k = 0 (an empty side) contributes noise 0 and signal 0.
    Layers are batched by Gram size (one op call per size). No host synchronization
    (except the host route's copy) unless validate=True (or env GNS_KERNELS_VALIDATE=1): then inputs are checked for
    finiteness and symmetry. Non-finite inputs give NaN for that layer.
    """
    req = _ALL if request is None else request
    if not isinstance(req, NuclearRequest):
        raise ValueError(f"request: expected None or a NuclearRequest, got {type(request).__name__}")
    mean_grams = list(mean_grams)
    L = len(mean_grams)
    check_form(mean_grads, mean_grad_grams, shifts, side, signal_grams, shapes)
    if mean_grad_grams is None:
        mean_grads, shifts, sides, others = layers_of_grads(mean_grams, mean_grads, shifts, side)
    else:
        mean_grad_grams, signal_grams, shapes, others = layers_of_grams(
            mean_grams, mean_grad_grams, signal_grams, shapes, eig_hints)
    check_common(scale, bias_correction, num_samples, method, eig_hints)
    if isinstance(method, NewtonConfig) and method.precision == "ieee":
        raise ValueError("precision: nuclear_stats runs its Newton chains in 'float64' (method 'newton', "
                         "NOISE_CHAIN) or 'tf32', got NewtonConfig(precision='ieee')")
    others = merge_other_dims(other_dims, others, L)
    want_n, want_s = check_select(req.select, L)
    if L == 0:
        z = torch.zeros(0, dtype=torch.float32)
        res = NuclearResult(z, z.clone(), None, torch.zeros((4, 0), dtype=torch.float64) if req.sums else None,
                            torch.zeros((2, 0), dtype=torch.float64) if req.pool_fold is not None else None,
                            [] if req.covariances else None)
        return res if request is not None else (res.noise, res.signal)
    validate_layers(validate, mean_grams, mean_grads, mean_grad_grams, signal_grams)
    debias = debias_factor(signal, scale, batch_size)
    solver = resolve_solver(method, mean_grams[0].device, ROUTES)
    if req.pool_fold is not None and not isinstance(solver, (NewtonConfig, HostConfig)):
        raise ValueError("pool_fold: needs the Newton route (method 'newton') or the host route ('host')")
    if mean_grad_grams is None:
        dd, gg = _grams_of_grads(mean_grads, shifts, sides, want_n, want_s, debias)
        shapes = [tuple(D.shape) for D in mean_grads]
    else:
        dd, gg = mean_grad_grams, list(signal_grams if signal_grams is not None else mean_grad_grams)
    lay = NuclearLayers(mean_grams, dd, gg, float(scale), others, shapes, debias)
    correction = NoiseCorrection(num_samples, batch_size, dof_model) if bias_correction else None
    res = solve(lay, solver, correction, want_n, want_s, eig_hints, req.record_hints, req.sums,
                req.pool_fold, req.covariances)
    return res if request is not None else (res.noise, res.signal)


def _grams_of_grads(mean_grads: list, shifts, sides: list, want_n: list, want_s: list, debias) -> tuple[list, list]:
    """(dd, gg) of the gradient form: D D^T (for the noise, and the signal when unshifted
    or debiased) and G G^T (G = D + S), batched by shape; only those a selected sqrt-trace
    needs (None elsewhere). D D^T is formed in float64 on every route (grams64_on_sides):
    C = scale (mean Gram - D D^T) cancels, and a float32 D D^T's rounding (about u sqrt(n)
    ||D||^2) put the eigh route up to 5x over the steep-spectrum bound (issue 43 item 5);
    the signal's G G^T of a shifted D stays float32 (no cancellation)."""
    L = len(mean_grads)
    shifted = {l for l in range(L) if shifts is not None and shifts[l] is not None}
    need_dd = [l for l in range(L) if want_n[l] or (want_s[l] and (l not in shifted or debias is not None))]
    dd: list = [None] * L
    for l, G in zip(need_dd, grams64_on_sides([mean_grads[l] for l in need_dd], [sides[l] for l in need_dd])):
        dd[l] = G
    gg = list(dd)
    need_gg = [l for l in sorted(shifted) if want_s[l]]
    if need_gg:
        gs = grams_on_sides([mean_grads[l].float() + shifts[l].float() for l in need_gg],
                            [sides[l] for l in need_gg])
        for l, G in zip(need_gg, gs):
            gg[l] = G
    return dd, gg


# ---------------------------------------------------------------------------------------
# Deprecated aliases (one release): each warns at its caller's line and calls nuclear_stats
# ---------------------------------------------------------------------------------------
def _deprecated(old: str, new: str) -> None:
    """DeprecationWarning at the line that called the alias ``old``; none when that line is
    the package's own (distributed._share calls nuclear_stats_from_grams_select until it
    moves to nuclear_stats: a user cannot act on it)."""
    caller = sys._getframe(2)
    if str(caller.f_globals.get("__name__", "")).split(".")[0] == "gns_kernels":
        return
    warnings.warn(f"gns_kernels.spectral.{old} is deprecated and will be removed in the next release; "
                  f"use {new}", DeprecationWarning, stacklevel=3)


def _old_tuple(res: NuclearResult, cov_out, sums: bool, pooled: bool) -> tuple:
    """(noise, signal, used64[, sums][, pooled]) of the *_select aliases; cov_out extended."""
    if cov_out is not None:
        cov_out.extend(res.covariances)
    out = (res.noise, res.signal, res.used64) + ((res.sums,) if sums else ())
    return out + ((res.pooled,) if pooled else ())


def nuclear_stats_from_grams(mean_grams, mean_grad_grams, scale=1.0, **kw):
    """Deprecated: ``nuclear_stats(mean_grams, mean_grad_grams=..., scale=...)`` (the Gram
    form: only D D^T exists, FSDP2). Two float32 Tensor[L]."""
    _deprecated("nuclear_stats_from_grams", "gns_kernels.nuclear_stats(mean_grams, mean_grad_grams=..., ...)")
    if mean_grad_grams is None:
        raise ValueError("mean_grad_grams: expected one k x k Gram per mean_grams entry, got None")
    return nuclear_stats(mean_grams, None, scale, mean_grad_grams=mean_grad_grams, **kw)


def nuclear_stats_select(mean_grams, mean_grads, scale=1.0, shifts=None, *, select=None, record_hints=True,
                         return_sums=False, cov_out=None, **kw):
    """Deprecated: ``nuclear_stats(..., request=NuclearRequest(select=, record_hints=,
    sums=return_sums, covariances=cov_out is not None))``. Returns (noise, signal,
    used64) (+ sums with return_sums); cov_out, a list, is extended by the (l, C_l)."""
    _deprecated("nuclear_stats_select", "gns_kernels.nuclear_stats(..., request=NuclearRequest(...))")
    req = NuclearRequest(select=select, record_hints=record_hints, sums=bool(return_sums),
                         covariances=cov_out is not None)
    res = nuclear_stats(mean_grams, mean_grads, scale, shifts, request=req, **kw)
    return _old_tuple(res, cov_out, bool(return_sums), False)


def nuclear_stats_from_grams_select(mean_grams, mean_grad_grams, scale=1.0, *, select=None, record_hints=True,
                                    return_sums=False, cov_out=None, project=False, pool_fold=None, **kw):
    """Deprecated: ``nuclear_stats(mean_grams, mean_grad_grams=..., request=
    NuclearRequest(...))``. Returns (noise, signal, used64) (+ sums with return_sums, +
    pooled with pool_fold). project: kept for callers; no effect since the Newton route
    solves the noise matrices' positive part in float64 (NOISE_CHAIN; with method
    'newton-tf32' only when a correction needs their pair sums, else in the TF32 chain),
    which the pool's averaged covariances needed already (their negative rounding
    eigenvalues made the old shifted float32 iteration lose the pair sum: inf / NaN at a
    negative eigenvalue of 1e-4 ||C||). The eigenvalue route clamps them either way."""
    _deprecated("nuclear_stats_from_grams_select",
                "gns_kernels.nuclear_stats(mean_grams, mean_grad_grams=..., request=NuclearRequest(...))")
    if mean_grad_grams is None:
        raise ValueError("mean_grad_grams: expected one k x k Gram per mean_grams entry, got None")
    if pool_fold is not None and not return_sums:
        raise ValueError("pool_fold: needs method 'newton' and return_sums=True")
    req = NuclearRequest(select=select, record_hints=record_hints, sums=bool(return_sums),
                         covariances=cov_out is not None, pool_fold=pool_fold)
    res = nuclear_stats(mean_grams, None, scale, mean_grad_grams=mean_grad_grams, request=req, **kw)
    return _old_tuple(res, cov_out, bool(return_sums), pool_fold is not None)
