"""The solve behind ``nuclear_stats``: per layer l the noise tr(C_l^{1/2}) and the signal
||G_l||_S1 from k_l x k_l matrices, batched by Gram size, by the configured route.

    C_l    = scale (mean_grams[l] - dd[l])     dd[l] = D_l D_l^T (D_l the mean shifted gradient)
    signal = tr(gg[l]^{1/2}) = ||G_l||_S1       gg[l] = G_l G_l^T (G_l = D_l + S_l), or with
             signal='debiased' tr((gg[l] - c (mean_grams[l] - dd[l]))_+^{1/2}), c = scale / B

Units: noise in gradient units x sqrt(examples), signal in gradient units; both float32
Tensor[L]. Routes (solver.py): EighConfig -> one ``gns_kernels::psd_eigvalsh_list`` call
per Gram size (C_l formed in float64 inside the worker that solves it); NewtonConfig -> one
Newton chain per Gram size (``gns_kernels::newton_sqrt_trace_pair``; float64 matmuls for
the noise matrices, NOISE_CHAIN); HostConfig -> the matrices of one Gram size formed in
float64 on the inputs' device, copied to the CPU (a host sync) and solved there by float64
eigvalsh (host.host_eigen_sums), the sums copied back. Only the selected sqrt-traces are
solved (the others are 0).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .newton import check_newton_args, newton_min_iters
from .solver import EighConfig, HostConfig, NewtonConfig, SolverConfig

from ..stats.common import scatter_cols

Tensor = torch.Tensor

__all__ = ["NOISE_EPS", "NOISE_NEWTON", "NOISE_CHAIN", "NuclearLayers", "NoiseCorrection", "NuclearResult",
           "solve", "scatter_cols"]

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
# the same chain as a config: nuclear_stats's method 'newton'
NOISE_CHAIN = NewtonConfig(iters=NOISE_NEWTON[0], eps=NOISE_NEWTON[1], precision="float64")


class NuclearLayers(NamedTuple):
    """The checked inputs of a solve, per layer l (k_l x k_l matrices on the Gram side)."""

    mean_grams: list  # mean over samples of the (shifted) Grams
    dd: list  # D_l D_l^T (None where no selected sqrt-trace needs it)
    gg: list  # the Gram of G_l = D_l + S_l (dd[l] when unshifted)
    scale: float  # B / (R - 1)
    others: list  # the gradient's other dimension n (the bias correction's), or None
    shapes: Optional[list]  # parameter shapes (the eig_hints keys), or None
    debias: Optional[float]  # c = scale / B for the debiased signal, else None


class NoiseCorrection(NamedTuple):
    """The bias correction of the noise (bias.nuclear_sqrt_trace_corrected[_from_sums])."""

    num_samples: int
    batch_size: Optional[float]
    dof_model: str


class NuclearResult(NamedTuple):
    """What ``nuclear_stats(..., request=NuclearRequest(...))`` returns.

    noise, signal: float32 Tensor[L] (0 where not selected).
    used64: bool Tensor[L] on the Grams' device, True where a selected eigenproblem of
      layer l was solved in float64 (eigenvalue route); None on the Newton route, which
      reports nothing, and on the host route (every solve is float64 there and no
      float32 attempt is made: nothing for eig_hints to learn).
    sums: float64 Tensor[4, L] (request.sums; NuclearRequest), else None.
    pooled: float64 Tensor[2, L] (request.pool_fold), else None.
    covariances: [(l, C_l)] (request.covariances), else None."""

    noise: Tensor
    signal: Tensor
    used64: Optional[Tensor]
    sums: Optional[Tensor] = None
    pooled: Optional[Tensor] = None
    covariances: Optional[list] = None


class _Acc:
    """The per-layer outputs while the Gram sizes are solved one after the other."""

    def __init__(self, L: int, dev0):
        self.noise: list = [None] * L
        self.signal: list = [None] * L
        self.extra: list = []  # the sums' [4, L] parts per Gram size, added at the end
        self.pooled: list = []  # the pool's [2, L] parts per Gram size
        self.flagged: list = []  # (items, solved-in-float64 flags) per Gram size (eigh)
        self.L = L
        self.dev0 = dev0


def solve(lay: NuclearLayers, solver: SolverConfig, correction: Optional[NoiseCorrection],
          want_n: list, want_s: list, eig_hints=None, record_hints: bool = True, sums: bool = False,
          pool_fold=None, covariances: bool = False) -> NuclearResult:
    """noise / signal per layer (module docstring); noise and signal matrices of one size
    in one op call. sums: the noise is the raw tr(C^{1/2}) and NuclearResult.sums the
    selected noise matrices' [tr C^{1/2}, pair sum, tr C, ||C||_F^2] (a correction formed
    later). correction (None: the raw noise) is applied here, from this solve's spectra,
    unless sums. The Newton route projects the noise matrices always (NOISE_CHAIN); the
    host route clamps their negative eigenvalues (as eigh)."""
    L = len(lay.mean_grams)
    covs = _covariances(lay, want_n) if covariances else None
    hint = eig_hints.lookup(lay.shapes) if eig_hints is not None else [False] * L
    acc = _Acc(L, lay.mean_grams[0].device)
    by_k: dict[int, list[tuple[str, int]]] = {}
    zeros: dict = {}
    for l in range(L):
        k = lay.mean_grams[l].shape[-1]
        d = lay.mean_grams[l].device
        zero = zeros.get(d)
        if zero is None:
            zero = zeros[d] = torch.zeros((), dtype=torch.float32, device=d)
        acc.noise[l] = acc.signal[l] = zero  # an empty side or not selected: 0
        if k == 0:  # an empty side: no noise, no signal
            continue
        by_k.setdefault(k, []).extend(
            ([("n", l)] if want_n[l] else []) + ([("s", l)] if want_s[l] else []))
    correct = correction if not sums else None  # correct here, from this solve's spectra
    for k, items in by_k.items():
        if not items:
            continue
        # noise matrices first, then signal ones: each kind is a contiguous run of the
        # stacked batch below, taken as a slice (a list index would copy the index to the
        # device: a host sync inside the hooks' collective callbacks)
        items.sort(key=lambda it: it[0] != "n")
        if isinstance(solver, EighConfig):
            _eigh_size(acc, lay, items, solver, hint, correct, sums)
        elif isinstance(solver, HostConfig):
            _host_size(acc, lay, k, items, correct, sums, pool_fold)
        else:
            _newton_size(acc, lay, k, items, solver, correct, sums, pool_fold)
    used: Tensor | None = None
    if isinstance(solver, EighConfig):
        dev = lay.mean_grams[0].device
        per = [torch.zeros((), dtype=torch.bool, device=dev)] * L
        for items, wide in acc.flagged:  # device ops only: no host read here
            for i, (w, l) in enumerate(items):
                per[l] = per[l] | wide[i].to(device=dev, dtype=torch.bool)
        used = torch.stack(per)
        if eig_hints is not None and record_hints:  # reads the flags; newton tells nothing
            eig_hints.record(lay.shapes, used.tolist())
    return NuclearResult(
        _gather(acc.noise), _gather(acc.signal), used,
        _add_parts(acc.extra, 4, L, acc.dev0) if sums else None,
        _add_parts(acc.pooled, 2, L, acc.dev0) if pool_fold is not None else None, covs)


def _covariances(lay: NuclearLayers, want_n: list) -> list:
    """[(l, scale (mean_grams[l] - dd[l]))] for the selected noise matrices."""
    out = []
    for l, want in enumerate(want_n):
        if want:
            A = plain(lay.mean_grams[l])
            dd = lay.dd[l]
            cdt = torch.float64 if A.dtype == torch.float64 or dd.dtype == torch.float64 else torch.float32
            out.append((l, (A.to(cdt) - plain(dd).to(cdt)).mul_(lay.scale)))
    return out


def _sig_matrix(lay: NuclearLayers, l: int, cdt) -> Tensor:
    """The signal's matrix: gg, or gg - c (mean_gram - dd) (debias)."""
    if lay.debias is None:
        return plain(lay.gg[l])
    A = plain(lay.gg[l]).to(cdt)
    return A - lay.debias * (plain(lay.mean_grams[l]).to(cdt) - plain(lay.dd[l]).to(cdt))


