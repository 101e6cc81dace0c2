"""GNSConfig: the configuration of the distributed GNS hook states, checked once.

A hook state (``GNSHookState``, ``MicroBatchGNS``) is its configuration, which does not
change during a run, plus its runtime state (the schedule it reads, the noise pool, the
pending measurement, the estimate). ``GNSConfig`` is the first: a frozen dataclass whose
``__post_init__`` checks every field (each error names its argument), as Shampoo's
``matrix_functions_types.py`` does for its solvers. ``GNSHookState(...)`` builds one from
its keyword arguments; ``GNSHookState.from_config(config, every=F, batch_size=B)`` takes a
ready one, and ``state.config`` returns it. A setting changed later (``state.method =
"eigh"``, the one the states allow) replaces the config (``dataclasses.replace``: checked
again).

F (``every``), the step k, the global batch B and the loss scale are not configuration:
they are the run's schedule (gns_kernels.schedule.Schedule), which a coordinator may own.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from .._settings_view import setting_of
from .._validation import check_signal
from ..spectral.solver import HostConfig
from ..spectral.trace import METHODS as SOLVE_METHODS
from ..stats.dof import GAUSS_SUMS_MIN_SAMPLES, resolve_nuclear_dof
from ..stats.gns import GEOMETRIES
from ..stats.pool_state import check_pool_beta

Tensor = torch.Tensor

__all__ = ["GNSConfig", "HOOK_METHODS", "check_hook_method", "hook_method", "check_count",
           "unique_params", "config_field"]

# The solvers the hook states run. "newton-tf32" (gk.sqrt_trace / gk.nuclear_stats keep it
# as an explicit experiment) is refused: the hooks' noise and pool chains are float64
# whatever the method, so TF32 reaches only the signal Grams, and there its rounding of a
# steep spectrum loses the tail that carries much of the sqrt-trace (docs/spectral.md).
# "host": the lagged host route (float64 eigvalsh on CPU threads; the estimate of step k
# is readable at the next measurement, docs/distributed.md "The host route").
HOOK_METHODS = tuple(m for m in SOLVE_METHODS if m != "newton-tf32")

ShiftSpec = Union[None, str, Mapping, Callable]


def check_hook_method(method):
    """``method`` if the hook states accept it (one of HOOK_METHODS, or a HostConfig with
    ``max_pending=1``), else ValueError naming ``method``."""
    if isinstance(method, HostConfig):
        if method.max_pending != 1:
            raise ValueError(
                f"method: the hook states keep at most one host solve in flight (the join of "
                f"measurement k waits for it at the next measurement: deterministic), so "
                f"HostConfig(max_pending=1), got max_pending={method.max_pending}")
        return method
    if isinstance(method, str) and method == "newton-tf32":
        raise ValueError(
            "method: 'newton-tf32' is not accepted by the hook states: TF32 products of the "
            "signal Grams lose the tail of their steep spectra, and the signal came out 18% low "
            "(3.04e-13 against 3.73e-13 with 'newton', bench/bench_hook_ops.py's 160M/32 "
            "shapes, CPU emulation), while the noise and the pool stay float64 anyway; use "
            "'newton' (TF32 stays an experiment of gk.sqrt_trace / gk.nuclear_stats)")
    if not isinstance(method, str) or method not in HOOK_METHODS:
        raise ValueError(f"method: expected one of {HOOK_METHODS} or a HostConfig, got {method!r}")
    return method


def hook_method(method, device) -> str:
    """The solver the hooks run for ``method`` (a hook state's, checked) on ``device`` (the
    measured gradients'): "eigh", "newton" or "host". The hooks' one device choice (issue 43
    item 4):

    - "auto" on CPU tensors: "eigh" (the CPU default: LAPACK on the CPU threads, solved
      at once; nothing lags);
    - "auto" on any other device (CUDA): "host" -- the device forms the Grams and the
      float64 matrices and copies them to the host, CPU threads solve them (float64
      eigvalsh) while training goes on, and the estimate of step k is read at the next
      measurement. It takes the O(k^3) solves off the GPU, and it never runs a float64
      matrix chain on the GPU, whose float64 rate is 1/64 of float32 on L40S / A10 /
      RTX-class parts (the Newton route's chain is float64);
    - a HostConfig: "host"; any other string: itself (``method=`` overrides the choice).
    """
    if isinstance(method, HostConfig):
        return "host"
    if method != "auto":
        return method
    return "eigh" if torch.device(device).type == "cpu" else "host"


def check_count(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is an int (not bool) >= ``minimum``: TypeError / ValueError naming
    ``name`` otherwise (the hook states' ``every`` and ``step``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def unique_params(params: Iterable[Tensor]) -> tuple:
    """The parameters in order, each tensor once (by identity: a tied weight passed twice
    is one parameter with one gradient). TypeError for a single tensor or a non-tensor."""
    if isinstance(params, Tensor):
        raise TypeError("params: expected an iterable of parameters, got a single tensor")
    out, seen = [], set()
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"params[{i}]: expected a parameter tensor, got {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return tuple(out)


def config_field(name: str) -> property:
    """A read-only property returning ``self.config.<name>`` (the hook states' settings)."""
    return setting_of("config", name, f"``config.{name}`` (read-only; see GNSConfig)")


@dataclasses.dataclass(frozen=True, eq=False)
class GNSConfig:
    """The configuration of a GNS hook state (see the module docstring).

    Args:
        geometry: "l2", "l1" or "nuclear" (the optimizer's geometry).
        shift: None, "last", {param: tensor} or callable(param) -> tensor | None (the
            module docstring of gns_kernels.distributed.state).
        params: iterable of parameters to measure (default None: all the hook sees); kept
            as a tuple, a tensor listed twice (e.g. a tied weight) once. For "nuclear"
            only the 2-D ones are used (as gk.estimate does). Also the parameter order
            that keys the noise pool in ``state_dict()``.
        process_group: the data-parallel group (default: the default group).
        bias_correction: as gk.estimate (default True: the c4 l1 correction and the
            spectral ops' nuclear correction; False: the paper's raw estimators).
        nuclear_dof: the degrees of freedom of the nuclear correction, as gk.estimate's:
            "auto" (default): "gauss-sums" when each sample is one rank's gradient (DDP,
            ranks as samples) and there are >= 3 of them, else "columns" (2 ranks; FSDP2,
            whose ranks hold only a shard of the mean gradient; ``MicroBatchGNS``, which
            keeps no per-micro-batch gradient); "gauss-sums" (DDP ranks, >= 3: refused
            here when the process group is smaller, and by the hook at a measurement with
            fewer samples); "columns". With the default the DDP hook's estimate equals
            gk.estimate's default on the ranks' gradients.
        signal: "raw" (default, the paper's signal) or "debiased" (as gk.estimate's: the
            estimate's ``signal`` is then the bias-reduced one, ``signal_raw`` the
            paper's); costs one more sqrt-trace per matrix (nuclear) or one pass over the
            reduced gradient (l1) on measurement steps.
        pool_beta: the noise pool's EMA factor in [0, 1) (default 0.9, AdaptiveBatchSize's
            beta_noise) or None (no pool). Used for l1 and nuclear with ``bias_correction``
            (l2 is linear: its noise EMA needs no pool; the paper's raw estimator has
            none). Costs on measurement steps: l1 a few passes over this rank's share of
            the reduced gradient and, under DDP, one more all-reduce of one float64;
            nuclear one more sqrt-trace per matrix (of its pooled covariance), solved by
            the rank that solves its noise.
        method: the nuclear sqrt-trace solver the hooks run: "auto" (default: eigenvalues
            on CPU tensors, the host route on GPUs; ``hook_method``), "eigh", "newton"
            (e.g. the old GPU path on CPU tensors, for tests and bench/bench_hook_ops.py)
            or "host" (also a ``gk.spectral.HostConfig()``; its max_pending must be 1): the
            matrices copied to the host and solved there by float64 eigvalsh on a CPU
            thread while training goes on; the estimate of the measurement of step k is
            readable from the next measurement on (``estimate.step`` k,
            ``estimate.available_step`` the later step; docs/distributed.md "The host
            route"). Not saved by ``state_dict()``. "newton-tf32" is refused (ValueError):
            in the hooks TF32 reaches only the signal, which it left 18% low on the hook
            benchmark (CPU emulation); it stays available on ``gk.sqrt_trace`` /
            ``gk.nuclear_stats`` as an experiment.

    Equality compares ``params``, ``shift`` (unless a string) and ``process_group`` by
    identity and the other fields by value.
    """

    geometry: str = "l1"
    shift: ShiftSpec = None
    params: Optional[tuple] = dataclasses.field(default=None, repr=False)
    process_group: Any = None
    bias_correction: bool = True
    nuclear_dof: str = "auto"
    signal: str = "raw"
    pool_beta: Optional[float] = 0.9
    method: Union[str, HostConfig] = "auto"

    # nuclear_dof values the hook states accept (the hooks cannot form 'data': it needs
    # cross-sample fourth moments); MicroBatchGNS accepts fewer (its own _NUCLEAR_DOFS)
    NUCLEAR_DOFS: ClassVar[tuple] = ("auto", "gauss-sums", "columns")
    NUCLEAR_DOF_HINT: ClassVar[str] = " ('data' needs cross-sample terms a hook cannot form)"

    def __post_init__(self) -> None:
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"geometry: expected one of {GEOMETRIES}, got {self.geometry!r}")
        shift = self.shift
        if isinstance(shift, str):
            if shift != "last":
                raise ValueError(f"shift: the only string accepted is 'last', got {shift!r}")
        elif not (shift is None or isinstance(shift, Mapping) or callable(shift)):
            raise TypeError(
                "shift: expected None, 'last', a mapping {parameter: tensor} or a callable "
                f"parameter -> tensor, got {type(shift).__name__}"
            )
        if self.params is not None:
            params = unique_params(self.params)
            if not params:
                raise ValueError("params: expected at least one parameter, got an empty iterable")
            object.__setattr__(self, "params", params)
        object.__setattr__(self, "bias_correction", bool(self.bias_correction))
        if self.nuclear_dof not in self.NUCLEAR_DOFS:
            raise ValueError(f"nuclear_dof: expected one of {self.NUCLEAR_DOFS} for GNSHookState, "
                             f"got {self.nuclear_dof!r}{self.NUCLEAR_DOF_HINT}")
        if (self.nuclear_dof == "gauss-sums" and self.bias_correction and self.geometry == "nuclear"
                and dist.is_available() and dist.is_initialized()):
            world = dist.get_world_size(self.process_group)
            if world < GAUSS_SUMS_MIN_SAMPLES:  # said here, not at the first measurement in backward()
                raise ValueError(f"nuclear_dof: 'gauss-sums' needs at least {GAUSS_SUMS_MIN_SAMPLES} "
                                 f"ranks as samples, "
                                 f"this process group has {world} (use 'auto', which falls back "
                                 "to 'columns' below 3)")
        object.__setattr__(self, "signal", check_signal(self.signal))
        check_hook_method(self.method)
        object.__setattr__(self, "pool_beta", check_pool_beta(self.pool_beta))

    # ---------------------------------------------------------------- derived
    @property
    def pooled(self) -> bool:
        """Whether the states keep a noise pool: ``pool_beta`` set, l1 or nuclear, with
        ``bias_correction``."""
        return self.pool_beta is not None and self.bias_correction and self.geometry != "l2"

    @property
    def l1_debiased(self) -> bool:
        """l1 with signal='debiased' (each parameter's row carries a fifth sum)."""
        return self.signal == "debiased" and self.geometry == "l1"

    def resolved_nuclear_dof(self, num_samples: int, per_sample: bool = True) -> Optional[str]:
        """The dof mode of a nuclear measurement with ``num_samples`` samples: 'gauss-sums'
        or 'columns' (bias.resolve_nuclear_dof; per_sample: each sample's deviation from
        the mean is available). None when there is no nuclear correction (bias_correction
        False, or another geometry).
        Raises ValueError for nuclear_dof='gauss-sums' that cannot be honoured."""
        if not self.bias_correction or self.geometry != "nuclear":
            return None
        if self.nuclear_dof == "gauss-sums" and not per_sample:
            raise ValueError("nuclear_dof: 'gauss-sums' needs each sample's own gradient (ranks as "
                             "samples); these samples are micro-batches or shards, use 'auto' or "
                             "'columns'")
        return resolve_nuclear_dof(self.nuclear_dof, num_samples, per_sample=per_sample)

    # ---------------------------------------------------------------- equality
    def _key(self) -> tuple:
        params = None if self.params is None else tuple(id(p) for p in self.params)
        shift = self.shift if self.shift is None or isinstance(self.shift, str) else id(self.shift)
        return (self.geometry, shift, params, id(self.process_group), self.bias_correction,
                self.nuclear_dof, self.signal, self.pool_beta, self.method)

    def __eq__(self, other) -> bool:
        if not isinstance(other, GNSConfig):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # a mapping shift is unhashable; configs are compared, not keyed
