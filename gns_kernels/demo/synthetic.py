"""Small built-in models and synthetic data with EXACT gradient-noise ground truth.

A finite data set of N examples is treated as the data distribution: examples are drawn
uniformly WITH replacement, so the single-example gradient's mean, per-coordinate variance
and row covariance are exactly the population (ddof 0) moments over the N per-example
gradients, which torch.func computes exactly (vmap(grad)). Simulated ranks partition a
drawn batch of B examples into R samples of b = B/R and average each.

Typical use (what tests and `gns-kernels estimate` do):

    model = make_model("mlp", seed=0)                  # or "attention"
    X, Y = make_data("mlp", 4096, seed=1)
    pe = per_example_grads(model, X, Y)                # {name: Tensor[N, *shape]}
    truth = ground_truth(pe)                           # exact noise / signal / GNS
    rank_grads = simulate_ranks(pe, num_ranks=4, batch_size=64, generator=g)
    est = gns_kernels.estimate(rank_grads, 64, "l1")   # compare est.gns with truth.gns("l1")
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

Tensor = torch.Tensor

__all__ = [
    "MLP",
    "AttentionBlock",
    "make_model",
    "make_data",
    "per_example_grads",
    "GroundTruth",
    "ground_truth",
    "simulate_ranks",
    "simulate_ranks_batched",
    "GaussianMatrixNoise",
    "LeastSquares",
]


class MLP(nn.Module):
    """x (in_dim) -> tanh(W1 x + b1) -> W2 h + b2 (out_dim). Weights 2-D, biases 1-D."""

    def __init__(self, in_dim: int = 16, hidden: int = 32, out_dim: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class AttentionBlock(nn.Module):
    """Multi-head self-attention on a short sequence, mean-pooled, then a linear head.

    x (..., T, d_model) -> q, k, v = x W_q^T, x W_k^T, x W_v^T (heads of d_model/num_heads)
    -> softmax(q k^T / sqrt(d_head)) v -> W_o -> residual -> mean over T -> head (out_dim).
    num_heads = 1 gives single-head attention. Projection weights are 2-D (no biases).
    """

    def __init__(self, d_model: int = 16, num_heads: int = 2, out_dim: int = 4):
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"num_heads: expected a divisor of d_model={d_model}, got {num_heads}")
        self.num_heads = num_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.head = nn.Linear(d_model, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        *lead, T, d = x.shape
        h = self.num_heads
        dh = d // h

        def split(t: Tensor) -> Tensor:
            return t.reshape(*lead, T, h, dh).transpose(-3, -2)  # (..., h, T, dh)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        y = (att @ v).transpose(-3, -2).reshape(*lead, T, d)
        y = x + self.o(y)
        return self.head(y.mean(dim=-2))


MODEL_KINDS = ("mlp", "attention")


def make_model(kind: str = "mlp", seed: int = 0, dtype: torch.dtype = torch.float64, **sizes) -> nn.Module:
    """A freshly initialised MLP or AttentionBlock (torch default init, given seed), in dtype.

    sizes: constructor keywords (MLP: in_dim, hidden, out_dim; attention: d_model,
    num_heads, out_dim).
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"kind: expected 'mlp' or 'attention', got {kind!r}")
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = MLP(**sizes) if kind == "mlp" else AttentionBlock(**sizes)
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(dtype)