def _cdt(lay: NuclearLayers):
    """float64 when any mean Gram is float64, else float32 (the debiased signal's dtype)."""
    return torch.float64 if any(A.dtype == torch.float64 for A in lay.mean_grams) else torch.float32


def _eigh_size(acc: _Acc, lay: NuclearLayers, items: list, solver: EighConfig, hint: list,
               correct: Optional[NoiseCorrection], sums: bool) -> None:
    """One Gram size by eigenvalues: C_l = scale * (mean_gram - D D^T) formed per matrix
    in float64 inside the op's workers (then the float32 attempt with its bound and the
    float64 fallback); the debiased signal's matrix formed in float64 too; the correction
    (or the sums) from the eigenvalues."""
    from ..stats.bias import pair_sum

    cdt = torch.float64
    lam, wide = torch.ops.gns_kernels.psd_eigvalsh_list(
        [(plain(lay.mean_grams[l]) if w == "n" else _sig_matrix(lay, l, cdt)) for w, l in items],
        [plain(lay.dd[l]) if w == "n" else None for w, l in items],
        [lay.scale if w == "n" else 1.0 for w, l in items], solver.tol,
        [bool(hint[l]) for w, l in items])
    acc.flagged.append((items, wide))
    res = lam.clamp_min(0).sqrt().sum(-1)
    for i, (w, l) in enumerate(items):
        if w == "n" and correct is not None:
            from ..stats.bias import nuclear_sqrt_trace_corrected

            acc.noise[l] = nuclear_sqrt_trace_corrected(
                lam[i], int(correct.num_samples), correct.batch_size, other_dim=lay.others[l],
                dof_model=correct.dof_model)
        elif w == "n":
            acc.noise[l] = res[i]
            if sums:
                lam64 = lam[i].to(torch.float64)
                sq = lam64.clamp_min(0).sqrt()
                if not acc.extra:
                    acc.extra.append(torch.zeros((4, acc.L), dtype=torch.float64, device=acc.dev0))
                acc.extra[0][:, l] = torch.stack([sq.sum(), pair_sum(sq), lam64.sum(),
                                                  (lam64 * lam64).sum()]).to(acc.dev0)
        else:
            acc.signal[l] = res[i]


