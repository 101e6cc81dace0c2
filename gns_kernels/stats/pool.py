"""Noise pools: the statistics of successive measurements averaged BEFORE the square roots.

Why. The l1 noise (sum_i s_i)^2 and the nuclear noise (sum_l tr C_l^{1/2})^2 take square
roots of variances estimated from S samples (ranks, or ranks x micro-batches). A square root
of a noisy estimate is biased low (Jensen), and on real networks (heavy-tailed per-example
gradients, covariances of low effective rank) the per-measurement corrections (c4 for l1,
the Wishart correction for nuclear) remove only part of it: at a local batch of 16 the
single-measurement noise is 0.90-0.95 (l1) and 0.81-1.01 (nuclear) of the truth at 4 ranks
(docs/fidelity.md). The controller averages the noise anyway (its EMA, beta_noise); averaging
the per-coordinate variances s2_i and the per-matrix covariances C_l over the same window
first and taking the square roots of the averages has the same window but about
(1 + beta) / (1 - beta) times the degrees of freedom (19 at beta = 0.9), so the bias left
after the correction shrinks about as much.

What a pool holds, per key (one parameter, or this rank's shard of it):

- l1 (``fold_variance``): P_i, the EMA of s2_i over the measurements (float32, one number
  per coordinate of the key);
- nuclear (``fold_covariance``): P, the EMA of the k x k covariance C (float32), and EMAs
  of two pair moments of successive measurements (below);
- weights: n, the number of measurements folded, and U = sum_k w_k^2 / (S_k - 1), w_k the
  EMA weight of measurement k (so 1 / U is the pool's degrees of freedom in samples: a
  Gaussian variance pooled with these weights behaves like one with 1/U degrees of
  freedom, Satterthwaite).

The EMA is the controller's: the first valid measurement sets P = x, each later one
P <- beta P + (1 - beta) x (``gk.AdaptiveBatchSize`` starts its EMAs the same way), so the
pooled noise IS the noise EMA, formed on the statistics instead of on the noise.
Validity is per key: a key whose statistics in a measurement are not finite does not fold
it (its P, n, U unchanged) and reports NaN, so that measurement's pooled noise is NaN (and
the measurement itself invalid); keys whose statistics are finite fold it (each key keeps
its own n and U, so its correction stays exact). The next measurement continues every pool.

Reported values (units of the measurement's own gradients, x grad_scale, below):

- l1: sum_i sqrt(P_i) / c4(1/U + 1), the pooled ||s||_1 with the c4 correction for the
  pool's 1/U degrees of freedom (exact for Gaussian rank means; the heavy-tailed residual
  shrinks with the pooled dof);
- nuclear: P, and nu_s, the degrees of freedom of one sample of C from the pair moments of
  successive measurements (distribution-free, nuclear_dof's "pair" estimate against the
  pool): with the previous pool P' (independent of C at a fixed parameter point),
      E[tr C tr P' + <C, P'>] = (tr Sigma)^2 + ||Sigma||_F^2,
      E ||C - P'||_F^2 = ((tr Sigma)^2 + ||Sigma||_F^2) / nu_s * (1/(S - 1) + U'),
  EMAs of both (from the second measurement on) give nu_s = max(num / var, 1) (a sample
  carries at least one degree of freedom; the floor bounds the over-correction a fast
  drifting covariance, early in training, would cause), and the pool has
  nu_s / U degrees of freedom: the caller corrects tr P^{1/2} with them
  (bias.corrected_sqrt_trace(trace, pair sum, nu_s / U)). Until a pair exists (the first valid
  measurement of a key) there is no nu: ``fold_covariance`` flags it and the caller reports
  that measurement's own corrected noise.

grad_scale: the loss scale of the measured backward (1 without a GradScaler). The pool
stores statistics divided by grad_scale^2 (a scale that changes between measurements does
not mix units) and reports them times the current grad_scale^2, in the units of the
measurement's own (scaled) noise.

Assumption (as the controller's EMA): the noise changes slowly over the window (about
1 / (1 - beta) measurements). During training the pooled noise estimates the window's
average noise, like an EMA of per-measurement noises, but without their small-sample bias
(docs/fidelity.md, "Drift").

Keys: any hashable (the hooks use the parameter's index in ``GNSHookState``'s parameter
order, else its id()). ``state_dict`` / ``load_state_dict`` keep every entry (tensors and
floats only).
"""
from __future__ import annotations

import math
from typing import Hashable, Optional

import torch

from .._validation import check_scale
from .._validation import warn_user as _warn_user
from .bias import c4_tensor
from .dof import dof_from_moments
from .pool_state import PoolBlock, PoolEntry, check_pool_beta, check_pool_state_dict

