"""What a step's backward passes did to the gradients, read without a host synchronization
on the path: whether the step began from zero gradients, whether a backward ran, whether
the gradients were reset between micro-batches, whether the optimizer stepped inside the
step. ``GradWatch`` keeps these per step; the coordinator raises on them at the step's
end (``check_before_read`` / ``check_after_read``) and its loop guard reads the rest.

Reads happen in one-shot hooks: when a backward's first gradient is computed, before it is
added to any ``.grad`` (``torch.autograd.graph.register_multi_grad_hook``), or, under FSDP2,
whose sharded parameters autograd never reaches, at the model output's gradient. Device
flags (``any_nonzero``) are read after the measurement's estimate, when the device is idle.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["GradWatch", "any_nonzero", "param_names"]


def any_nonzero(grads: list):
    """A device bool tensor: some gradient in ``grads`` holds a value other than 0 (NaN
    counts), with no host synchronization (one foreach max-abs pass per device)."""
    by_device: dict = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    flags = []
    for gs in by_device.values():
        norms = torch._foreach_norm(gs, float("inf"))
        flags.append(torch.stack([n.float() for n in norms]).ne(0).any())
    if len(flags) == 1:
        return flags[0]
    return torch.stack([f.cpu() for f in flags]).any()


def param_names(model) -> dict:
    """{id(parameter): name} of ``model`` (empty without a model)."""
    return {id(p): n for n, p in model.named_parameters()} if hasattr(model, "named_parameters") else {}


def _local(g):
    return getattr(g, "_local_tensor", g)


class GradWatch:
    """The gradient facts of the step in progress (see the module docstring).

    ``fsdp``: the parameters are FSDP2's sharded ones (reads at the model output's gradient).
    Fields read by the loop guard: ``no_backward`` (no gradient changed from the step's
    start to its first ``opt.step()``), ``grads_none_at_step`` (every gradient None then),
    ``early_step`` ((micro-batches consumed, A) at an ``opt.step()`` inside the step)."""

    def __init__(self, fsdp: bool):
        self.fsdp = fsdp
        self.model = None
        self._arm = None            # the one-shot hook that reads the gradients at the next backward
        self.reset()

    def reset(self) -> None:
        """A new step: nothing seen yet."""
        self.disarm()
        self.stale = None           # device flag: a gradient was not zero at the step's first backward
        self.marks = None           # (grad identity, version) of every parameter at the step's start
        self.no_backward = None
        self.grads_none_at_step = False
        self.early_step = None
        self.zeroed = None          # names of gradients reset between micro-batches
        self.zeroed_flag = None     # device flag: gradients written in place and all zero again
        self._held = None           # measuring step: (gradient, version) after the last micro-batch

    # ---------------------------------------------------------------- the step's start
    def begin(self, params: list, measuring: bool) -> None:
        """Before the step's first micro-batch: note every gradient's identity and version (a
        backward changes them); on a measuring step whose gradients are not all None, read
        them when the first backward begins (a loop may zero them inside its first
        micro-batch, before its forward or between forward and backward)."""
        self.reset()
        if measuring and any(p.grad is not None for p in params):
            self._arm_read(params, self._read_stale)
        self.marks = [None if p.grad is None else (id(p.grad), p.grad._version) for p in params]

    def _read_stale(self, params) -> None:
        grads = [_local(p.grad) for p in params if p.grad is not None]
        self.stale = any_nonzero(grads) if grads else None

    # ---------------------------------------------------------------- between micro-batches
    def hold(self, params: list) -> None:
        """Measuring steps, after each micro-batch but the last: note the gradient objects,
        and at the next backward check that none was reset."""
        self._held = [(p.grad, None if p.grad is None else p.grad._version) for p in params]
        self.disarm()
        self._arm_read(params, self._read_reset)

    def _read_reset(self, params) -> None:
        """At a micro-batch's first backward: gradients the previous micro-batches left that
        are gone (None, or another tensor: ``zero_grad()``, which sets them to None), named;
        and a device flag for gradients written in place since and all zero now
        (``zero_grad(set_to_none=False)``): gradients that are exactly zero by themselves (a
        saturated softmax) were not written, and are not flagged."""
        held, self._held = self._held, None
        if held is None or len(held) != len(params):
            return
        names = param_names(self.model)
        reset = [names.get(id(p), f"#{i}") for i, (p, (g, _)) in enumerate(zip(params, held))
                 if g is not None and p.grad is not g]
        if reset and self.zeroed is None:
            self.zeroed = reset
        kept = [(g, v) for g, v in held if g is not None]
        if kept and not reset and all(g._version != v for g, v in kept):
            zero = any_nonzero([_local(g) for g, _ in kept]).logical_not()
            self.zeroed_flag = zero if self.zeroed_flag is None else self.zeroed_flag | zero

    # ---------------------------------------------------------------- the optimizer's step
    def on_optimizer_step(self, params: list, served: bool, consumed: int, A: int) -> None:
        """An optimizer stepped: at the step's first, whether a backward changed any
        gradient since the step began (before any zero_grad) and whether all were None; and
        a step taken before the step's micro-batches were all handed out."""
        if self.marks is not None and self.no_backward is None:
            marks = self.marks
            self.no_backward = len(marks) == len(params) and all(
                (p.grad is None and m is None)
                or (p.grad is not None and m == (id(p.grad), p.grad._version))
                for p, m in zip(params, marks))
            self.grads_none_at_step = all(p.grad is None for p in params)
        if served and consumed < A and self.early_step is None:
            self.early_step = (consumed, A)

    # ---------------------------------------------------------------- the step's end
    def check_before_read(self, k: int) -> None:
        """Measuring step k, before its estimate is read: gradients reset between its
        micro-batches (RuntimeError)."""
        if self.zeroed:
            raise RuntimeError(
                f"step {k}: gradients were reset between the step's micro-batches (e.g. "
                f"{', '.join(self.zeroed[:3])}): opt.zero_grad() inside the loop over "
                "the batch keeps only the last micro-batch's gradient, so the step trains on 1/A "
                "of its batch and its GNS measurement is wrong. Call opt.zero_grad() once per "
                "step, after opt.step() (or before the first micro-batch); the measurement of "
                "this step is not used")

    def check_after_read(self, k: int) -> None:
        """Measuring step k, after its estimate was read (the device is idle: no wait):
        gradients zeroed in place between micro-batches, or not zero when the step began
        (RuntimeError)."""
        if self.zeroed_flag is not None and bool(self.zeroed_flag):
            raise RuntimeError(
                f"step {k}: the gradients were zeroed between the step's micro-batches "
                "(opt.zero_grad(set_to_none=False) inside the loop over the batch): only the "
                "last micro-batch's gradient is left, so the step trains on 1/A of its batch and "
                "its GNS measurement is wrong. Call opt.zero_grad() once per step, after "
                "opt.step() (or before the first micro-batch); the measurement of this step is "
                "not used")
        if self.stale is not None and bool(self.stale):
            raise RuntimeError(
                f"step {k}: the gradients were not zero when this step's first micro-batch "
                "began, so its backward passes added to the previous step's gradients "
                "(opt.zero_grad() missing after opt.step()?): the step and its GNS measurement "
                "mix two steps (one rank: the GNS came out 2-3x too large and B reached its cap). "
                "Call opt.zero_grad() after every opt.step(); the measurement of this step is "
                "not used")

    # ---------------------------------------------------------------- hooks
    def _arm_read(self, params, read) -> None:
        """Call ``read(params)`` once, when the next backward's first gradient is computed
        and before it is added to any ``.grad``; under FSDP2 at the model output's gradient
        (read now without a model to watch). Costs one Python call per parameter in that
        one backward (measuring steps only)."""
        ref = weakref.ref(self)

        def fire(*_):
            watch = ref()
            if watch is not None and watch._arm is not None:
                watch.disarm()
                read(params)
        if self.fsdp:
            if self.model is None:
                read(params)
                return

            def on_output(module, args, output):
                # the backward's start: a hook on the model output's gradient fires before
                # any parameter gradient is accumulated
                out = next((t for t in torch.utils._pytree.tree_leaves(output)
                            if isinstance(t, torch.Tensor) and t.requires_grad), None)
                if out is None:
                    fire()
                    return
                watch = ref()
                if watch is not None:
                    watch.disarm()
                    watch._arm = out.register_hook(lambda grad: fire())
            self._arm = self.model.register_forward_hook(on_output)
            return
        leaves = [p for p in params if p.requires_grad]
        if leaves:
            self._arm = torch.autograd.graph.register_multi_grad_hook(leaves, fire, mode="any")

    def disarm(self) -> None:
        if self._arm is not None:
            self._arm.remove()
            self._arm = None

    def refused(self) -> None:
        """The step's first micro-batch was refused: nothing of the step happened."""
        self.marks = self.stale = self.no_backward = None
        self.disarm()
