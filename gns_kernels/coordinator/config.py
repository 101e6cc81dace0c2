"""The coordinator's settings: one typed configuration, checked once.

``CoordinatorConfig`` holds every number ``AdaptiveBatching`` takes (its keyword
arguments); its checks run when it is made (``__post_init__``), before anything is built or
attached. Checks that need the run -- the data-parallel size R, the hook state's own F,
signal and pool factor -- are ``resolve``'s: it returns the settings of the run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from .._validation import check_int, check_signal

__all__ = ["CoordinatorConfig", "check_budget", "OWNER"]

OWNER = "AdaptiveBatching"   # the writer the run's schedule names (gns_kernels.schedule)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of an adaptive-batch run (``AdaptiveBatching``'s keyword arguments).

    Args:
        micro_batch_size: b, examples per micro-batch per rank (fixed).
        initial_batch_size: B_0, global examples of step 0; a multiple of R x b (one rank:
            of b, and >= 2 b).
        max_batch_size: cap on B (a multiple of R x b), or None. Recommended: with the
            bias-corrected l1 GNS one decision multiplies B by about pi / (2 theta^2) (4.4x
            at theta 0.6) at pure noise, and by more when the EMAs mix measurements of
            different batches (not a bound; ``max_growth`` is one), see docs/controller.md.
        theta, beta_signal, warmup_steps, lr_scaling: as ``AdaptiveBatchSize``.
        every: F, the measuring period; None takes the hook state's ``every`` (100 when the
            coordinator builds the state). Given and different from the state's: ValueError
            (one F drives both).
        beta_noise: the noise EMA factor. With a noise pool in the hook state (its
            ``pool_beta``, on by default) the pooled noise IS the noise EMA, so one value
            serves both: None takes the state's ``pool_beta`` (0.9 without a pool); given with
            the model, the state is built with ``pool_beta=beta_noise``; given with a state
            whose ``pool_beta`` differs: ValueError.
        max_growth: opt-in bound on B_{k+1} / B_k per decision (e.g. 2.0: LR at most x
            sqrt(2) per decision with "sqrt" scaling); None is Algorithm 1 unbounded. The
            bounded B is rounded down to a multiple of R x b but grows by at least one R x b.
        world_size, rank: R and this rank; None takes them from the data-parallel group the
            GNS is measured over (1 and 0 without torch.distributed). A given world_size that
            is not that group's size: ValueError.
        signal: "raw" or "debiased", the signal Algorithm 1 runs on; None takes the hook
            state's (the state computes it; another value: ValueError). theta's meaning
            depends on it (docs/controller.md).
        geometry: with the model only (the coordinator builds the measurement): "l2", "l1"
            or "nuclear"; None takes ``gk.geometry_for(optimizers)``.
    """

    micro_batch_size: int
    initial_batch_size: int
    max_batch_size: Optional[int] = None
    theta: float = 0.6
    every: Optional[int] = None
    warmup_steps: int = 0
    beta_noise: Optional[float] = None
    beta_signal: float = 0.9
    lr_scaling: str = "sqrt"
    max_growth: Optional[float] = None
    world_size: Optional[int] = None
    rank: Optional[int] = None
    signal: Optional[str] = None
    geometry: Optional[str] = None

    def __post_init__(self):
        check_int("micro_batch_size", self.micro_batch_size, 1)
        check_int("initial_batch_size", self.initial_batch_size, 1)
        for name, lo in (("world_size", 1), ("rank", 0), ("every", 1)):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), lo)
        if self.max_batch_size is not None:
            check_int("max_batch_size", self.max_batch_size, 1)
        if self.beta_noise is not None:
            from ..stats.pool_state import check_pool_beta
            object.__setattr__(self, "beta_noise",
                               check_pool_beta(self.beta_noise, name="beta_noise", allow_none=False))
        check_signal(self.signal, allow_none=True)

    def resolve(self, *, world_size: int, rank: int, state_every: int, state_signal: str,
                pool_beta: Optional[float], measures_micro_batches: bool,
                built_state: bool) -> "CoordinatorConfig":
        """These settings with every None resolved for a run on ``world_size`` data-parallel
        ranks whose hook state measures every ``state_every`` steps, computes the
        ``state_signal`` signal and pools with ``pool_beta``; ValueError naming the argument
        for one that does not fit (R x b divisibility, B_0 >= 2 b on one rank, F, signal and
        noise factor against the state's). ``measures_micro_batches``: the samples are
        micro-batches (one rank is allowed); ``built_state``: the coordinator built the
        state from the model (for the messages)."""
        R, b, B0 = world_size, self.micro_batch_size, self.initial_batch_size
        if self.world_size is not None and self.world_size != R:
            raise ValueError(
                f"world_size: given {self.world_size}, but the data-parallel group the GNS is "
                f"measured over has {R} ranks (the samples of the GNS, and the R of B = R x A x b); "
                "leave world_size=None to take it from there")
        if R == 1 and not measures_micro_batches:
            if built_state:
                raise ValueError(
                    "gns: a DDP / FSDP2 model on one data-parallel rank has no ranks to sample; "
                    "on one rank pass the plain module (the micro-batches are the samples)")
            raise ValueError(
                "gns: one rank has no ranks to sample; measure with gk.MicroBatchGNS "
                "(gradient-accumulation micro-batches as the samples)")
        if B0 % (R * b):
            raise ValueError(f"initial_batch_size: expected a multiple of world_size x micro_batch_size "
                             f"= {R} x {b} = {R * b}, got {B0}")
        if R == 1 and B0 < 2 * b:
            raise ValueError(f"initial_batch_size: one rank needs at least 2 micro-batches per step "
                             f"(the GNS samples), so >= 2 x micro_batch_size = {2 * b}, got {B0}")
        if self.max_batch_size is not None and self.max_batch_size % (R * b):
            raise ValueError(f"max_batch_size: expected a multiple of world_size x micro_batch_size "
                             f"= {R * b}, got {self.max_batch_size}")
        every = _agree("every", self.every, state_every,
                       f"measures every {state_every} steps; one F drives both: pass the same every to both")
        beta_noise = self.beta_noise
        if beta_noise is None:
            beta_noise = 0.9 if pool_beta is None else pool_beta
        elif pool_beta is not None and float(beta_noise) != pool_beta:
            raise ValueError(
                f"beta_noise: AdaptiveBatching(beta_noise={beta_noise}) but the hook state pools "
                f"the noise with pool_beta={pool_beta}, and the pooled noise is the controller's "
                f"noise EMA; build the state with pool_beta={beta_noise}, or leave beta_noise=None "
                "to take the state's")
        signal = _agree("signal", self.signal, state_signal,
                        f"computes the {state_signal!r} signal; build the state with signal={self.signal!r}")
        return replace(self, world_size=R, rank=rank, every=every, beta_noise=beta_noise,
                       signal=signal)

    def controller(self, schedule):
        """Algorithm 1 with these (resolved) settings, reading F and writing B through the
        run's ``schedule``: an ``AdaptiveBatchSize`` whose batches are multiples of R x b."""
        from ..controller import AdaptiveBatchSize

        return AdaptiveBatchSize(
            initial_batch_size=self.initial_batch_size, theta=self.theta, beta_noise=self.beta_noise,
            beta_signal=self.beta_signal, every=self.every, warmup_steps=self.warmup_steps,
            max_batch_size=self.max_batch_size, multiple_of=self.world_size * self.micro_batch_size,
            lr_scaling=self.lr_scaling, signal=self.signal, max_growth=self.max_growth,
            schedule=schedule)


def check_budget(name: str, value) -> Optional[int]:
    """max_samples / max_steps: None, or a whole number >= 0 (an int, or an integral float
    such as 1e6); anything else raises naming the argument (nan, inf, a string: a loop that
    ran no step, or a bare TypeError in a comparison, before)."""
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        if not isinstance(value, (int, float, str)) and hasattr(value, "__index__"):
            value = value.__index__()  # numpy integers
        else:
            raise TypeError(f"{name}: expected an int >= 0 or None (no limit), got {value!r} "
                            f"({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0 or None (no limit), got {value}")
    return value


def _agree(name: str, mine, state_value, what: str):
    """``mine`` (an AdaptiveBatching setting) or, when None, ``state_value`` (the hook
    state's); ValueError naming ``name`` when both are given and differ. ``what``: what
    the state does, and the fix."""
    if mine is None or mine == state_value:
        return state_value if mine is None else mine
    shown = mine if isinstance(mine, int) and not isinstance(mine, bool) else repr(mine)
    raise ValueError(f"{name}: AdaptiveBatching({name}={shown}) but the hook state {what}, or leave "
                     f"AdaptiveBatching's {name}=None to take the state's")