def _host_size(acc: _Acc, lay: NuclearLayers, k: int, items: list, correct: Optional[NoiseCorrection],
               sums: bool, pool_fold) -> None:
    """One Gram size on the host: the noise matrices C_l = scale (mean_gram - D D^T) formed
    in float64 on the inputs' device (as _newton_size), the pooled matrices pool_fold(ls,
    C) (same contract as the Newton route), the signal matrices (float64), copied to the
    CPU in one stack (a host sync: the functional route waits for its solve), solved by
    host.host_eigen_sums (float64 eigvalsh; the pair sums of the noise matrices where a
    correction or the sums need them, of the pooled ones always) and the sums copied back
    to the inputs' device. The correction is nuclear_sqrt_trace_corrected_from_sums of the
    eigenvalues' two sums (the same value as nuclear_sqrt_trace_corrected of the
    eigenvalues)."""
    from .host import host_eigen_sums

    n_ls = [l for w, l in items if w == "n"]
    s_ls = [l for w, l in items if w != "n"]
    dev_k = lay.mean_grams[items[0][1]].device
    parts, Cn = _noise_parts(lay, n_ls, pool_fold)
    n_rows = sum(p.shape[0] for p in parts)
    if s_ls:
        parts.append(torch.stack([_sig_matrix(lay, l, torch.float64) for l in s_ls]).to(device=dev_k,
                                                                                       dtype=torch.float64))
    mats = (parts[0] if len(parts) == 1 else torch.cat(parts)).to("cpu")
    nn = len(n_ls)
    want_pair = correct is not None or sums
    pair = [want_pair] * nn + [True] * (n_rows - nn) + [False] * len(s_ls)
    out = host_eigen_sums(mats.unbind(0), pair).to(dev_k)
    tr = out[0]
    if s_ls:
        _put(acc.signal, s_ls, tr[n_rows:])
    if not n_ls:
        return
    if sums:
        _put(acc.noise, n_ls, tr[:nn])
        acc.extra.append(scatter_cols(out[:, :nn].to(acc.dev0), n_ls, acc.L))
    elif correct is not None:
        from ..stats.bias import nuclear_sqrt_trace_corrected_from_sums

        for j, l in enumerate(n_ls):
            acc.noise[l] = nuclear_sqrt_trace_corrected_from_sums(
                tr[j], out[1, j], int(correct.num_samples), correct.batch_size, gram_dim=k,
                other_dim=lay.others[l], dof_model=correct.dof_model)
    else:
        _put(acc.noise, n_ls, tr[:nn])
    if pool_fold is not None:
        acc.pooled.append(scatter_cols(out[:2, nn:2 * nn].to(acc.dev0), n_ls, acc.L))



