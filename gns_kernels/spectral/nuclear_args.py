"""The arguments of ``nuclear_stats``, checked: the layers' Gram sides and other dimensions,
the scalars, the selection, and ``NuclearRequest`` (what a call solves and returns beyond
(noise, signal)). Every check raises ValueError naming the argument (``mean_grams[3]``,
``select``, ...); none reads tensor data unless validation is asked for (host sync)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ._checks import check_square, validate_requested, validate_symmetric
from .hints import EigHints
from .solver import check_solver
from .._validation import check_signal

Tensor = torch.Tensor

__all__ = ["NuclearRequest", "check_common", "check_form", "check_select", "debias_factor",
           "layers_of_grads", "layers_of_grams", "merge_other_dims", "validate_layers"]


@dataclass(frozen=True, kw_only=True)
class NuclearRequest:
    """What a ``nuclear_stats(..., request=)`` call solves and returns besides (noise,
    signal): it then returns a NuclearResult (nuclear_solve.py) instead of the pair.

    select: None (every sqrt-trace) or (noise_mask, signal_mask), one bool per layer each:
      only the selected noise tr(C_l^{1/2}) / signal ||G_l||_S1 are solved, the others
      are 0 (a layer with neither selected costs nothing but its argument checks).
    record_hints: True records the eigensolver's report (which layers needed float64) into
      the call's eig_hints (a host read of the solver's flags); False leaves eig_hints
      untouched, and the report is NuclearResult.used64 either way, so a caller can
      combine the reports of several processes first.
    sums: True: the noise is the raw tr(C_l^{1/2}) whatever bias_correction says, and
      NuclearResult.sums is a float64 Tensor[4, L] of the selected noise matrices'
      [tr C^{1/2}, pair sum sum_ij s_i s_j / (s_i + s_j), tr C, ||C||_F^2] (0 elsewhere):
      what a correction with a dof known only later needs
      (bias.nuclear_sqrt_trace_corrected_from_sums; the hooks' 'gauss-sums' dof).
    covariances: True: NuclearResult.covariances lists (l, C_l) for every selected noise
      matrix in ascending l, C_l = scale (mean_gram_l - D_l D_l^T) (k x k, float32, or
      float64 when a Gram is): the covariance the noise solves (the hooks' noise pool).
    pool_fold (Newton or host route, with sums): None, or a callable (ls, C) -> P called
      once per Gram size with the selected noise matrices' layer indices ls (ascending)
      and their covariances C (len(ls), k, k, float64); it returns the pooled matrices P
      (same shape), whose sqrt-traces and pair sums join the same solve as the noise and
      signal matrices (the Newton chain, or the host's float64 eigvalsh):
      NuclearResult.pooled, float64 [tr P^{1/2}, pair sum] per layer (Tensor[2, L], 0
      where not selected).
    """

    select: Optional[tuple] = None
    record_hints: bool = True
    sums: bool = False
    covariances: bool = False
    pool_fold: Optional[Callable] = None

    def __post_init__(self) -> None:
        sel = self.select
        if sel is not None:
            if not (isinstance(sel, (tuple, list)) and len(sel) == 2):
                raise ValueError("select: expected (noise_mask, signal_mask), two sequences of bools")
            masks = []
            for name, mask in zip(("noise_mask", "signal_mask"), sel):
                if not isinstance(mask, (tuple, list)) or not all(isinstance(b, bool) for b in mask):
                    raise ValueError(f"select: expected {name} as a sequence of bools (one per layer), got {mask!r}")
                masks.append(tuple(mask))
            object.__setattr__(self, "select", (masks[0], masks[1]))
        for name in ("record_hints", "sums", "covariances"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.pool_fold is not None:
            if not callable(self.pool_fold):
                raise ValueError(f"pool_fold: expected None or a callable (ls, C) -> P, got {self.pool_fold!r}")
            if not self.sums:
                raise ValueError("pool_fold: needs sums=True (and the Newton or host route)")


def check_common(scale, bias_correction, num_samples, method, eig_hints) -> None:
    """The scalar arguments both input forms share."""
    if not isinstance(bias_correction, bool):
        raise ValueError(f"bias_correction: expected a bool, got {bias_correction!r}")
    if bias_correction and num_samples is None:
        raise ValueError("num_samples: bias_correction=True needs the number of samples R")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number (B/(R-1)), got {scale!r}")
    check_solver(method)
    if eig_hints is not None and not isinstance(eig_hints, EigHints):
        raise ValueError(f"eig_hints: expected a gns_kernels.spectral.EigHints, got {type(eig_hints).__name__}")


def debias_factor(signal: str, scale: float, batch_size) -> float | None:
    """c = scale / B for signal='debiased' (the signal matrix G G^T - C / B), else None."""
    if check_signal(signal) == "raw":
        return None
    try:
        B = float(batch_size)
    except (TypeError, ValueError):
        B = math.nan
    if not (math.isfinite(B) and B > 0):
        raise ValueError(f"batch_size: signal='debiased' needs the global batch size B > 0, got {batch_size!r}")
    return float(scale) / B


def check_gram(A, name: str) -> int:
    """k of the k x k matrix A (ValueError naming ``name`` otherwise)."""
    check_square(A, name)
    if A.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D k x k matrix, got shape {tuple(A.shape)}")
    return A.shape[-1]


def merge_other_dims(other_dims, others: list, L: int) -> list:
    """others with the entries of other_dims that are not None in their place."""
    if other_dims is None:
        return others
    other_dims = _per_layer("other_dims", other_dims, L, "entries")
    return [o if o is not None else d for o, d in zip(other_dims, others)]


def check_select(select, L: int) -> tuple[list, list]:
    """(noise_mask, signal_mask) of a NuclearRequest's select (None: everything), L each."""
    if select is None:
        return [True] * L, [True] * L
    out = []
    for name, mask in zip(("noise_mask", "signal_mask"), select):
        if len(mask) != L:
            raise ValueError(f"select: expected {name} as {L} bools (one per layer), got {list(mask)!r}")
        out.append(list(mask))
    return out[0], out[1]


def layers_of_grads(mean_grams: list, mean_grads, shifts, side: str) -> tuple[list, list | None, list, list]:
    """(mean_grads, shifts, sides, others) of the gradient form: per layer the Gram side
    of mean_grams[l] ('row': k == m, 'col': k == n; ``side`` breaks the tie of a square
    matrix) and the other dimension of mean_grads[l] (m x n)."""
    L = len(mean_grams)
    if mean_grads is None:
        raise ValueError("mean_grads: expected one 2-D tensor per mean_grams entry, got None "
                         "(with only the Gram of the mean gradient pass mean_grad_grams=)")
    mean_grads = _per_layer("mean_grads", mean_grads, L, "tensors (one per mean_grams entry)")
    if shifts is not None:
        shifts = _per_layer("shifts", shifts, L, "entries (tensor or None)")
    if side not in ("auto", "row", "col"):
        raise ValueError(f"side: expected 'auto', 'row' or 'col', got {side!r}")
    sides: list[str] = []
    others: list[int | None] = []
    for l, A in enumerate(mean_grams):
        k = check_gram(A, f"mean_grams[{l}]")
        D = mean_grads[l]
        if not isinstance(D, Tensor) or D.dim() != 2:
            raise ValueError(f"mean_grads[{l}]: expected a 2-D tensor, got "
                             f"{tuple(D.shape) if isinstance(D, Tensor) else type(D).__name__}")
        if not D.is_floating_point():
            raise ValueError(f"mean_grads[{l}]: expected a floating dtype, got {D.dtype}")
        m, n = D.shape
        if m == n == k:
            s = "col" if side == "col" else "row"
        elif m == k:
            s = "row"
        elif n == k:
            s = "col"
        else:
            raise ValueError(f"mean_grams[{l}]: {k}x{k} does not match either side of mean_grads[{l}] "
                             f"of shape {(m, n)}")
        sides.append(s)
        others.append(n if s == "row" else m)
        if shifts is not None and shifts[l] is not None and tuple(shifts[l].shape) != (m, n):
            raise ValueError(f"shifts[{l}]: expected shape {(m, n)} like mean_grads[{l}], got "
                             f"{tuple(shifts[l].shape)}")
    return mean_grads, shifts, sides, others


def layers_of_grams(mean_grams: list, mean_grad_grams, signal_grams, shapes, eig_hints) -> tuple[list, list | None, list | None, list]:
    """(mean_grad_grams, signal_grams, shapes, others) of the Gram form: each Gram k x k
    like mean_grams[l]; shapes[l] the parameter shape (m, n) with one side k (required
    with eig_hints), whose other side is others[l] (None without shapes)."""
    L = len(mean_grams)
    mean_grad_grams = _per_layer("mean_grad_grams", mean_grad_grams, L, "tensors")
    if signal_grams is not None:
        signal_grams = _per_layer("signal_grams", signal_grams, L, "tensors")
    if shapes is not None:
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if len(shapes) != L:
            raise ValueError(f"shapes: expected {L} parameter shapes, got {len(shapes)}")
    elif eig_hints is not None:
        raise ValueError("shapes: eig_hints needs the parameter shape of every layer")
    others: list[int | None] = []
    for l, A in enumerate(mean_grams):
        k = check_gram(A, f"mean_grams[{l}]")
        for name, lst in (("mean_grad_grams", mean_grad_grams), ("signal_grams", signal_grams)):
            if lst is not None and (not isinstance(lst[l], Tensor) or tuple(lst[l].shape) != (k, k)):
                got = tuple(lst[l].shape) if isinstance(lst[l], Tensor) else type(lst[l]).__name__
                raise ValueError(f"{name}[{l}]: expected shape {(k, k)} like mean_grams[{l}], got {got}")
        if shapes is not None:
            if len(shapes[l]) != 2 or k not in shapes[l]:
                raise ValueError(f"shapes[{l}]: expected a 2-D shape with one side {k} like mean_grams[{l}], "
                                 f"got {shapes[l]}")
            m, n = shapes[l]
            others.append(n if m == k else m)
        else:
            others.append(None)
    return mean_grad_grams, signal_grams, shapes, others


def validate_layers(validate: bool, mean_grams: list, mean_grads, mean_grad_grams, signal_grams) -> None:
    """With validate=True (or env GNS_KERNELS_VALIDATE=1): every Gram finite and symmetric,
    every mean gradient finite (reads the data: a host synchronization)."""
    if not validate_requested(validate):
        return
    for l in range(len(mean_grams)):
        validate_symmetric(mean_grams[l], f"mean_grams[{l}]")
        if mean_grads is not None and not bool(torch.isfinite(mean_grads[l]).all()):
            raise ValueError(f"mean_grads[{l}]: contains non-finite values")
        if mean_grad_grams is not None:
            validate_symmetric(mean_grad_grams[l], f"mean_grad_grams[{l}]")
        if signal_grams is not None:
            validate_symmetric(signal_grams[l], f"signal_grams[{l}]")


def check_form(mean_grads, mean_grad_grams, shifts, side, signal_grams, shapes) -> None:
    """The arguments of one input form only: the gradient form (mean_grads, shifts, side)
    or the Gram form (mean_grad_grams, signal_grams, shapes); ValueError naming the first
    argument of the other form."""
    if mean_grad_grams is None:
        extra = [n for n, v in (("signal_grams", signal_grams), ("shapes", shapes)) if v is not None]
        why = "only with mean_grad_grams (from mean_grads they are formed here)"
    else:
        extra = [n for n, v in (("mean_grads", mean_grads), ("shifts", shifts)) if v is not None]
        extra += ["side"] if side != "auto" else []
        why = ("not with mean_grad_grams (pass D_l or D_l D_l^T, not both; the Gram of the shifted "
               "mean gradient goes in signal_grams)")
    if extra:
        raise ValueError(f"{extra[0]}: {why}")


def _per_layer(name: str, values, L: int, what: str) -> list:
    """``values`` as a list of L entries, else ValueError naming ``name`` ("expected {L}
    {what}, got n")."""
    values = list(values)
    if len(values) != L:
        raise ValueError(f"{name}: expected {L} {what}, got {len(values)}")
    return values
