"""Leave-one-out statistics and the jackknife: a bias a/(R-1) removed whatever the
distribution.

Notation as gns_kernels.stats.dof (R samples, d_j = x_j - mean_k x_k, M = sum_j d_j d_j^T).

Jackknife (R >= 3; one extra all-reduce of 1 float per statistic)
    Sample j knows the reduced statistic and its own deviation, hence the leave-one-out
    statistic without itself: the Gram of the other R-1 samples about their own mean is
    M_(-j) = M - R/(R-1) d_j d_j^T (``loo_gram``), and per coordinate
    sum_{k != j} (x_k - mean_(-j))^2 = sum_k d_k^2 - R/(R-1) d_j^2 (``loo_sum_sq``). It
    evaluates the estimator f (e.g. tr C^{1/2} with C = b M_(-j)/(R-2), or ||s||_1) on its
    leave-one-out statistic; the R values are summed by the extra all-reduce. If
    E f_R = f + a/(R-1) + O(R^-2) (the form of every small-sample bias here: 1 - c4(R) and the
    Wishart beta are both a/(R-1) to first order), then
        f_J = (R-1) f_R - (R-2) mean_j f_(-j)                               (``jackknife``)
    has bias O(R^-2) whatever the distribution. Applied to an already corrected f (c4 for
    l1, the Wishart correction for nuclear) it removes what that correction's model misses.
"""
from __future__ import annotations

import torch

from .common import check_loo_count

Tensor = torch.Tensor

__all__ = ["loo_gram", "loo_sum_sq", "jackknife"]


def loo_gram(M: Tensor, d: Tensor, num_samples: int) -> Tensor:
    """Centred Gram of the samples other than j: M - R/(R-1) d d^T.

    M: (..., m, m) sum_k d_k d_k^T over all R samples; d: (..., m, n) sample j's deviation
    (rows side of M). Returns float64 (..., m, m). num_samples: R >= 3.
    """
    R = check_loo_count(num_samples)
    x = d.detach().to(torch.float64)
    if M.shape[-1] != x.shape[-2]:
        x = x.mT
    if M.shape[-2:] != (x.shape[-2], x.shape[-2]):
        raise ValueError(f"M: expected (..., {x.shape[-2]}, {x.shape[-2]}) for d of shape {tuple(d.shape)}, "
                         f"got {tuple(M.shape)}")
    return M.detach().to(torch.float64) - (R / (R - 1)) * (x @ x.mT)


def loo_sum_sq(sum_sq: Tensor, d: Tensor, num_samples: int) -> Tensor:
    """Per-coordinate centred sum of squares of the samples other than j:
    sum_sq - R/(R-1) d^2 (sum_sq = sum_k d_k^2 over all R samples). float64."""
    R = check_loo_count(num_samples)
    x = d.detach().to(torch.float64)
    return sum_sq.detach().to(torch.float64) - (R / (R - 1)) * x * x


def jackknife(full, loo_mean, num_samples: int):
    """(R-1) * full - (R-2) * loo_mean: removes a bias a/(R-1) of an estimator of R samples,
    full its value on all R samples, loo_mean the mean of its R leave-one-out values."""
    R = check_loo_count(num_samples)
    return (R - 1) * full - (R - 2) * loo_mean
