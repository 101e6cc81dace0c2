"""The loop guard: what a mistake in the training loop changes in the measurement, seen
from the coordinator, named at the user's line.

``LoopGuard`` checks the model once (a layout the measurement handles; DDP over the hook
state's group; a forward pre-hook counting each step's forwards and those under
``no_sync()``), each step's start (no parameter frozen, unfrozen or removed since the
coordinator was built), the loader (``stream.loader_warnings``), the first step's
coverage (every parameter with a gradient is in a passed optimizer), and each step's end:
the optimizers stepped once each, after the micro-batches, with any GradScaler passed
(``check_loop``), and the hook state counted exactly one synchronized backward
(``check_state``). The table of docs/coordinator.md, "Mis-uses", lists each check and
what it costs.
"""
from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .._validation import warn_user
from .attach import refuse_layout
from .watch import GradWatch, param_names

__all__ = ["LoopGuard", "StepProgress", "calling_grad_scaler"]


@dataclass
class StepProgress:
    """Where the run is, besides its schedule: the coordinator's, read and written by its
    rooms (the loop drivers, the guard, the checkpoint)."""

    opt_steps: list = field(default_factory=list)   # optimizer.step() calls in this step, per optimizer
    served: bool = False              # micro_batches() handed out this step's micro-batches
    consumed: int = 0                 # micro-batches handed out in this step
    micro_batches_used: bool = False  # the loop draws its micro-batches from micro_batches()
    samples: int = 0                  # global examples of the completed steps
    sync_mark: int = 0                # the hook state's synchronized backwards when the step began
    loaded: bool = False              # load_state_dict was called
    auto_end: bool = False            # batches(): the step ends when every optimizer has stepped
    in_batches: bool = False          # a batches() loop is running
    warned: set = field(default_factory=set)   # the keys of the warnings given once

    def warn_once(self, key: str, msg: str) -> None:
        """Warn ``AdaptiveBatching: msg`` at the user's line, once per key."""
        if key not in self.warned:
            self.warned.add(key)
            warn_user(f"AdaptiveBatching: {msg}")

    def new_step(self, sync_mark: int, optimizers: int) -> None:
        """A step begins: nothing handed out or stepped yet."""
        self.served, self.consumed = False, 0
        self.opt_steps = [0] * optimizers
        self.sync_mark = sync_mark


def calling_grad_scaler():
    """The torch.amp.GradScaler whose step() is on the call stack (called from an
    optimizer's step post-hook), or None."""
    scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_cls is None:
        return None
    frame = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, scaler_cls):
            return obj
        frame = frame.f_back
    return None


