"""The vector a measurement's ranks share (gns_kernels.distributed._share): its rows, and the
per-matrix values and totals read from it after its all-reduce.

- the shared vector (float64, rows x L over the whole measurement, L its measured
  matrices in bucket order), rows [noise_l, signal_l, used64_l] where each rank writes the
  values it solved and 0 elsewhere. Its all-reduce (sum) gives every rank every value
  exactly (each entry has one non-zero contributor: x + 0 = x), so the totals are bitwise
  identical on every rank. used64_l (1.0: the eigenvalue solver needed float64 for matrix
  l) is the eigensolver hint report: every rank records the same report, so the hints stay
  identical on every rank. signal='debiased' adds a row signal_deb_l (tr((G G^T -
  C/B)_+^{1/2}), solved by the rank that solves signal_l).
- bias correction, dof 'columns': the corrected noise is computed by the rank that solves
  it, from the eigenvalues of its own solve (or the Newton trace and pair sum); the
  corrected value is what is shared.
- bias correction, dof 'gauss-sums' (ranks as samples, R >= 3): the dof needs every
  rank's q_j = ||d_j d_j^T||_F^2 and a_j = ||d_j||_F^4 (d_j = G^j - G, this rank's own
  deviation from the mean gradient, known after the bucket's all-reduce), so the
  correction is formed after the share all-reduce. Rows added: pair_l, trace_l, fro2_l
  (the solving rank's pair sum sum_ik s_i s_k / (s_i + s_k), tr C_l and ||C_l||_F^2; the
  noise row holds the raw tr(C_l^{1/2})) and q_l, a_l (written by EVERY rank: the sum is
  Q_l = sum_j q_j, A_l = sum_j a_j). After the all-reduce every rank computes, from the
  same reduced numbers in the same order, nu_l = fourth_moments.dof_from_sample_sums(Q_l,
  A_l, tr M_l, ||M_l||_F^2, R) (M_l = R / scale C_l = sum_j d_j d_j^T) and the corrected
  sqrt-trace (bias.nuclear_sqrt_trace_corrected_from_sums's formula): device ops only, so
  on the Newton (GPU) path nothing is read on the host either.
- noise pool (``pool``, gns_kernels.stats.pool; l1 / nuclear with bias correction): the rank
  that solves a matrix's noise also folds its covariance C_l = scale (M_l - D_l D_l^T) into
  the pool under the matrix's key, solves the pooled covariance's sqrt-trace and pair sum
  (one more sqrt-trace per owned matrix, same solver) and corrects it for the pool's
  degrees of freedom. Rows added: pool_tr_l, pool_pair_l (the pooled tr(P_l^{1/2}) and
  pair sum), pool_nu_l (the pool's degrees of freedom, NaN where the covariance was not
  finite) and pool_new_l (1.0 when the pool has no pair of measurements yet, the first
  measurement: the pooled value is then that measurement's own corrected noise); the
  pooled value is corrected after the all-reduce, by the same call as the 'gauss-sums'
  noise. The pooled total is kept as ``SolveShare.pooled_total``.

Reading it (``share_columns``, ``share_totals``) applies the corrections that need the
reduced vector: the 'gauss-sums' dof (gns_kernels.stats.fourth_moments), the nuclear
correction (gns_kernels.stats.bias) and the pool's (gns_kernels.stats.pooled), element-wise
per matrix, on the device.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..stats.bias import corrected_sqrt_trace
from ..stats.fourth_moments import dof_from_sample_sums
from ..stats.pooled import pool_nu, pooled_correct

Tensor = torch.Tensor

__all__ = ["share_rows", "share_columns", "share_totals"]


def share_rows(signal_debiased: bool = False, gauss_sums: bool = False, pooled: bool = False) -> dict:
    """Row name -> row index of the shared vector (module docstring)."""
    names = ["noise", "signal", "used64"]
    if signal_debiased:
        names.append("signal_deb")
    if gauss_sums:
        names += ["pair", "trace", "fro2", "q", "a"]
    if pooled:
        names += ["pool_tr", "pool_pair", "pool_nu", "pool_new"]
    return {n: i for i, n in enumerate(names)}


def share_columns(vec: Tensor, rows: Optional[dict] = None, num_samples: Optional[int] = None,
                  scale: Optional[float] = None) -> Tensor:
    """float64 Tensor[T, L]: the per-matrix values whose sums over the L matrices are the
    totals, rows noise (corrected here with the 'gauss-sums' rows), signal, then
    signal_deb when rows has it and the pooled noise when rows has the pool's (T = 2, 3 or
    4; the pooled sqrt-traces corrected here for the pool's degrees of freedom).
    Element-wise per matrix, so a matrix's values do not depend on the column order
    (the bucket layout). With the 'gauss-sums' rows: nu_l from (Q_l, A_l, tr M_l,
    ||M_l||_F^2), M_l = num_samples / scale * C_l (module docstring); needs num_samples and
    scale. No host synchronization."""
    rows = rows or share_rows()
    L = vec.numel() // len(rows)
    v = vec.view(len(rows), L)
    noise = v[rows["noise"]]
    pool = "pool_tr" in rows
    if pool:
        i = rows["pool_tr"]
        p_tr, p_pair, p_nu, p_new = v[i:i + 4]
    if "pair" in rows:
        R = int(num_samples)
        f = R / float(scale)  # M = sum_j d_j d_j^T = R / scale * C
        nu = dof_from_sample_sums(v[rows["q"]], v[rows["a"]], f * v[rows["trace"]],
                                  (f * f) * v[rows["fro2"]], R)
        if pool:  # the noise and the pooled noise corrected by one call
            c = corrected_sqrt_trace(torch.cat([noise, p_tr]), torch.cat([v[rows["pair"]], p_pair]),
                           torch.cat([nu, pool_nu(p_nu)]))
            noise, pooled = c[:L], c[L:]
        else:
            noise = corrected_sqrt_trace(noise, v[rows["pair"]], nu)
    elif pool:
        pooled = corrected_sqrt_trace(p_tr, p_pair, pool_nu(p_nu))
    out = [noise, v[rows["signal"]]]
    if "signal_deb" in rows:
        out.append(v[rows["signal_deb"]])
    if pool:  # the first measurement of a pool: its own corrected noise
        out.append(pooled_correct(pooled, p_nu, p_new, noise))
    return torch.stack(out)


def share_totals(vec: Tensor, rows: Optional[dict] = None, num_samples: Optional[int] = None,
                 scale: Optional[float] = None) -> Tensor:
    """float64 Tensor[2] (sum_l noise_l, sum_l signal_l), or Tensor[3] with the debiased
    signal total last when rows has 'signal_deb' (and the pooled total last when rows has
    the pool's), of a reduced shared vector: the row sums of ``share_columns`` on the device
    (identical on every rank). ``SolveShare.read`` sums the same columns on the host with
    ``exact_sum`` instead, which does not depend on their order. No host synchronization."""
    return share_columns(vec, rows, num_samples, scale).sum(1)
