"""The noise pool's state (gns_kernels.stats.pool.NoisePool): its entries, the stacked blocks
of its covariance entries, and the checks of its state_dict.

Per key the pool holds (module docstring of gns_kernels.stats.pool): P (the EMA of the
variances, flat float32, or of the k x k covariance, float32) and 0-d float64 device
tensors n (the number of measurements folded) and U (the sum of the squared EMA weights
over S - 1), plus, for a covariance, the EMAs num and var of the pair moments and their
count npair. The saved format (``NoisePool.state_dict``):

    {"beta": float, "entries": {key: {"P": tensor, "n": tensor, "U": tensor[, "num",
    "var", "npair"]}}}

(tensors on the CPU; a covariance entry carries all of num, var, npair, a variance entry
none of them).
"""
from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

__all__ = ["check_pool_beta", "PoolEntry", "PoolBlock", "check_pool_state_dict"]


def check_pool_beta(beta, name: str = "pool_beta", allow_none: bool = True) -> Optional[float]:
    """None (no pooling, when allowed) or a float in [0, 1); ValueError / TypeError naming
    ``name``."""
    if beta is None and allow_none:
        return None
    what = "None or a number" if allow_none else "a number"
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"{name}: expected {what} in [0, 1), got {type(beta).__name__}")
    b = float(beta)
    if not (0.0 <= b < 1.0):
        raise ValueError(f"{name}: expected {what} in [0, 1) (the noise EMA factor, as "
                         f"AdaptiveBatchSize's beta_noise), got {beta!r}")
    return b


class PoolEntry:
    """One key's pool: P, and 0-d float64 device tensors n, U (and, for covariances, the
    pair-moment EMAs num, var and their count npair). block, row: the ``PoolBlock`` whose row
    ``row`` these tensors are views of (None: tensors of their own)."""

    __slots__ = ("P", "n", "U", "num", "var", "npair", "block", "row")

    def __init__(self, P: Tensor, pair: bool):
        dev = P.device
        z = lambda: torch.zeros((), dtype=torch.float64, device=dev)  # noqa: E731
        self.P, self.n, self.U = P, z(), z()
        self.num = self.var = self.npair = None
        if pair:
            self.num, self.var, self.npair = z(), z(), z()
        self.block, self.row = None, -1

    def tensors(self) -> dict:
        out = {"P": self.P, "n": self.n, "U": self.U}
        if self.num is not None:
            out.update(num=self.num, var=self.var, npair=self.npair)
        return out


_STATS = ("n", "U", "num", "var", "npair")  # a covariance entry's scalars, a block's columns


class PoolBlock:
    """The covariance entries of one ``fold_covariances`` key list, stacked: P (n, k, k)
    float32 and st (n, 5) float64 (columns n, U, num, var, npair); entry i's tensors are
    views of row i. A fold of the same keys reads and writes the block in place (two
    copies) instead of stacking and scattering 6 tensors per key."""

    __slots__ = ("entries", "P", "st")

    def __init__(self, entries: list):
        old = [t for e in entries for t in e.tensors().values()]
        self.entries = entries
        self.P = torch.stack([e.P for e in entries])
        self.st = torch.stack([getattr(e, f) for e in entries for f in _STATS]).view(len(entries), len(_STATS))
        if self.P.device.type == "cuda":  # the old tensors are freed while this stream may read them
            for t in old:
                t.record_stream(torch.cuda.current_stream(t.device))
        for i, e in enumerate(entries):
            e.P = self.P[i]
            e.n, e.U, e.num, e.var, e.npair = self.st[i].unbind(0)
            e.block, e.row = self, i

    def holds(self, entries: list) -> bool:
        """Whether the block is exactly these entries, in this order, as its views."""
        return len(entries) == len(self.entries) and all(
            e.block is self and e.row == i for i, e in enumerate(entries))


def check_pool_state_dict(sd, name: str = "pool") -> None:
    """ValueError / TypeError naming the bad entry of a NoisePool state_dict (its format:
    module docstring)."""
    if not isinstance(sd, dict) or "beta" not in sd or "entries" not in sd:
        raise ValueError(f"{name}: expected a dict with 'beta' and 'entries'")
    check_pool_beta(sd["beta"], f"{name}['beta']", allow_none=False)
    if not isinstance(sd["entries"], dict):
        raise ValueError(f"{name}['entries']: expected a dict, got {type(sd['entries']).__name__}")
    for k, ent in sd["entries"].items():
        where = f"{name}['entries'][{k!r}]"
        if not isinstance(ent, dict) or not {"P", "n", "U"} <= set(ent):
            raise ValueError(f"{where}: expected a dict with P, n, U")
        pair = {"num", "var", "npair"} & set(ent)
        if pair and pair != {"num", "var", "npair"}:
            raise ValueError(f"{where}: expected all of num, var, npair or none of them")
        for t_name, t in ent.items():
            if t_name not in ("P", "n", "U", "num", "var", "npair"):
                raise ValueError(f"{where}: unknown field {t_name!r}")
            if not isinstance(t, Tensor) or not t.is_floating_point():
                raise ValueError(f"{where}[{t_name!r}]: expected a floating tensor")
            if t_name != "P" and t.dim() != 0:
                raise ValueError(f"{where}[{t_name!r}]: expected a 0-d tensor, got shape {tuple(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{where}[{t_name!r}]: not finite")
        P = ent["P"]
        if P.dim() not in (1, 2) or (P.dim() == 2 and P.shape[0] != P.shape[1]):
            raise ValueError(f"{where}['P']: expected a flat variance pool or a square "
                             f"covariance pool, got shape {tuple(P.shape)}")
        if (P.dim() == 2) != bool(pair):
            raise ValueError(f"{where}: a covariance pool (2-D P) carries num, var, npair; "
                             "a variance pool (flat P) none")
        if float(ent["n"]) < 0 or float(ent["U"]) < 0 or (P.dim() == 1 and bool((P < 0).any())):
            raise ValueError(f"{where}: negative count, weight or variance")
        if float(ent["n"]) >= 1 and not float(ent["U"]) > 0:
            raise ValueError(f"{where}: a pool with n >= 1 measurements needs a weight U > 0")