def make_data(
    kind: str = "mlp",
    num_examples: int = 4096,
    seed: int = 1,
    dtype: torch.dtype = torch.float64,
    noise_std: float = 0.5,
    seq_len: int = 6,
    **sizes,
) -> tuple[Tensor, Tensor]:
    """Synthetic regression data: inputs x ~ N(0, I), targets y = teacher(x) + noise_std * N(0, I).

    The teacher is a model of the same kind with a different seed (seed + 1000), so a
    student initialised by make_model has a non-zero mean gradient (signal) and per-example
    gradients that differ (noise). Returns X (N, in_dim) or (N, seq_len, d_model) and Y (N, out_dim).
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"kind: expected 'mlp' or 'attention', got {kind!r}")
    if int(num_examples) != num_examples or num_examples < 1:
        raise ValueError(f"num_examples: expected a positive integer, got {num_examples}")
    g = torch.Generator().manual_seed(seed)
    teacher = make_model(kind, seed=seed + 1000, dtype=dtype, **sizes)
    if kind == "mlp":
        X = torch.randn(num_examples, teacher.fc1.in_features, generator=g, dtype=dtype)
    else:
        X = torch.randn(num_examples, seq_len, teacher.q.in_features, generator=g, dtype=dtype)
    with torch.no_grad():
        Y = teacher(X)
        Y = Y + noise_std * torch.randn(Y.shape, generator=g, dtype=dtype)
    return X, Y


def mse_loss(pred: Tensor, target: Tensor) -> Tensor:
    """0.5 * sum of squared errors of one example (the per-example loss)."""
    return 0.5 * ((pred - target) ** 2).sum()


def per_example_grads(model: nn.Module, X: Tensor, Y: Tensor, loss_fn=mse_loss) -> dict[str, Tensor]:
    """Exact per-example gradients {name: Tensor[N, *param.shape]} via torch.func vmap(grad).

    loss_fn(pred, target) is the loss of ONE example (pred/target without a batch dim).
    """
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"Y: expected {X.shape[0]} examples like X, got {Y.shape[0]}")
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, x, y):
        return loss_fn(functional_call(model, p, (x,)), y)

    return dict(vmap(grad(loss_one), in_dims=(None, 0, 0))(params, X, Y))


@dataclass
class GroundTruth:
    """Exact single-example gradient moments (population = the data set, ddof 0).

    mean[name]: E[grad] (the full-data gradient). variance[name]: per-coordinate variance.
    row_cov[name] (2-D params only): E[(g - E g)(g - E g)^T] on the smaller side (m x m if
    m <= n, else the n x n column side; same sqrt-trace).
    """

    mean: dict[str, Tensor]
    variance: dict[str, Tensor]
    row_cov: dict[str, Tensor]

    def noise(self, geometry: str) -> float:
        """l2: tr Sigma = sum var; l1: ||sigma||_1^2; nuclear: (sum_l tr(C_l^{1/2}))^2."""
        if geometry == "l2":
            return float(sum(v.sum() for v in self.variance.values()))
        if geometry == "l1":
            return float(sum(v.sqrt().sum() for v in self.variance.values())) ** 2
        if geometry == "nuclear":
            tot = sum(torch.linalg.eigvalsh(c).clamp_min(0).sqrt().sum() for c in self.row_cov.values())
            return float(tot) ** 2
        raise ValueError(f"geometry: expected one of 'l2', 'l1', 'nuclear', got {geometry!r}")

    def signal(self, geometry: str) -> float:
        """l2: ||E g||_2^2; l1: ||E g||_1^2; nuclear: (sum_l ||E G_l||_S1)^2."""
        if geometry == "l2":
            return float(sum((m * m).sum() for m in self.mean.values()))
        if geometry == "l1":
            return float(sum(m.abs().sum() for m in self.mean.values())) ** 2
        if geometry == "nuclear":
            tot = sum(torch.linalg.svdvals(self.mean[k]).sum() for k in self.row_cov)
            return float(tot) ** 2
        raise ValueError(f"geometry: expected one of 'l2', 'l1', 'nuclear', got {geometry!r}")

    def gns(self, geometry: str) -> float:
        """True GNS = noise(geometry) / signal(geometry)."""
        return self.noise(geometry) / self.signal(geometry)


def ground_truth(per_example: dict[str, Tensor]) -> GroundTruth:
    """Exact moments of the per-example gradients {name: Tensor[N, *shape]} (float64)."""
    mean, var, cov = {}, {}, {}
    for k, g in per_example.items():
        g = g.detach().double()
        mu = g.mean(dim=0)
        dev = g - mu
        mean[k] = mu
        var[k] = (dev * dev).mean(dim=0)
        if mu.dim() == 2:
            m, n = mu.shape
            cov[k] = torch.einsum("kij,klj->il", dev, dev) / g.shape[0] if m <= n else \
                torch.einsum("kji,kjl->il", dev, dev) / g.shape[0]
    return GroundTruth(mean, var, cov)


def simulate_ranks_batched(
    per_example: dict[str, Tensor],
    num_ranks: int,
    batch_size: int,
    num_draws: int = 1,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """num_draws independent global batches of B examples drawn with replacement, each split
    into R ranks of b = B/R examples and averaged: {name: Tensor[num_draws, R, *shape]}."""
    if int(num_ranks) != num_ranks or num_ranks < 1:
        raise ValueError(f"num_ranks: expected a positive integer, got {num_ranks}")
    if int(batch_size) != batch_size or batch_size < num_ranks or batch_size % num_ranks:
        raise ValueError(f"batch_size: expected a positive multiple of num_ranks={num_ranks}, got {batch_size}")
    first = next(iter(per_example.values()))
    N = first.shape[0]
    b = batch_size // num_ranks
    idx = torch.randint(0, N, (num_draws, num_ranks, b), generator=generator)
    out = {}
    for k, g in per_example.items():
        out[k] = g[idx.reshape(-1)].reshape(num_draws, num_ranks, b, *g.shape[1:]).mean(dim=2)
    return out


def simulate_ranks(
    per_example: dict[str, Tensor],
    num_ranks: int,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> list[list[Tensor]]:
    """One global batch of B examples (with replacement) split into R ranks of B/R:
    rank_grads[j][p] = rank j's mean gradient of parameter p (order of per_example), the
    input gns_kernels.estimate takes."""
    sim = simulate_ranks_batched(per_example, num_ranks, batch_size, 1, generator)
    return [[t[0, j] for t in sim.values()] for j in range(num_ranks)]


# ----------------------------------------------------------------------------------------
# Matrix-gradient problems with closed-form noise, for the bias measurements (tests, bench)
# ----------------------------------------------------------------------------------------


class GaussianMatrixNoise:
    """Single-example gradient M + L Z / sqrt(n) (m x n), Z iid N(0, 1), L = Q diag(sqrt(tau)).

    Row covariance C = L L^T (eigenvalues tau_k = 1/(k+1), random rotation Q), per-coordinate
    variance C_ii / n. A mean over b examples is exactly M + L Z / sqrt(n b): draw() samples
    those rank means directly. Truths (closed form): tr C, ||sigma||_1 = sqrt(n) sum_i
    sqrt(C_ii), tr(C^{1/2}) = sum_k sqrt(tau_k), ||M||_S1.
    """

    def __init__(self, m: int = 12, n: int = 32, seed: int = 0, signal_scale: float = 0.1):
        g = torch.Generator().manual_seed(seed)
        self.m, self.n = m, n
        Q, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
        self.tau = 1.0 / torch.arange(1, m + 1, dtype=torch.float64)
        self.L = Q * self.tau.sqrt()
        self.C = self.L @ self.L.T
        self.M = signal_scale * torch.randn(m, n, generator=g, dtype=torch.float64)

    def draw(self, num_ranks: int, local_batch: int, num_draws: int, generator: torch.Generator) -> Tensor:
        """Rank means Tensor[num_draws, R, m, n] (each the mean of local_batch examples)."""
        Z = torch.randn(num_draws, num_ranks, self.m, self.n, generator=generator, dtype=torch.float64)
        return self.M + (self.L @ Z) / math.sqrt(self.n * local_batch)

    def trace(self) -> float:
        return float(torch.diagonal(self.C).sum())

    def sigma_l1(self) -> float:
        return float(math.sqrt(self.n) * torch.diagonal(self.C).sqrt().sum())

    def sqrt_trace(self) -> float:
        return float(self.tau.sqrt().sum())


class LeastSquares:
    """Per-example gradient of 0.5 ||W x - y||^2 at W: r x^T, r = D x + eps (m x n, rank one).

    x ~ N(0, I_n), eps ~ N(0, noise_std^2 I_m), D = W - W_true (entries N(0, delta_scale^2/n)).
    Closed forms: mean gradient D; per-coordinate variance |D_i|^2 + D_ic^2 + noise_std^2;
    row covariance C = (n + 1) D D^T + n noise_std^2 I_m (from E[|x|^2 x x^T] = (n+2) I).
    draw() builds the rank means from explicit per-example gradients (not Gaussian).
    """

    def __init__(self, m: int = 12, n: int = 32, seed: int = 0, noise_std: float = 1.0, delta_scale: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.m, self.n, self.noise_std = m, n, noise_std
        self.D = delta_scale / math.sqrt(n) * torch.randn(m, n, generator=g, dtype=torch.float64)
        self.C = (n + 1) * self.D @ self.D.T + n * noise_std**2 * torch.eye(m, dtype=torch.float64)
        self.var = (self.D**2).sum(dim=1, keepdim=True) + self.D**2 + noise_std**2

    def draw(self, num_ranks: int, local_batch: int, num_draws: int, generator: torch.Generator) -> Tensor:
        """Rank means Tensor[num_draws, R, m, n] of local_batch per-example gradients r x^T."""
        x = torch.randn(num_draws, num_ranks, local_batch, self.n, generator=generator, dtype=torch.float64)
        eps = torch.randn(num_draws, num_ranks, local_batch, self.m, generator=generator, dtype=torch.float64)
        r = x @ self.D.T + self.noise_std * eps
        return r.transpose(-1, -2) @ x / local_batch

    def trace(self) -> float:
        return float(self.var.sum())

    def sigma_l1(self) -> float:
        return float(self.var.sqrt().sum())

    def sqrt_trace(self) -> float:
        return float(torch.linalg.eigvalsh(self.C).clamp_min(0).sqrt().sum())