def _noise_parts(lay: NuclearLayers, n_ls: list, pool_fold) -> tuple[list, Optional[Tensor]]:
    """([C, P] stacks, C) of the noise layers n_ls: C_l = scale (mean_gram - D D^T) formed in
    float64 (the Newton and host routes), and the pooled matrices pool_fold(n_ls, C) when
    the pool folds into this solve; ([], None) without noise layers."""
    if not n_ls:
        return [], None
    Cn = torch.stack([plain(lay.mean_grams[l]) for l in n_ls]).double()
    Cn = Cn.sub_(torch.stack([plain(lay.dd[l]) for l in n_ls]).double()).mul_(lay.scale)
    parts = [Cn]
    if pool_fold is not None:
        parts.append(pool_fold(n_ls, Cn).to(dtype=torch.float64))
    return parts, Cn

def _newton_size(acc: _Acc, lay: NuclearLayers, k: int, items: list, solver: NewtonConfig,
                 correct: Optional[NoiseCorrection], sums: bool, pool_fold) -> None:
    """One Gram size by ONE Newton chain (float64 matmuls, positive-part projection,
    NOISE_CHAIN) for the noise matrices C_l = scale (mean_gram - D D^T) (formed in float64
    from the float32 operands: accurate on steep spectra, where a float32 iteration with a
    shift at the subtraction's rounding level came out 2-13% low), the pooled matrices
    (pool_fold) and the signal matrices, stacked in that order; the pair sum only for the
    first two groups (when a correction needs it). solver.precision "tf32": the matrices
    whose pair sum is needed stay in a float64 NOISE_CHAIN chain, the others take the
    TF32 one (solver.iters, solver.eps)."""
    n_ls = [l for w, l in items if w == "n"]
    # signal matrices: those that need the positive-part step first (the debiased
    # signal's indefinite matrix, a float32 Gram: rounding far above the 1e-11 shift),
    # then float64 Grams of float32 data (PSD to float64 rounding: no projection)
    s_all = [l for w, l in items if w != "n"]
    s_proj = [l for l in s_all if lay.debias is not None or lay.gg[l].dtype != torch.float64]
    s_ls = s_proj + [l for l in s_all if lay.debias is None and lay.gg[l].dtype == torch.float64]
    dev_k = lay.mean_grams[items[0][1]].device
    parts, Cn = _noise_parts(lay, n_ls, pool_fold)
    n_rows = sum(p.shape[0] for p in parts)  # the noise and pooled rows, first
    n_pair = n_rows if (correct is not None or sums) else 0
    cdt = _cdt(lay)
    smats = torch.stack([_sig_matrix(lay, l, cdt) for l in s_ls]).to(device=dev_k, dtype=torch.float64) \
        if s_ls else None
    prec = solver.precision
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
            tr = torch.cat([tr, torch.ops.gns_kernels.newton_sqrt_trace(smats, solver.iters, solver.eps, None,
                                                                        True, prec)])
    else:
        n_proj = n_rows + len(s_proj)
        if smats is not None:
            parts.append(smats)
        mats = parts[0] if len(parts) == 1 else torch.cat(parts)
        tr, pair = torch.ops.gns_kernels.newton_sqrt_trace_pair(
            mats, solver.iters, solver.eps, None, True, prec, "float64", n_pair,
            n_proj if prec == "float64" else -1)
    nn = len(n_ls)
    if s_ls:
        _put(acc.signal, s_ls, tr[n_rows:])
    if not n_ls:
        return
    if sums:
        _put(acc.noise, n_ls, tr[:nn])
        cols = torch.stack([tr[:nn], pair[:nn], Cn.diagonal(dim1=-2, dim2=-1).sum(-1),
                            (Cn * Cn).sum((-2, -1))])
        acc.extra.append(scatter_cols(cols.to(acc.dev0), n_ls, acc.L))
    elif correct is not None:
        from ..stats.bias import nuclear_sqrt_trace_corrected_from_sums

        for j, l in enumerate(n_ls):
            acc.noise[l] = nuclear_sqrt_trace_corrected_from_sums(
                tr[j], pair[j], int(correct.num_samples), correct.batch_size, gram_dim=k,
                other_dim=lay.others[l], dof_model=correct.dof_model)
    else:
        _put(acc.noise, n_ls, tr[:nn])
    if pool_fold is not None:
        acc.pooled.append(scatter_cols(torch.stack([tr[nn:2 * nn], pair[nn:2 * nn]]).to(acc.dev0), n_ls, acc.L))


def _add_parts(parts: list, rows: int, L: int, device) -> Tensor:
    """The sum of the per-Gram-size float64 [rows, L] parts (zeros without any; one part
    is returned as it is)."""
    if not parts:
        return torch.zeros((rows, L), dtype=torch.float64, device=device)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def plain(t: Tensor) -> Tensor:
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