class LoopGuard:
    """The coordinator's loop checks (see the module docstring).

    ``kind``: "ddp", "fsdp" or "micro" (the measurement's transport); ``form``: "model"
    when the coordinator built the measurement (messages name only what the user built);
    ``optimizers``; ``state`` (the hook state); ``progress`` (a ``StepProgress``); ``watch``
    (the step's ``GradWatch``)."""

    def __init__(self, kind: str, form: str, optimizers: list, state, progress: StepProgress,
                 watch: GradWatch):
        self.kind, self.form, self.optimizers, self.state = kind, form, optimizers, state
        self.progress, self.watch = progress, watch
        self.model = None               # the model (given to the coordinator or to micro_batches)
        self.model_checked = None       # the model whose layout check_model accepted
        self.forwards = None            # DDP: forwards through the model in the step, and under no_sync
        self._forward_hook = None
        self.scaler_seen = None         # a GradScaler that stepped the optimizers
        # the parameters that required a gradient when the coordinator was built
        self.trainable = [p for p in self.params() if p.requires_grad]
        self.known = {id(p) for p in self.params()}

    def params(self) -> list:
        return [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]

    # ---------------------------------------------------------------- the model
    def check_model(self, model) -> None:
        """Once per model: a layout the measurement handles (``refuse_layout``); under DDP,
        the hook state reduces over DDP's own process group, and a forward pre-hook notes
        the forwards of each step through the DDP model and whether they ran under
        no_sync() (what ``check_state`` names when no synchronized backward came)."""
        import torch.distributed as dist

        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if self.kind != "fsdp":
            refuse_layout(model, "DDP" if ddp else "module")
        if ddp and self.kind in ("ddp", "micro") and dist.is_available() and dist.is_initialized():
            mine = dist.get_process_group_ranks(self.state.process_group or dist.group.WORLD)
            theirs = dist.get_process_group_ranks(model.process_group)
            if mine != theirs:
                raise ValueError(
                    f"model: DDP reduces over ranks {theirs}, the hook state over {mine}: build the "
                    "state with process_group=ddp.process_group (or pass the DDP model to "
                    "AdaptiveBatching, which does)")
        if ddp:
            self.forwards = [0, 0]
            ref = weakref.ref(self)

            def note_forward(module, args, _ref=ref):
                guard = _ref()
                if guard is not None and guard.forwards is not None:
                    guard.forwards[0] += 1
                    guard.forwards[1] += not module.require_backward_grad_sync
            if self._forward_hook is not None:
                self._forward_hook.remove()
            self._forward_hook = model.register_forward_pre_hook(note_forward)
        self.model_checked = model
        self.watch.model = model

    def use_model(self, model) -> None:
        """The model the loop runs (checked once)."""
        if model is not None:
            self.model = model
        if self.model is not None and self.model is not self.model_checked:
            self.check_model(self.model)

    # ---------------------------------------------------------------- the step's start
    def check_start(self, step: int) -> None:
        """Before the step's first forward: no parameter was frozen, unfrozen or removed
        since the coordinator was built (RuntimeError: the GNS would cover other parameters
        than its EMAs); the step's forward count starts at 0."""
        params = self.params()
        now = {id(p) for p in params if p.requires_grad and id(p) in self.known}
        was = {id(p) for p in self.trainable}
        if now != was:
            names = param_names(self.model)
            current = {id(p) for p in params}
            removed = [names.get(id(p), f"#{i}") for i, p in enumerate(self.trainable)
                       if id(p) not in current]
            frozen = [names.get(id(p), f"#{i}") for i, p in enumerate(params)
                      if id(p) in was and id(p) not in now]
            thawed = [names.get(id(p), f"#{i}") for i, p in enumerate(params)
                      if id(p) in now and id(p) not in was]
            what = (f"removed from the optimizers' param groups: {', '.join(removed[:5])}" if removed else
                    f"frozen (requires_grad False): {', '.join(frozen[:5])}" if frozen else
                    f"unfrozen (requires_grad True): {', '.join(thawed[:5])}")
            raise RuntimeError(
                f"step {step}: parameters were {what} after the coordinator was built. The GNS "
                "is measured over the parameters that get gradients, so from this step on it would "
                "measure other parameters than its EMAs were formed on (docs/coordinator.md, "
                "'Mis-uses'), and DDP would stop its hook. Set requires_grad before building the "
                "optimizers and the coordinator; to change the trained set mid-run, build new "
                "ones over it (the GNS then starts afresh)")
        if self.forwards is not None:
            self.forwards[0] = self.forwards[1] = 0

    def check_coverage(self, warn: Callable[[str], None]) -> bool:
        """After the first step's last backward with a model: every parameter that received
        a gradient should belong to one of the optimizers the coordinator scales (Muon +
        AdamW: pass both); warned through ``warn``. True once checked."""
        named = list(self.model.named_parameters()) if hasattr(self.model, "named_parameters") else None
        if not named:
            return False
        mine = {id(p) for p in self.params()}
        missing = [n for n, p in named if p.grad is not None and id(p) not in mine]
        if missing:
            first = "model" if self.form == "model" else "..."
            warn(f"AdaptiveBatching: {len(missing)} parameters received gradients but are in none "
                 f"of the optimizers passed to the coordinator (e.g. {', '.join(missing[:3])}): "
                 "their learning rate is never multiplied as the batch grows. Pass every "
                 f"optimizer as a list, e.g. AdaptiveBatching({first}, [muon, adamw], ...)")
        return True

    # ---------------------------------------------------------------- the step's end
    def on_optimizer_step(self, optimizer, grad_scaler) -> None:
        """An optimizer's step post-hook: count it, and note a GradScaler that runs it."""
        steps = self.progress.opt_steps
        for i, opt in enumerate(self.optimizers):
            if opt is optimizer:
                steps[i] += 1
        if grad_scaler is None and self.scaler_seen is None:
            self.scaler_seen = calling_grad_scaler()

    def check_loop(self, k: int, grad_scaler, scale_dropped: bool, warn_once) -> None:
        """At the step's end: a GradScaler that steps the optimizers was passed; every
        optimizer stepped once (none: coord.step() before opt.step(), unless a GradScaler
        skipped an inf step, ``scale_dropped``)."""
        steps = self.progress.opt_steps
        if self.scaler_seen is not None and grad_scaler is None:
            raise RuntimeError(
                f"step {k}: a torch.amp.GradScaler steps the optimizers, but AdaptiveBatching "
                "was built without it: the hooks see gradients x the loss scale, so noise and "
                "signal read scale^2 too large and the EMAs mix scales. Pass "
                "AdaptiveBatching(..., grad_scaler=scaler)")
        twice = [i for i, n in enumerate(steps) if n > 1]
        if twice:
            raise RuntimeError(
                f"step {k}: optimizer {twice[0]} (position in the list given to the coordinator) "
                f"stepped {steps[twice[0]]} times in one step: every optimizer steps "
                "once per step (one opt.step() after the step's micro-batches)")
        if not any(steps):
            if not scale_dropped:  # a GradScaler skips the step of an inf / NaN gradient
                raise RuntimeError(
                    f"step {k}: coord.step() was called before optimizer.step(): the coordinator "
                    "then sets the next step's batch and LR before this step's update runs with "
                    "them. Call opt.step() (with a GradScaler: scaler.step(opt); scaler.update()) "
                    "and then coord.step()")
        elif not all(steps):
            idle = [i for i, n in enumerate(steps) if n == 0]
            warn_once("idle-opt", f"step {k}: optimizers {idle} (positions in the list given "
                      "to the coordinator) did not step; every optimizer passed should step "
                      "once per coord.step()")

    def check_state(self, k: int, synced: int, accum_steps: int) -> None:
        """At the step's end: the micro-batches were all consumed, the optimizer stepped
        after them and found gradients, a backward ran, and the hook state counted exactly
        one synchronized backward (``synced``) -- else RuntimeError naming the mistake."""
        pr, w, fw = self.progress, self.watch, self.forwards
        if pr.served and pr.consumed != accum_steps:
            raise RuntimeError(
                f"step {k}: {pr.consumed} of its {accum_steps} micro-batches were consumed; "
                "iterate coord.micro_batches(...) to the end before coord.step()")
        if w.early_step is not None:
            c, A = w.early_step
            raise RuntimeError(
                f"step {k}: opt.step() ran after micro-batch {c} of the step's {A}, inside the "
                "loop over the batch: the optimizer must step once per step, after the last "
                "micro-batch's backward (for x, y in batch: ...backward(); then opt.step(); "
                "opt.zero_grad())")
        if w.no_backward and pr.served and w.grads_none_at_step and self.kind != "micro" and synced == 1:
            # the synchronized backward ran (the hook counted it), yet opt.step() found no gradient
            raise RuntimeError(
                f"step {k}: every gradient was None when opt.step() ran, after this step's "
                "backward passes: opt.zero_grad() was called between the backward and "
                "opt.step() (it clears the gradients the step should apply). Call "
                "opt.step() first, then opt.zero_grad()")
        if w.no_backward and pr.served and (self.kind == "micro" or synced == 0):
            raise RuntimeError(
                f"step {k}: no backward ran in this step (no parameter's gradient changed "
                f"from its first micro-batch to opt.step()), so there was nothing to measure or "
                "to step: run loss.backward() on every micro-batch, inside the loop over the batch"
                + (" (the gradients were None at opt.step(): if the backward ran, "
                   "opt.zero_grad() came before opt.step())" if w.grads_none_at_step else ""))
        if synced == 1:
            return
        if synced == 0 and fw is not None and pr.served and self.kind in ("ddp", "micro"):
            if fw[0] == 0:
                raise RuntimeError(
                    f"step {k}: no forward went through the DDP model in this step, so DDP "
                    "prepared no gradient synchronization and the GNS hook never ran: call the "
                    "DDP model (ddp(x)), not the module it wraps (ddp.module(x) or the model "
                    "DDP was built from)")
            if fw[1] == fw[0]:
                raise RuntimeError(
                    f"step {k}: every forward of this step ran under DDP's no_sync() ({fw[0]} of "
                    f"{fw[0]}), so no backward synchronized the gradients and the GNS hook never "
                    "ran: the coordinator's batch already runs the first A - 1 micro-batches "
                    "under no_sync() and the last one synchronized; remove your own "
                    "no_sync() around the micro-batches")
        if synced == 0 and not pr.served and pr.micro_batches_used:
            raise RuntimeError(
                f"step {k}: coord.step() without this step's micro-batches: no micro-batch was "
                "drawn since the last coord.step() (coord.step() called twice for one optimizer "
                "step?)")
        if synced == 0:
            raise RuntimeError(f"step {k}: the hook state saw no synchronized backward for this "
                               f"optimizer step; {self._no_sync_fix(accum_steps)}")
        raise RuntimeError(
            f"step {k}: the hook state counted {synced} synchronized backward passes for one "
            f"optimizer step (expected 1); the first accum_steps - 1 "
            "micro-batches must skip the synchronization (use the context micro_batches yields)")

    def _no_sync_fix(self, accum_steps: int) -> str:
        """What to do when no synchronized backward came, for this transport and form."""
        model_form = self.form == "model"
        if self.kind == "micro":
            return ("MicroBatchGNS.micro_step() must follow every micro-batch's backward "
                    f"({accum_steps} per step; coord.micro_batches calls it)")
        if self.kind == "fsdp":
            return ("did the backward run through the FSDP2 model given to AdaptiveBatching, "
                    "with set_requires_gradient_sync(True) for the last micro-batch?"
                    if model_form else
                    "is attach_fsdp_gns(model, state) attached to the model that ran backward?")
        fix = ("did the backward run through the DDP model given to AdaptiveBatching?"
               if model_form else
               "register the hook: ddp.register_comm_hook(state, gk.ddp_gns_hook)")
        frozen = [n for n, p in getattr(self.model, "named_parameters", lambda: [])()
                  if not p.requires_grad]
        return ("DDP runs the comm hook only once every gradient bucket is ready: a "
                "parameter that got no gradient in this backward stops it (DDP itself "
                "reports that at the next forward, unless find_unused_parameters=True). "
                + (f"These parameters do not require a gradient now: {', '.join(frozen[:5])}"
                   f"{' ...' if len(frozen) > 5 else ''}; if they were frozen after DDP was "
                   "built, rebuild DDP (or build it with find_unused_parameters=True). "
                   if frozen else "A parameter unused in this forward does the same "
                   "(find_unused_parameters=True). ")
                + "Otherwise: " + fix)
