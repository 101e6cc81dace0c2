"""The statistics: from rank (or micro-batch) samples to a gradient noise scale.

One responsibility per module; every name another module uses is public:

- ``gns``: ``GNSEstimate`` and ``estimate_from_stats`` (the estimate from reduced sums)
- ``offline``: ``estimate`` (gk.estimate, from sample gradients held in memory)
- ``critical``: ``critical_batch_size`` (Appendix C)
- ``bias``: the small-sample corrections of the noise (c4, the nuclear Wishart correction)
- ``dof``: the nuclear correction's degrees of freedom (modes, models, pair moments)
- ``fourth_moments``: the degrees of freedom from the samples' fourth moments
  ('data', 'gauss-sums')
- ``jackknife``: leave-one-out statistics
- ``signal``: the bias-reduced signals (signal='debiased')
- ``pool``, ``pool_state``: the noise pool (``NoisePool``) and its state / saved format
- ``pooled``: the pool's part of the nuclear solves (fold, solve, correct)
- ``deviations``: the per-rank deviation sums of the 'gauss-sums' dof

``bias``, ``dof``, ``fourth_moments``, ``jackknife``, ``signal``, ``pool`` and
``pool_state`` import only torch (the spectral ops apply ``bias``); ``pooled``,
``deviations``, ``offline`` and ``gns`` sit above gns_kernels.spectral and ops.
The modules gns_kernels.estimators, bias, nuclear_dof and pooling re-export these names
from before issue 42 (CHANGELOG.md).
"""
