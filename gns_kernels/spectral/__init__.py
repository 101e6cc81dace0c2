"""Nuclear (S1) statistics: batched Grams, tr(A_+^{1/2}), per-layer noise and signal.

Public functions (gram / sqrt_trace / nuclear_stats are re-exported as gns_kernels.*):

- ``gram(tensors, side="auto") -> list[Tensor]``: float32 Grams G G^T or G^T G, one
  batched op call per group of equal shapes (grams.py).
- ``sqrt_trace(A, method="auto") -> Tensor[...]``: tr(A_+^{1/2}) = sum_i sqrt(max(lambda_i,
  0)) of symmetric A, by "eigh" (eigh.py: float32 eigvalsh with a per-matrix float64
  fallback chosen by an a-posteriori error bound) or "newton" (newton.py: positive part by
  the Newton-Schulz sign iteration, then coupled Newton-Schulz with a relative shift; no
  host synchronization) (trace.py).
- ``EighConfig(tol=)`` / ``NewtonConfig(iters=, eps=, precision=)`` / ``HostConfig()``:
  the typed solver configs (one frozen dataclass per route, checked once; solver.py),
  which ``method=`` of sqrt_trace and nuclear_stats takes besides the strings "auto" |
  "eigh" | "newton" | "newton-tf32" | "host".
- ``host_eigen_sums(mats, pair)`` / ``HostJob``: the host route's float64 eigenvalue sums
  on the calling thread or on one background thread (host.py).
- ``nuclear_stats(mean_grams, mean_grads, scale, ...) -> (noise[L], signal[L])``, or with
  ``mean_grad_grams=`` for FSDP2, where only the Gram of the mean gradient exists
  (nuclear.py; checks in nuclear_args.py, the solve in nuclear_solve.py);
  ``request=NuclearRequest(...)`` solves a subset and returns a ``NuclearResult`` with the
  solver report, the sums a later correction needs and the covariances.
  ``nuclear_stats_from_grams`` is a deprecated alias (one release).
- ``EigHints``: the per-shape float64 cost hint of the eigenvalue path (hints.py).
- ``psd_eigvalsh(A)``: float64 eigenvalues accurate enough for sqrt-traces (eigh.py).
- ``sqrt_trace_pair_sum(A) -> (trace, pair)``: the Newton sqrt-trace and the pair sum
  sum_ij s_i s_j / (s_i + s_j) that the nuclear bias correction needs, by matmuls only
  (pairsum.py; gns_kernels.bias.nuclear_sqrt_trace_corrected_from_sums takes both).
- ``precision``: explicit per-call matmul precision (``bmm``, ``record_matmuls``).

The heavy parts are torch.library custom ops with fake kernels (torch.compile keeps each
as one opaque node): ``torch.ops.gns_kernels.gram_list`` / ``.gram_batched``,
``.psd_eigvalsh`` / ``.psd_eigvalsh_list``, ``.newton_sqrt_trace``,
``.newton_sqrt_trace_pair``. See docs/spectral.md
for accuracy, cost and the method choice.
"""
from __future__ import annotations

from .eigh import EIGH_TOL, psd_eigvalsh
from .grams import gram, gram_batched, gram_list, smaller_side
from .hints import EigHints, shape_key
from .newton import NEWTON_EPS, NEWTON_EPS_BY_PRECISION, NEWTON_MAX_ITERS, NEWTON_PRECISIONS, newton_min_iters, sign_iters
from .pairsum import sqrt_trace_pair_sum
from .precision import record_matmuls
from .nuclear import NuclearRequest, NuclearResult, nuclear_stats, nuclear_stats_from_grams
from .deviations import deviation_sums, deviation_sums_parts
from .pooled import pooled_sqrt_traces
from .solver import EighConfig, HostConfig, NewtonConfig, SolverConfig
from .host import HostJob, HostJobCancelled, host_eigen_sums
from .trace import sqrt_trace

# the public ops; the solver internals and tuning constants imported above stay reachable
# as gns_kernels.spectral.<name> for tests and benchmarks, but are not API
__all__ = ["gram", "sqrt_trace", "nuclear_stats", "nuclear_stats_from_grams", "EigHints", "EighConfig",
           "NewtonConfig", "HostConfig", "SolverConfig", "NuclearRequest", "NuclearResult"]