Tensor = torch.Tensor

__all__ = ["NoisePool", "NU_S_MIN"]

# The floor of one sample's estimated dof: a sample (a rank's or micro-batch's mean gradient)
# carries at least one degree of freedom (a rank-one deviation has exactly one). A drifting
# covariance (early training) inflates the pair moment ||C - P'||^2 and would drive the
# estimate below that, over-correcting the pool; the floor bounds it.
NU_S_MIN = 1.0


def _check_samples(num_samples) -> int:
    if (isinstance(num_samples, bool) or not isinstance(num_samples, (int, float))
            or int(num_samples) != num_samples or num_samples < 2):
        raise ValueError(f"num_samples: expected an integer >= 2, got {num_samples!r}")
    return int(num_samples)


def _check_grad_scale(grad_scale) -> float:
    g = float(grad_scale)
    if not (math.isfinite(g) and g > 0):
        raise ValueError(f"grad_scale: expected a positive finite loss scale, got {grad_scale!r}")
    return g


class NoisePool:
    """EMA pools of per-coordinate variances (l1) and covariances (nuclear); see the module
    docstring. beta: the EMA factor in [0, 1) (the controller's ``beta_noise``; 0 keeps only
    the last measurement, i.e. no pooling)."""

    def __init__(self, beta: float = 0.9):
        self.beta = check_pool_beta(beta, "beta", allow_none=False)
        self._entries: dict = {}
        self._blocks: dict = {}  # tuple of keys -> PoolBlock (fold_covariances)
        self._warned_reset = False
        # CUDA: the stream the last fold ran on (a nuclear fold runs on its measurement's
        # side stream); the next measurement's stream waits for it (gns_kernels.distributed)
        self.stream = None

    # ------------------------------------------------------------------ folding
    def _entry(self, key: Hashable, like: Tensor, pair: bool) -> PoolEntry:
        e = self._entries.get(key)
        if e is not None and (e.P.shape != like.shape or (e.num is None) == pair):
            if not self._warned_reset:  # e.g. a parameter order that changed between runs
                self._warned_reset = True
                _warn_user(f"gns_kernels: the noise pool of key {key!r} held shape "
                           f"{tuple(e.P.shape)}, the measurement has {tuple(like.shape)}: that "
                           "pool starts afresh")
            e = None
        if e is None:
            e = PoolEntry(torch.zeros(like.shape, dtype=torch.float32, device=like.device), pair)
            self._entries[key] = e
        elif e.P.device != like.device:  # not moved by to() (see there)
            self._move(e, like.device)
        return e

    def _move(self, e: PoolEntry, device) -> None:
        for name, t in e.tensors().items():
            setattr(e, name, t.to(device))
        e.block, e.row = None, -1
        self._blocks.clear()

    def _block(self, keys: list, es: list) -> PoolBlock:
        """The block of these keys' entries (made, or remade, when they are not one)."""
        kt = tuple(keys)
        blk = self._blocks.get(kt)
        if blk is None or not blk.holds(es):
            blk = PoolBlock(es)
            ids = {id(e) for e in es}
            for k in [k for k, b in self._blocks.items() if any(id(e) in ids for e in b.entries)]:
                del self._blocks[k]
            self._blocks[kt] = blk
        return blk

    def to(self, device) -> "NoisePool":
        """Move every entry to ``device`` (a checkpoint loads on the CPU; the hooks call this
        where a measurement starts, outside any collective's callback). No-op for entries
        already there."""
        dev = torch.device(device)
        if any(e.P.device != dev for e in self._entries.values()):
            self._join_stream()
        for e in self._entries.values():
            if e.P.device != dev:
                self._move(e, dev)
        return self

    def _weights(self, n: Tensor, U: Tensor, ok: Tensor, num_samples: int) -> tuple[Tensor, Tensor, Tensor]:
        """(b, U', n') of one fold (elementwise over keys; n, U float64, n >= 0): b = beta
        where the pool has a measurement, else 0 (the factor of the old pool), float64;
        U' = b^2 U + (1 - b)^2 / (S - 1) and n' = n + 1 where ok, else U and n."""
        b = n.sign() * self.beta
        cb = 1.0 - b
        U = torch.where(ok, b * b * U + cb * cb / float(num_samples - 1), U)
        return b, U, n + ok.to(torch.float64)

    def fold_variance(self, key: Hashable, mean: Tensor, mean_sq: Tensor, scale: float,
                      num_samples: int, grad_scale: float = 1.0) -> Tensor:
        """Fold one measurement of a key's coordinates; returns its pooled ||s||_1.

        mean, mean_sq: flat tensors of one length (any float dtype), mean_j x^j and
        mean_j (x^j)^2 of this key's coordinates (x = g - shift: s2 does not depend on the
        shift); scale = B / (S - 1); num_samples = S. s2 = clamp(scale (mean_sq - mean^2), 0)
        (float32). Returns a float64 0-d tensor on the inputs' device: grad_scale *
        sum_i sqrt(P_i) / c4(1/U + 1) after the fold, NaN when s2 is not finite (then
        nothing is folded). No host synchronization.
        """
        S = _check_samples(num_samples)
        gs = _check_grad_scale(grad_scale)
        scale = check_scale(scale)   # positive and finite, as variance_norms requires
        if mean.shape != mean_sq.shape or mean.dim() != 1:
            raise ValueError(f"mean, mean_sq: expected two flat tensors of one length, got "
                             f"{tuple(mean.shape)} and {tuple(mean_sq.shape)}")
        m = mean.detach().float()
        s2 = (mean_sq.detach().float() - m * m).mul_(float(scale) / (gs * gs)).clamp_min_(0)
        ok = torch.isfinite(s2.sum(dtype=torch.float64))
        e = self._entry(key, s2, pair=False)
        # in place: the state tensors are never reallocated, so a fold on one CUDA stream
        # and the next on another do not race the caching allocator
        b, U, n = self._weights(e.n, e.U, ok, S)
        e.U.copy_(U)
        e.n.copy_(n)
        b = b.float()
        e.P.copy_(torch.where(ok, e.P * b + (1.0 - b) * s2, e.P))
        root = e.P.sqrt().sum(dtype=torch.float64) / c4_tensor(1.0 / e.U + 1.0)
        nan = torch.full_like(root, math.nan)
        return torch.where(ok, root * gs, nan)

    def fold_covariance(self, key: Hashable, C: Tensor, num_samples: int,
                        grad_scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
        """Fold one measurement's covariance C (k x k, any float dtype) of a key.

        Returns (P, nu, first): P the pooled covariance after the fold (float32 k x k, x
        grad_scale^2: the measurement's units), nu the pool's degrees of freedom
        nu_s / U (float64 0-d), first a 0-d bool tensor, True while no pair of measurements
        exists (the first valid fold: nu is then 0 and meaningless). When C is not finite
        nothing is folded and nu is NaN. No host synchronization. ``fold_covariances``
        with one key (the same values).
        """
        if not isinstance(C, Tensor) or C.dim() != 2 or C.shape[0] != C.shape[1]:
            raise ValueError(f"C: expected a square k x k matrix, got "
                             f"{tuple(C.shape) if isinstance(C, Tensor) else type(C).__name__}")
        P, nu, first = self.fold_covariances([key], C.unsqueeze(0), num_samples, grad_scale)
        return P[0], nu[0], first[0]

    def fold_covariances(self, keys, C: Tensor, num_samples: int,
                         grad_scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
        """``fold_covariance`` of n distinct keys at once: C (n, k, k) (any float dtype), one
        covariance per key, all of one side k. Returns (P (n, k, k) float32, nu (n,)
        float64, first (n,) bool), row i as fold_covariance(keys[i], C[i]) would give. The
        keys' states live stacked in one block per key list (``PoolBlock``, made on the first
        call with that list: the hooks fold the same keys every measurement) and are
        updated by one vectorized expression in place (elementwise and per-matrix
        reductions only: a key's values do not depend on the other keys of the call). No
        host synchronization."""
        S = _check_samples(num_samples)
        gs = _check_grad_scale(grad_scale)
        keys = list(keys)
        if not isinstance(C, Tensor) or C.dim() != 3 or C.shape[-1] != C.shape[-2] or C.shape[0] != len(keys):
            raise ValueError(f"C: expected {len(keys)} square matrices (n, k, k), one per key, got "
                             f"{tuple(C.shape) if isinstance(C, Tensor) else type(C).__name__}")
        if len(set(keys)) != len(keys):
            raise ValueError("keys: expected distinct keys (one fold per key and call)")
        x = C.detach()
        x = x if x.dtype == torch.float32 else x.float()
        if gs != 1.0:
            x = x / (gs * gs)
        x64 = x.double()
        ok = torch.isfinite(x64.sum((-2, -1)))
        like = x[0]
        es = [self._entry(key, like, pair=True) for key in keys]
        blk = self._block(keys, es)
        P = blk.P
        n, U, num, var, npair = blk.st.unbind(1)
        # the pair moments' EMA factor (npair >= 0: sign() is 1 where a pair exists)
        bp = npair.sign() * self.beta
        # the pair moments of this measurement against the pool so far (independent of it)
        have = ok & (n > 0.0)
        P64 = P.double()
        num_k = (x64.diagonal(dim1=-2, dim2=-1).sum(-1) * P64.diagonal(dim1=-2, dim2=-1).sum(-1)
                 + (x64 * P64).sum((-2, -1)))
        d = x64 - P64
        var_k = (d * d).sum((-2, -1)) / (U + 1.0 / (S - 1))
        cbp = 1.0 - bp
        num = torch.where(have, bp * num + cbp * num_k, num)
        var = torch.where(have, bp * var + cbp * var_k, var)
        npair = npair + have.to(torch.float64)
        b, U, n = self._weights(n, U, ok, S)
        bf = b.float().view(-1, 1, 1)
        P = torch.where(ok.view(-1, 1, 1), P * bf + bf.neg().add_(1.0) * x, P)  # 1 - bf
        blk.st.copy_(torch.stack([n, U, num, var, npair], 1))
        blk.P.copy_(P)
        nu_s = dof_from_moments(num, var).clamp_min(NU_S_MIN)  # NaN only where not ok (masked below)
        first = npair == 0.0
        nu = torch.where(first, 0.0, nu_s / U)
        return P * (gs * gs), torch.where(ok, nu, math.nan), first

    # ------------------------------------------------------------------ bookkeeping
    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list:
        return list(self._entries)

    def count(self, key: Hashable) -> Optional[Tensor]:
        """n of a key (0-d float64 device tensor; None when the key has no pool)."""
        e = self._entries.get(key)
        return None if e is None else e.n

    def drop(self, key: Hashable) -> None:
        self._entries.pop(key, None)
        self._blocks.clear()

    def rekey(self, key_map) -> None:
        """Move every entry to ``key_map(key)``; an entry whose new key is None is dropped
        (the keys' owner changed its parameter order)."""
        entries = {k: self._entries[k] for k in self.keys()}
        self._blocks.clear()
        moved = {}
        for k, e in entries.items():
            new = key_map(k)
            if new is not None:
                moved[new] = e
        self._entries.clear()
        self._entries.update(moved)

    def clear(self) -> None:
        self._join_stream()
        self._entries.clear()
        self._blocks.clear()

    def _join_stream(self) -> None:
        """CUDA: order the current stream after the stream of the last fold (a nuclear fold
        runs on its measurement's side stream), so a checkpoint taken before the estimate
        is read does not copy a half-updated pool (issue 30 item 6). Device order only, no
        host wait; called from state_dict / load_state_dict / clear / to, never from a
        collective's callback."""
        s = self.stream
        if s is not None and torch.cuda.is_available():
            torch.cuda.current_stream(s.device).wait_stream(s)

    def state_dict(self, key_map=None) -> dict:
        """{"beta": float, "entries": {key: {"P": tensor, "n": tensor, "U": tensor[, "num",
        "var", "npair"]}}} (tensors moved to the CPU). key_map(key) -> saved key (default:
        the key itself); entries it maps to None are left out. Waits (device order) for the
        last fold's stream first."""
        self._join_stream()
        out = {}
        for k, e in self._entries.items():
            sk = k if key_map is None else key_map(k)
            if sk is not None:
                out[sk] = {name: t.detach().to("cpu", copy=True) for name, t in e.tensors().items()}
        return {"beta": self.beta, "entries": out}

    @staticmethod
    def check_state_dict(sd, name: str = "pool") -> None:
        """ValueError / TypeError naming the bad entry of a NoisePool state_dict
        (gns_kernels.stats.pool_state.check_pool_state_dict)."""
        check_pool_state_dict(sd, name)

    def load_state_dict(self, sd: dict, device=None, key_map=None, name: str = "pool") -> None:
        """Replace the entries by those of ``state_dict()`` (checked first: a rejected
        state_dict changes nothing). key_map(saved key) -> key (None: left out);
        device: where the tensors go (default: where they are, the CPU for a loaded
        checkpoint; ``to()`` moves them later)."""
        self.check_state_dict(sd, name)
        self._join_stream()  # the entries it replaces may still be read by a fold
        entries = {}
        for sk, ent in sd["entries"].items():
            k = sk if key_map is None else key_map(sk)
            if k is None:
                continue
            P = ent["P"].to(device=device, dtype=torch.float32).clone()
            e = PoolEntry(P, pair="num" in ent)
            for t_name in ("n", "U", "num", "var", "npair"):
                if t_name in ent:
                    setattr(e, t_name, ent[t_name].to(device=device, dtype=torch.float64).clone())
            entries[k] = e
        self.beta = float(sd["beta"])
        self._entries = entries
        self._blocks.clear()

    def __repr__(self) -> str:
        return f"NoisePool(beta={self.beta}, entries={len(self._entries)})"
