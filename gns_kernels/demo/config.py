"""Configuration of one `gns-kernels demo` run: the `DemoConfig` dataclass, its derived
values (geometry, theta, LR, multiple_of, warm-up) and `validate`, which turns every bad
value into a one-line `DemoError` before any process is started.

A `DemoConfig` is written to ``<out>/config.json`` and stored in ``checkpoint.pt``;
`config_from_dict` reads it back (unknown keys are an error) and `trajectory_diff`
lists the keys in which two configurations would train differently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from ..stats.gns import GEOMETRIES

OPTIMIZERS = ("muon", "specsgd", "signum", "signsgd", "adamw", "sgd", "msgd")
COMPOSITES = ("muon", "specsgd")
# main learning rate per optimizer (the AdamW part of the composites uses --adam-lr)
DEFAULT_LR = {"muon": 0.02, "specsgd": 0.02, "signum": 1e-3, "signsgd": 3e-4,
              "adamw": 3e-3, "sgd": 0.3, "msgd": 0.05}
COMPARE_SAMPLES = 6000   # default budget of each --compare run (four runs in < 15 min here)
METRIC_COLUMNS = ["step", "samples", "lr", "batch_size", "gns_raw", "gns_ema", "train_loss",
                  "val_loss", "lr_multiplier", "accum_steps", "micro_batch", "elapsed_s",
                  "noise", "signal", "noise_pooled"]
DEFAULT_TIMEOUT = 300.0  # seconds: process-group set-up and any one collective
# keys that change how a run is watched or where it stops, not what it computes: a resumed
# run may differ from its checkpoint in these
RUN_ONLY_KEYS = ("out", "quiet", "stop_at_step", "timeout")


class DemoError(Exception):
    """A bad command-line input: printed as one line, exit status 2."""


@dataclass
class DemoConfig:
    ranks: int = 2
    optimizer: str = "muon"
    geometry: str | None = None          # None: geometry_for(optimizer)
    theta: float | None = None           # None: 0.6 (l1/nuclear) or 0.3 (l2)
    every: int = 5
    warmup: int | None = None            # steps; None: the LR warm-up length at B_0
    initial_batch_size: int = 16
    max_batch_size: int | None = 512
    max_local_batch: int = 32
    micro_batches: int = 1               # minimum micro-batches per rank (>= 2 for 1 rank)
    multiple_of: int | None = None       # None: R x b, b the micro-batch size split_initial_batch gives
    adaptive: bool = True
    samples: int = 8000                  # sample (sequence) budget
    steps: int | None = None             # optional cap on optimizer steps
    lr: float | None = None
    adam_lr: float = 3e-3
    lr_warmup: float = 0.15              # fraction of the sample budget
    lr_min_ratio: float = 0.1
    lr_scale: float = 1.0                # extra constant LR factor (large-batch baseline)
    seed: int = 0
    dim: int = 128
    layers: int = 2
    heads: int = 4
    mlp: int = 384
    context: int = 64
    corpus: str | None = None
    eval_every: int = 25
    val_windows: int = 192
    checkpoint_every: int = 200
    out: str = ""
    label: str = "adaptive"
    quiet: bool = False
    stop_at_step: int | None = None      # stop after this step as if interrupted (resumable)
    bias_correction: bool = True
    timeout: float = DEFAULT_TIMEOUT     # seconds before a stalled rank ends the run
    extra: dict = field(default_factory=dict)

    # -- derived ---------------------------------------------------------------------------
    def resolved_geometry(self) -> str:
        """--geometry, else gk.geometry_for of the optimizer classes the run builds."""
        if self.geometry is not None:
            return self.geometry
        from ..optim import geometry_for
        return geometry_for(optimizer_classes(self.optimizer))

    def resolved_theta(self) -> float:
        if self.theta is not None:
            return self.theta
        return 0.3 if self.resolved_geometry() == "l2" else 0.6

    def resolved_lr(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

    def resolved_multiple_of(self) -> int:
        """The step of the batch size: R x b (every B is a multiple of it). --multiple-of M
        sets it (so b = M / R); by default b is the micro-batch size of B_0's split
        (`split_initial_batch`)."""
        if self.multiple_of is not None:
            return self.multiple_of
        return self.ranks * split_initial_batch(self.initial_batch_size, self.ranks,
                                                self.max_local_batch, self.micro_batches)[1]

    def micro_batch_size(self) -> int:
        """b, sequences per micro-batch per rank, fixed for the whole run (B = R x A x b:
        a growing batch accumulates more micro-batches, A, of the same size)."""
        return self.resolved_multiple_of() // self.ranks

    def resolved_warmup(self) -> int:
        if self.warmup is not None:
            return self.warmup
        return int(math.ceil(self.lr_warmup * self.samples / self.initial_batch_size))


def split_initial_batch(batch_size: int, ranks: int, max_local_batch: int,
                        min_micro_batches: int) -> tuple[int, int]:
    """(A_0, b): B_0 = ranks x A_0 x b with the largest micro-batch b <= max_local_batch
    that leaves at least min_micro_batches micro-batches per rank. b stays fixed for the
    run (AdaptiveBatching). DemoError when B_0 does not split so."""
    where = f"--initial-batch-size {batch_size} does not split across {ranks} ranks x micro-batches"
    if batch_size % ranks:
        raise DemoError(f"{where}: it is not a multiple of {ranks}")
    local = batch_size // ranks
    for b in range(min(max_local_batch, local // min_micro_batches), 0, -1):
        if local % b == 0:
            return local // b, b
    raise DemoError(f"{where}: {local} sequences per rank give fewer than the {min_micro_batches} "
                    "micro-batches per rank asked for (--micro-batches)")


def optimizer_classes(name: str) -> list[type]:
    """The optimizer classes of --optimizer `name` (main first; the composites add AdamW
    for the embedding, head and norm gains). demo/loop.py builds exactly these."""
    import torch

    from ..optim import SignSGD, Signum, SpecSGD
    return {"muon": [torch.optim.Muon, torch.optim.AdamW],
            "specsgd": [SpecSGD, torch.optim.AdamW],
            "signum": [Signum], "signsgd": [SignSGD], "adamw": [torch.optim.AdamW],
            "sgd": [torch.optim.SGD], "msgd": [torch.optim.SGD]}[name]


def config_from_dict(data, source: str) -> DemoConfig:
    """A DemoConfig from a config.json dict; DemoError naming `source` and the offending
    key when it is not a dict, has keys DemoConfig does not know, or holds a value of the
    wrong kind (missing keys take their defaults)."""
    if not isinstance(data, dict):
        raise DemoError(f"{source}: expected a JSON object of demo options, got {type(data).__name__}")
    known = {f.name for f in fields(DemoConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise DemoError(f"{source}: unknown key(s) {', '.join(unknown)} (not a demo option of "
                        "this version)")
    for f in fields(DemoConfig):
        if f.name in data and not _has_type(data[f.name], f.type):
            raise DemoError(f"{source}: {f.name} must be {f.type}, got {data[f.name]!r}")
    return DemoConfig(**data)


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,),
          "None": (type(None),)}


def _has_type(value, annotation: str) -> bool:
    """Whether `value` (from JSON) fits a DemoConfig field annotation such as
    "int | None" (bools are not ints here)."""
    for name in annotation.split("|"):
        kinds = _TYPES[name.strip()]
        if isinstance(value, bool) and bool not in kinds:
            continue
        if isinstance(value, kinds):
            return True
    return False


def trajectory_diff(a: dict, b: dict) -> list[str]:
    """Keys (sorted) whose values differ between two asdict(DemoConfig) dicts, ignoring
    RUN_ONLY_KEYS; a key missing on one side counts as different."""
    keys = (set(a) | set(b)) - set(RUN_ONLY_KEYS)
    return sorted(k for k in keys if k not in a or k not in b or a[k] != b[k])


def _finite_positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise DemoError(f"{name} must be a finite number > 0, got {value}")


def check_theta(theta: float | None) -> None:
    """DemoError unless --theta is None (the geometry's default) or a finite number > 0: the
    one check of --theta, for a single run (`validate`) and the protocol (`run_paper`)."""
    _finite_positive("--theta", theta, allow_none=True)


def validate(cfg: DemoConfig, world: int | None = None) -> None:
    """Raise DemoError (one line, naming the option) on bad input. `world`: the process
    count when it is fixed by a launcher (torchrun), else cfg.ranks."""
    if cfg.optimizer not in OPTIMIZERS:
        raise DemoError(f"unknown --optimizer {cfg.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    if cfg.geometry is not None and cfg.geometry not in GEOMETRIES:
        raise DemoError(f"unknown --geometry {cfg.geometry!r}; expected one of {', '.join(GEOMETRIES)}")
    if cfg.ranks < 1:
        raise DemoError(f"--ranks must be >= 1, got {cfg.ranks}")
    check_theta(cfg.theta)
    for name, value, lo in (("--every", cfg.every, 1), ("--samples", cfg.samples, 1),
                            ("--initial-batch-size", cfg.initial_batch_size, 1),
                            ("--max-local-batch", cfg.max_local_batch, 1),
                            ("--micro-batches", cfg.micro_batches, 1),
                            ("--eval-every", cfg.eval_every, 1), ("--val-windows", cfg.val_windows, 1),
                            ("--checkpoint-every", cfg.checkpoint_every, 1),
                            ("--dim", cfg.dim, 2), ("--layers", cfg.layers, 1),
                            ("--heads", cfg.heads, 1), ("--mlp", cfg.mlp, 1),
                            ("--context", cfg.context, 1), ("--seed", cfg.seed, 0)):
        if value < lo:
            raise DemoError(f"{name} must be >= {lo}, got {value}")
    for name, value in (("--steps", cfg.steps), ("--warmup", cfg.warmup)):
        if value is not None and value < (1 if name == "--steps" else 0):
            raise DemoError(f"{name} must be >= {1 if name == '--steps' else 0}, got {value}")
    if cfg.stop_at_step is not None and cfg.stop_at_step < 1:
        raise DemoError(f"--stop-at-step must be >= 1, got {cfg.stop_at_step}")
    if not (math.isfinite(cfg.lr_warmup) and 0.0 <= cfg.lr_warmup < 1.0):
        raise DemoError(f"--lr-warmup must be in [0, 1), got {cfg.lr_warmup}")
    _finite_positive("--lr", cfg.lr, allow_none=True)
    _finite_positive("--adam-lr", cfg.adam_lr)
    _finite_positive("--timeout", cfg.timeout)
    _finite_positive("lr_scale", cfg.lr_scale)
    if not (math.isfinite(cfg.lr_min_ratio) and 0.0 <= cfg.lr_min_ratio <= 1.0):
        raise DemoError(f"--lr-min (lr_min_ratio) must be in [0, 1], got {cfg.lr_min_ratio}")
    if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
        raise DemoError(f"--dim {cfg.dim} must split into --heads {cfg.heads} heads of even size")
    ranks = cfg.ranks if world is None else world
    if ranks * cfg.micro_batches < 2:
        raise DemoError("one rank needs --micro-batches >= 2 (the micro-batches are the GNS samples)")
    split_initial_batch(cfg.initial_batch_size, ranks, cfg.max_local_batch, cfg.micro_batches)
    mult = replace(cfg, ranks=ranks).resolved_multiple_of()
    if mult < 1 or mult % ranks:
        raise DemoError(f"--multiple-of {mult} must be a positive multiple of the ranks "
                        f"({ranks}): it is ranks x the micro-batch size")
    if cfg.initial_batch_size % mult:
        raise DemoError(f"--initial-batch-size {cfg.initial_batch_size} must be a multiple of "
                        f"--multiple-of {mult}")
    if cfg.initial_batch_size // mult < cfg.micro_batches:
        raise DemoError(f"--multiple-of {mult} gives micro-batches of {mult // ranks} sequences, "
                        f"so --initial-batch-size {cfg.initial_batch_size} is "
                        f"{cfg.initial_batch_size // mult} micro-batches per rank, fewer than "
                        f"--micro-batches {cfg.micro_batches}")
    if mult // ranks > cfg.max_local_batch:
        raise DemoError(f"--multiple-of {mult} gives micro-batches of {mult // ranks} sequences "
                        f"per rank, above --max-local-batch {cfg.max_local_batch}")
    if cfg.samples < cfg.initial_batch_size:
        raise DemoError(f"--samples {cfg.samples} is less than one batch "
                        f"(--initial-batch-size {cfg.initial_batch_size})")
    if cfg.max_batch_size is not None:
        if cfg.max_batch_size < cfg.initial_batch_size:
            raise DemoError(f"--max-batch-size {cfg.max_batch_size} is below --initial-batch-size "
                            f"{cfg.initial_batch_size}")
        if cfg.adaptive and cfg.max_batch_size % mult:  # a constant run never reaches the cap
            raise DemoError(f"--max-batch-size {cfg.max_batch_size} must be a multiple of "
                            f"--multiple-of {mult} (so that the capped batch still splits "
                            "equally across ranks x micro-batches)")


def validate_corpus(cfg: DemoConfig, corpus) -> None:
    """DemoError when the corpus is too short for one training and one validation window
    of --context + 1 bytes."""
    for split, stream in (("training", corpus.train), ("validation", corpus.val)):
        if (stream.numel() - 1) // cfg.context < 1:
            raise DemoError(f"--context {cfg.context} is longer than the corpus's {split} text "
                            f"({stream.numel()} bytes in {corpus.root!r}); use a smaller "
                            "--context or a larger --corpus")
