"""Fidelity of the GNS estimators on real networks against a population truth.

For each architecture: train a few hundred SGD steps on real data available offline, freeze
the parameters, compute every example's gradient with torch.func (vmap(grad)), and take the
data set as the population (examples are drawn with replacement, so its moments are the
exact truth): per-coordinate variance Sigma_ii, l2 truth tr Sigma, l1 truth ||sigma||_1^2,
nuclear truth (sum_l tr(Sigma_l^{1/2}))^2 with Sigma_l the smaller-side covariance of
layer l's per-example gradient (float64). Then simulate the measurement: many trials of R
samples of local batch b drawn from the pool, the estimators on the rank means, and report
E[estimate] / truth +- one standard error and the coefficient of variation.

Architectures (all data offline; sklearn's bundled sets, the Python standard library):
  cnn          2 conv + 2 linear layers on sklearn digits (8x8), each image also shifted by
               one pixel in 4 directions (8985 images); conv kernels enter the nuclear
               geometry as (out, in*k*k) matrices.
  mlp          64-64-64-10 tanh MLP on the same digits as pixel features (8985 rows).
  cancer       30-64-64-2 tanh MLP on sklearn breast_cancer (569 rows, standardised): a
               nearly separable set whose per-example gradients are very heavy-tailed
               (a few misclassified rows dominate): a stress case, not a typical one.
  transformer  one pre-LN transformer block (d = 32, 2 heads, MLP 64) with byte embedding
               and output head, next-byte loss on 32-byte windows of the stdlib sources
               (4096 windows).
  Held out (added after the estimators were designed on the three above, to check them on
  structures they were not developed on):
  rnn          a byte-level Elman RNN (embedding 24, hidden 48, tanh, unrolled over 16
               bytes, output head), next-byte loss on 16-byte windows of the stdlib sources
               (4096 windows): recurrent weights, gradients summed over time steps.
  diabetes     10-48-48-1 ReLU MLP regression (MSE) on sklearn diabetes (442 rows, X and y
               standardised): a regression loss, no classification tails.
  Added for the sparse and wide cases (issue 33; designed without tuning any estimator):
  embbag       a bag-of-words classifier of which of 8 stdlib packages a 6-line chunk of
               source comes from (7811 chunks): word unigrams and bigrams in at most 0.5% of
               the chunks, the 6000 most frequent as rows of an 8-wide embedding (mean over
               the bag), then 8-32-8 tanh. Every row is in <= 0.5% of the examples (a local
               batch of 16 sees a row with probability <= 7.7%, most rows far less); the
               embedding carries 76% of the model's ||sigma||_1.
  wide         64-1024-10 tanh MLP on 4096 of the digits rows: a hidden layer 64x a local
               batch of 16.

Estimators (per trial; the first trials of every configuration are checked against
gk.estimate to 1e-9 relative, nuclear 1e-6):
  l2, l1 raw / l1 c4-corrected (gk.estimate), nuclear raw and corrected with the dof
  'columns', 'data' (R >= 4), 'gauss-sums' (nuclear_dof.dof_from_sample_sums, R >= 3, the
  hook-computable per-sample quartic sums), 'pair' (nuclear_dof.dof_from_gram_pair with the
  previous independent measurement, any R), 'pair8' (its moments averaged over 8 pairs),
  'jk' / 'jk-columns' (nuclear_dof.jackknife of the raw / columns-corrected sqrt-trace,
  R >= 3), 'pool8' (sqrt-trace of the covariance averaged over 8 independent measurements,
  corrected with 8x the pair8 dof). l1: c4, the jackknife 'jk' / 'jk-c4', and 'pool8'
  (per-coordinate s2 averaged over 8 independent measurements, / c4(8 (R-1) + 1)).
  Signals: raw, and the bias-reduced nuclear_dof.l1_signal_debiased / l1_signal_folded /
  nuclear_signal_debiased.

The hooks' noise pool (``--pooled``): sequences of measurements at the frozen point, each
folded into a gns_kernels.pooling.NoisePool (beta 0.9, the hooks' default) through the same
calls the hooks make (fold_variance on float32 reduced halves; the nuclear covariances through
distributed._share.pooled_sqrt_traces); reports E[noise_pooled] / truth after 1, 3, 10, 20
and 40 measurements (independent sequences; 40 is the steady state: the first measurement's
weight is 0.9^39 = 0.016) and the CV at 40:
    OMP_NUM_THREADS=1 python bench/truth.py --pooled --arch mlp,cnn,transformer,rnn,diabetes --seqs 200
--beta sets the pool's beta, --pool-at the measurement counts reported, and --beta2 B2 adds a
second pool at B2 and the window extrapolation (rows l1x, nucx; a prototype, not in the hooks):
    OMP_NUM_THREADS=1 python bench/truth.py --pooled --arch embbag,wide --R 2,4,8 --b 16,64 \
        --extra "" --seqs 60 --beta2 0.8
--methods eigh,newton solves the same pool state (a twin pool fed the same covariances) by
eigh and by the GPU path's Newton chain (method "newton": float64 Newton-Schulz on the
positive part; "auto" is eigh on CPU) and adds a table of newton / eigh of the pooled
corrected sum_l tr(P_l^{1/2}) per measurement count (mean [min, max]) and its max |ratio - 1|:
    OMP_NUM_THREADS=1 python bench/truth.py --pooled --methods eigh,newton --arch mlp,cnn --b 16 \
        --extra "" --seqs 20 --pool-at 1,3,10,40
and during training (R:b:measurements:SGD steps between them):
    OMP_NUM_THREADS=1 python bench/truth.py --pooled --drift 4:16:40:10 --arch mlp,transformer --seqs 100

Usage (one thread, nice'd; about 10 minutes per architecture on a shared 2-core machine):
    OMP_NUM_THREADS=1 python bench/truth.py --arch mlp,cnn,transformer --trials 600
Drift of the pooled estimates (8 measurements 50 SGD steps apart, R = 4, b = 16):
    OMP_NUM_THREADS=1 python bench/truth.py --arch mlp --drift 4:16:8:50 --trials 600
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gns_kernels as gk  # noqa: E402
from gns_kernels import stats  # noqa: E402

# ----------------------------------------------------------------------------------------
# data and models
# ----------------------------------------------------------------------------------------


def digits_data():
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    shifted = [X]
    for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        shifted.append(torch.roll(X, shifts=(dy, dx), dims=(2, 3)))
    return torch.cat(shifted), y.repeat(5)


def cancer_data():
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    return torch.tensor(X, dtype=torch.float32), torch.tensor(y)


def text_data(n_windows: int, context: int, seed: int):
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    buf = bytearray()
    for f in files:
        with open(f, "rb") as fh:
            buf += fh.read() + b"\0"
        if len(buf) > 4_000_000:
            break
    data = torch.tensor(np.frombuffer(bytes(buf), dtype=np.uint8).astype(np.int64))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - context - 1, (n_windows,), generator=g)
    win = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
    return win[:, :-1], win[:, 1:]


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1)
        self.f1 = nn.Linear(64, 32)
        self.f2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.f2(F.relu(self.f1(x.flatten(-3))))


class MLP(nn.Module):
    def __init__(self, d_in=30, h=64, d_out=2):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, h), nn.Linear(h, h), nn.Linear(h, d_out)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class RNN(nn.Module):
    def __init__(self, vocab=256, d=24, h=48):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.wi = nn.Linear(d, h)
        self.wh = nn.Linear(h, h, bias=False)
        self.head = nn.Linear(h, vocab)

    def forward(self, idx):  # idx (..., T)
        x = self.emb(idx)
        ht = x.new_zeros(x.shape[:-2] + (self.wh.in_features,))
        hs = []
        for t in range(idx.shape[-1]):
            ht = torch.tanh(self.wi(x[..., t, :]) + self.wh(ht))
            hs.append(ht)
        return self.head(torch.stack(hs, dim=-2))


class RegMLP(nn.Module):
    def __init__(self, d_in=10, h=48):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d_in, h), nn.Linear(h, h), nn.Linear(h, 1)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x))))).squeeze(-1)


def diabetes_data():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    y = (y - y.mean()) / y.std()
    return torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, vocab=256, d=32, heads=2, context=32, hidden=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.02)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.head = nn.Linear(d, vocab)
        self.heads = heads

    def forward(self, idx):  # idx (..., T)
        T = idx.shape[-1]
        x = self.emb(idx) + self.pos[:T]
        h = self.ln1(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)

        def split(t):
            return t.unflatten(-1, (self.heads, -1)).transpose(-3, -2)

        a = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        x = x + self.proj(a.transpose(-3, -2).flatten(-2))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(self.lnf(x))


STDLIB_PACKAGES = ("email", "http", "xml", "unittest", "asyncio", "multiprocessing", "tkinter", "idlelib")


def code_bag_data(vocab=6000, max_df=0.005, per_class=1000, lines=6, length=32, seed=0):
    """Which of 8 stdlib packages a chunk of `lines` source lines comes from, as a bag of
    words: lower-cased word unigrams and bigrams, kept when at most `max_df` of the chunks
    contain them, the `vocab` most frequent of those indexed 1..vocab (0 pads to `length`).
    Every embedding row is then in at most 0.5% of the examples (a local batch of 16 sees
    a given row with probability <= 7.7%): a sparse embedding."""
    import collections
    import random
    import re
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    rng = random.Random(seed)
    texts, labels = [], []
    for c, pkg in enumerate(STDLIB_PACKAGES):
        chunks = []
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                        ls = [ln.strip() for ln in fh if ln.strip()]
                    chunks += [" ".join(ls[i:i + lines]) for i in range(0, len(ls) - lines + 1, lines)]
        rng.shuffle(chunks)
        texts += chunks[:per_class]
        labels += [c] * len(chunks[:per_class])

    def tokens(s):
        w = re.findall(r"[a-z0-9]+", s.lower())
        return set(w) | {a + " " + b for a, b in zip(w, w[1:])}

    toks = [tokens(t) for t in texts]
    df = collections.Counter(t for ts in toks for t in ts)
    n = len(toks)
    kept = sorted((t for t, c in df.items() if c <= max_df * n), key=lambda t: (-df[t], t))[:vocab]
    index = {t: i + 1 for i, t in enumerate(kept)}
    X = torch.zeros(n, length, dtype=torch.int64)
    for i, ts in enumerate(toks):
        ids = sorted(index[t] for t in ts if t in index)[:length]
        X[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return X, torch.tensor(labels)


class WideMLP(nn.Module):
    """One tanh hidden layer of 1024 units (64x a local batch of 16)."""

    def __init__(self, d_in=64, h=1024, d_out=10):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d_in, h), nn.Linear(h, d_out)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class BagClassifier(nn.Module):
    """Mean of the bag's word embeddings (row 0 pads), then a tanh MLP."""

    def __init__(self, vocab=6000, d=8, h=32, classes=8):
        super().__init__()
        self.emb = nn.Embedding(vocab + 1, d, padding_idx=0)
        self.fc = nn.Linear(d, h)
        self.out = nn.Linear(h, classes)

    def forward(self, idx):  # idx (..., length)
        mask = (idx > 0).to(self.emb.weight.dtype)
        x = (self.emb(idx) * mask[..., None]).sum(-2) / mask.sum(-1, keepdim=True).clamp_min(1.0)
        return self.out(torch.tanh(self.fc(x)))


def make_arch(name: str, seed: int):
    torch.manual_seed(seed)
    if name == "cnn":
        X, Y = digits_data()
        return CNN(), X, Y, lambda out, y: F.cross_entropy(out, y), 0.05
    if name == "mlp":
        X, Y = digits_data()
        return MLP(64, 64, 10), X.flatten(1), Y, lambda out, y: F.cross_entropy(out, y), 0.02
    if name == "cancer":
        X, Y = cancer_data()
        return MLP(), X, Y, lambda out, y: F.cross_entropy(out, y), 0.003
    if name == "transformer":
        X, Y = text_data(4096, 32, seed)
        return Block(), X, Y, lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)), 0.3
    if name == "rnn":
        X, Y = text_data(4096, 16, seed + 1)
        return RNN(), X, Y, lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)), 0.3
    if name == "diabetes":
        X, Y = diabetes_data()
        return RegMLP(), X, Y, lambda out, y: F.mse_loss(out, y), 0.01
    if name == "embbag":
        X, Y = code_bag_data(seed=seed)
        return BagClassifier(), X, Y, lambda out, y: F.cross_entropy(out, y), 0.5
    if name == "wide":
        X, Y = digits_data()
        keep = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(seed))[:4096]
        return WideMLP(), X.flatten(1)[keep], Y[keep], lambda out, y: F.cross_entropy(out, y), 0.02
    raise ValueError(f"arch: unknown {name!r}")


def train(model, X, Y, loss_fn, lr, steps, batch, seed):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(steps):
        i = torch.randint(0, X.shape[0], (batch,), generator=g)
        opt.zero_grad()
        loss_fn(model(X[i]), Y[i]).backward()
        opt.step()
    with torch.no_grad():
        return float(loss_fn(model(X[:2048]), Y[:2048]))


def per_example_pool(model, X, Y, loss_fn, chunk=512):
    """(N, P) float32 pool of flattened per-example gradients and the layout."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, x, y):
        return loss_fn(functional_call(model, p, (x[None],)), y[None])

    g1 = vmap(grad(one), in_dims=(None, 0, 0))
    layout, off = [], 0
    for k, v in params.items():
        mat = None
        if v.dim() == 2:
            mat = tuple(v.shape)
        elif v.dim() == 4:  # conv kernel as (out, in*k*k)
            mat = (v.shape[0], v[0].numel())
        layout.append((k, tuple(v.shape), off, v.numel(), mat))
        off += v.numel()
    pool = torch.empty(X.shape[0], off, dtype=torch.float32)
    for s in range(0, X.shape[0], chunk):
        gs = g1(params, X[s : s + chunk], Y[s : s + chunk])
        pool[s : s + chunk] = torch.cat([gs[k].reshape(gs[k].shape[0], -1) for k, *_ in layout], dim=1)
    return pool, layout


# ----------------------------------------------------------------------------------------
# truth
# ----------------------------------------------------------------------------------------


def truth(pool, layout):
    N = pool.shape[0]
    mu = torch.zeros(pool.shape[1], dtype=torch.float64)
    var = torch.zeros_like(mu)
    for s in range(0, N, 1024):
        mu += pool[s : s + 1024].double().sum(0)
    mu /= N
    for s in range(0, N, 1024):
        d = pool[s : s + 1024].double() - mu
        var += (d * d).sum(0)
    var /= N
    t = {"l2": float(var.sum()), "l1": float(var.sqrt().sum()) ** 2}
    sq, sv = 0.0, 0.0
    for k, shape, off, num, mat in layout:
        if mat is None:
            continue
        m, n = mat
        cov = torch.zeros(min(m, n), min(m, n), dtype=torch.float64)
        for s in range(0, N, 1024):
            d = (pool[s : s + 1024, off : off + num].double() - mu[off : off + num]).reshape(-1, m, n)
            if m > n:
                d = d.mT
            cov += torch.einsum("kij,klj->il", d, d)
        cov /= N
        sq += float(torch.linalg.eigvalsh(cov).clamp_min(0).sqrt().sum())
        sv += float(torch.linalg.svdvals(mu[off : off + num].reshape(m, n)).sum())
    t["nuclear"] = sq * sq
    sig = {"l2": float((mu * mu).sum()), "l1": float(mu.abs().sum()) ** 2, "nuclear": sv * sv}
    return t, sig


# ----------------------------------------------------------------------------------------
# simulation
# ----------------------------------------------------------------------------------------

L1_KINDS = ("raw", "c4", "jk", "jk-c4", "pool8")
NUCLEAR_KINDS = ("raw", "columns", "data", "gauss-sums", "pair", "pair8", "jk", "jk-columns", "pool8")


def rank_means(pool, T, R, b, gen):
    idx = torch.randint(0, pool.shape[0], (T * R, b), generator=gen)
    return F.embedding_bag(idx, pool, mode="mean").double().reshape(T, R, -1)


def sqrt_trace(ev):
    return ev.clamp_min(0).sqrt().sum(-1)


def run_chunk(x, layout, R, b, check: int):
    """Per-trial statistics of one chunk x (T, R, P) float64 -> dict of (T,) tensors.

    'l1:*' and 'nuc:*' are the roots S (||s||_1, sum_l tr C_l^{1/2}); the noise is S^2.
    """
    T = x.shape[0]
    B = R * b
    out = {}
    g = x.mean(1)
    dev = x - g[:, None]
    ssq = (dev * dev).sum(1)
    s2 = b * ssq / (R - 1)  # == B/(R-1) (mean_j x^2 - g^2)
    out["l2"] = s2.sum(1)
    out["l1:raw"] = s2.sqrt().sum(1)
    out["l1:c4"] = out["l1:raw"] / stats.c4(R)
    # pool8: per-coordinate s2 averaged over 8 independent measurements (8 dof)
    out["l1:pool8"] = (sum(torch.roll(s2, k, dims=0) for k in range(8)) / 8).sqrt().sum(1) / stats.c4(8 * (R - 1) + 1)
    if R >= 3:
        loo = torch.stack([stats.loo_sum_sq(ssq, dev[:, j], R) for j in range(R)], 1)  # (T, R, P)
        loo_s = (b * loo.clamp_min(0) / (R - 2)).sqrt().sum(2).mean(1)
        out["l1:jk"] = stats.jackknife(out["l1:raw"], loo_s, R)
        out["l1:jk-c4"] = stats.jackknife(out["l1:c4"], loo_s / stats.c4(R - 1), R)
        del loo
    out["sig:l2:raw"] = (g * g).sum(1)
    out["sig:l1:raw"] = g.abs().sum(1)
    out["sig:l1:deb"] = torch.stack([stats.l1_signal_debiased(g[t], s2[t], B) for t in range(T)])
    out["sig:l1:fold"] = torch.stack([stats.l1_signal_folded(g[t], s2[t], B) for t in range(T)])
    acc = {k: torch.zeros(T, dtype=torch.float64) for k in NUCLEAR_KINDS}
    acc["sig:raw"] = torch.zeros(T, dtype=torch.float64)
    acc["sig:deb"] = torch.zeros(T, dtype=torch.float64)
    nus = {k: [] for k in ("columns", "data", "gauss-sums", "pair", "pair8")}

    def corrected(ev, nu, Rr, Bb):
        return stats.nuclear_sqrt_trace_corrected(ev, Rr, Bb, dof_per_sample=nu / (Rr - 1))

    for k, shape, off, num, mat in layout:
        if mat is None:
            continue
        m, n = mat
        xs = x[:, :, off : off + num].reshape(T, R, m, n)
        if m > n:
            xs = xs.mT
            m, n = n, m
        d = xs - xs.mean(1, keepdim=True)
        Msum = (d @ d.mT).sum(1)  # (T, m, m)
        C = B / (R * (R - 1)) * Msum
        ev = torch.linalg.eigvalsh(C)
        acc["raw"] += sqrt_trace(ev)
        acc["columns"] += stats.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=n)
        nus["columns"].append(torch.full((T,), float((R - 1) * n), dtype=torch.float64))
        if R >= 4:
            nu = stats.nuclear_dof_from_samples(xs)
            acc["data"] += corrected(ev, nu, R, B)
            nus["data"].append(nu)
        if R >= 3:
            nu = stats.dof_from_samples_gaussian(xs)
            acc["gauss-sums"] += corrected(ev, nu, R, B)
            nus["gauss-sums"].append(nu)
            Mloo = torch.stack([stats.loo_gram(Msum, d[:, j], R) for j in range(R)], 1)  # (T, R, m, m)
            evl = torch.linalg.eigvalsh(b / (R - 2) * Mloo)
            acc["jk"] += stats.jackknife(sqrt_trace(ev), sqrt_trace(evl).mean(1), R)
            col_loo = stats.nuclear_sqrt_trace_corrected(evl, R - 1, (R - 1) * b, other_dim=n).mean(1)
            acc["jk-columns"] += stats.jackknife(stats.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=n), col_loo, R)
        # pair: the previous independent trial of the chunk (cyclic)
        num1, var1 = stats.gram_pair_moments(C, torch.roll(C, 1, dims=0))
        nu = stats.dof_from_moments(num1, var1)
        acc["pair"] += corrected(ev, nu, R, B)
        nus["pair"].append(nu)
        nk, vk = torch.zeros_like(num1), torch.zeros_like(var1)
        for sft in range(8):  # pairs (t-s, t-s-1), s = 0..7: the current and 7 earlier pairs
            a, v = stats.gram_pair_moments(torch.roll(C, sft, dims=0), torch.roll(C, sft + 1, dims=0))
            nk, vk = nk + a, vk + v
        nu = stats.dof_from_moments(nk, vk)
        acc["pair8"] += corrected(ev, nu, R, B)
        nus["pair8"].append(nu)
        # pool8: the covariance averaged over the same 8 measurements, then the sqrt-trace
        # (its dof is 8 nu); what a hook keeping a running mean of C would report
        Cp = sum(torch.roll(C, sft, dims=0) for sft in range(8)) / 8
        acc["pool8"] += stats.nuclear_sqrt_trace_corrected(torch.linalg.eigvalsh(Cp), R, B, dof_per_sample=8 * nu / (R - 1))
        G = xs.mean(1)
        acc["sig:raw"] += torch.linalg.svdvals(G).sum(-1)
        acc["sig:deb"] += stats.nuclear_signal_debiased(G, C, B)
    for k, v in acc.items():
        if k.startswith("sig:"):
            out["sig:nuc:" + k[4:]] = v
        elif float(v.abs().sum()) > 0:
            out["nuc:" + k] = v
    for k, v in nus.items():
        if v:
            out["nu:" + k] = torch.stack(v, dim=1)  # (T, layers)
    # check against gk.estimate on the first trials
    for t in range(min(check, T)):
        rank_grads = []
        for j in range(R):
            ps = []
            for k, shape, off, num, mat in layout:
                v = x[t, j, off : off + num]
                ps.append(v.reshape(mat) if mat is not None and len(shape) == 4 else v.reshape(shape))
            rank_grads.append(ps)
        pairs = [("l2", {}, out["l2"][t]), ("l1", {"bias_correction": False}, out["l1:raw"][t] ** 2),
                 ("l1", {}, out["l1:c4"][t] ** 2),
                 ("nuclear", {"bias_correction": False}, out["nuc:raw"][t] ** 2),
                 ("nuclear", {"nuclear_dof": "columns"}, out["nuc:columns"][t] ** 2)]
        if R >= 3:  # gk.estimate's default (= the DDP hook's with ranks as samples)
            pairs.append(("nuclear", {}, out["nuc:gauss-sums"][t] ** 2))
        if R >= 4:
            pairs.append(("nuclear", {"nuclear_dof": "data"}, out["nuc:data"][t] ** 2))
        for geo, kw, mine in pairs:
            ref = gk.estimate(rank_grads, B, geometry=geo, **kw).noise
            tol = 1e-6 if geo == "nuclear" else 1e-9  # eigvalsh of the subtraction formula
            if not abs(ref - float(mine)) <= tol * abs(ref):
                raise AssertionError(f"harness != gk.estimate: {geo} {kw} {ref} vs {float(mine)}")
    return out


def simulate(pool, layout, R, b, trials, seed, chunk_elems=2e7, check=2):
    gen = torch.Generator().manual_seed(seed)
    P = pool.shape[1]
    per = max(16, int(chunk_elems // (R * P)))
    parts = []
    done = 0
    while done < trials:
        T = max(min(per, trials - done), 9)  # the pair8 columns need 9 trials in a chunk
        parts.append(run_chunk(rank_means(pool, T, R, b, gen), layout, R, b, check=check if done == 0 else 0))
        done += T
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def ratio(v, t):
    v = v.double()
    mean = float(v.mean())
    se = float(v.std()) / math.sqrt(v.numel())
    return mean / t, se / t, float(v.std()) / mean if mean else math.nan


def fmt(r):
    return f"{r[0]:.3f} ± {r[1]:.3f}"


def drift(arch, R, b, trials, snapshots, every, steps, seed):
    """Pooling under training drift: the covariance of one measurement per snapshot (every
    `every` SGD steps, `snapshots` of them), averaged over the snapshots, against the truth
    at the last snapshot (the current one) and the single-measurement estimates there."""
    model, X, Y, loss_fn, lr = make_arch(arch, seed)
    train(model, X, Y, loss_fn, lr, steps, 64, seed)
    B = R * b
    Cs, s2s, truths = [], [], []
    for snap in range(snapshots):
        if snap:
            train(model, X, Y, loss_fn, lr, every, 64, seed + snap)
        pool, layout = per_example_pool(model, X, Y, loss_fn)
        truths.append(truth(pool, layout)[0])
        gen = torch.Generator().manual_seed(seed + 7 * snap + 1)
        x = torch.cat([rank_means(pool, 50, R, b, gen) for _ in range(trials // 50)])
        dev = x - x.mean(1, keepdim=True)
        s2s.append(b * (dev * dev).sum(1) / (R - 1))
        per_layer = []
        for k, shape, off, num, mat in layout:
            if mat is None:
                continue
            m, n = mat
            xs = x[:, :, off : off + num].reshape(x.shape[0], R, m, n)
            if m > n:
                xs = xs.mT
            d = xs - xs.mean(1, keepdim=True)
            per_layer.append((B / (R * (R - 1)) * (d @ d.mT).sum(1), max(m, n)))
        Cs.append(per_layer)
        del pool, x
    last = truths[-1]
    mean_truth = {g: sum(t[g] for t in truths) / len(truths) for g in last}
    K = snapshots
    res = {"nuc:raw": 0.0, "nuc:columns": 0.0, "nuc:pair": 0.0, f"nuc:pool{K}": 0.0}
    for li in range(len(Cs[-1])):
        C_last, n = Cs[-1][li]
        ev = torch.linalg.eigvalsh(C_last)
        res["nuc:raw"] = res["nuc:raw"] + sqrt_trace(ev)
        res["nuc:columns"] = res["nuc:columns"] + stats.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=n)
        nk, vk = 0.0, 0.0
        for sn in range(1, K):
            a, v = stats.gram_pair_moments(Cs[sn][li][0], Cs[sn - 1][li][0])
            nk, vk = nk + a, vk + v
        nu = stats.dof_from_moments(nk, vk)
        a1, v1 = stats.gram_pair_moments(Cs[-1][li][0], Cs[-2][li][0])
        res["nuc:pair"] = res["nuc:pair"] + stats.nuclear_sqrt_trace_corrected(
            ev, R, B, dof_per_sample=stats.dof_from_moments(a1, v1) / (R - 1))
        Cp = sum(c[li][0] for c in Cs) / K
        res[f"nuc:pool{K}"] = res[f"nuc:pool{K}"] + stats.nuclear_sqrt_trace_corrected(
            torch.linalg.eigvalsh(Cp), R, B, dof_per_sample=K * nu / (R - 1))
    res["l1:c4"] = s2s[-1].sqrt().sum(1) / stats.c4(R)
    res[f"l1:pool{K}"] = (sum(s2s) / K).sqrt().sum(1) / stats.c4(K * (R - 1) + 1)
    print(f"\n### Drift: {arch}, R = {R}, b = {b}, {K} snapshots {every} SGD steps apart (steps {steps}.."
          f"{steps + every * (K - 1)}), {trials} trials\n")
    print("truth per snapshot (nuclear, l1): " + ", ".join(f"{t['nuclear']:.4g}/{t['l1']:.4g}" for t in truths))
    print("\n| estimate | E / truth at the last snapshot | E / mean truth over the window |")
    print("|---|---|---|")
    for k, v in res.items():
        g = "nuclear" if k.startswith("nuc") else "l1"
        print(f"| {k} | {fmt(ratio(v ** 2, last[g]))} | {fmt(ratio(v ** 2, mean_truth[g]))} |")


POOL_AT = (1, 3, 10, 20, 40)  # measurements after which the pooled noise is reported


def setup_arch(arch, args):
    """Train `arch`, freeze it, pool its per-example gradients: (pool, layout, truth noise,
    truth signal), with one line describing it."""
    t0 = time.time()
    model, X, Y, loss_fn, lr = make_arch(arch, args.seed)
    loss = train(model, X, Y, loss_fn, lr, args.steps, 64, args.seed)
    pool, layout = per_example_pool(model, X, Y, loss_fn)
    tn, ts = truth(pool, layout)
    mats = [(k, mat) for k, _, _, _, mat in layout if mat is not None]
    print(f"## {arch}: N = {pool.shape[0]}, P = {pool.shape[1]}, loss {loss:.3f} after "
          f"{args.steps} steps, matrices {mats}; truth l2 {tn['l2']:.4g} l1 {tn['l1']:.4g} "
          f"nuclear {tn['nuclear']:.4g}; setup {time.time() - t0:.0f}s", flush=True)
    return pool, layout, tn, ts


def rank_gradients(x, layout):
    """gk.estimate's rank_grads from rank means x (R, P): per rank, every parameter (conv
    kernels as their nuclear matrices)."""
    return [[x[j, off:off + num].reshape(mat) if mat is not None else x[j, off:off + num]
             for k, shape, off, num, mat in layout] for j in range(x.shape[0])]


def fold_measurement(npool, x, layout, R, b, method="eigh"):
    """One measurement (rank means x, (R, P) float64) folded into a NoisePool through the
    hooks' calls: (pooled l1 ||s||_1 total, pooled_sqrt_traces rows [value, new] per matrix,
    the pooled matrices solved by `method`: 'eigh', or 'newton', the GPU path's)."""
    from gns_kernels.spectral import pooled_sqrt_traces

    B = R * b
    mean, msq = x.mean(0).float(), (x * x).mean(0).float()  # the reduced halves, float32
    l1 = sum(float(npool.fold_variance(("l1", i), mean[off:off + num], msq[off:off + num], B / (R - 1), R))
             for i, (k, shape, off, num, mat) in enumerate(layout))
    covs, shapes, keys = [], [], []
    for i, (k, shape, off, num, mat) in enumerate(layout):
        if mat is None:
            continue
        m, n = mat
        xm = x[:, off:off + num].reshape(R, m, n)
        if m > n:
            xm = xm.mT
        d = xm - xm.mean(0, keepdim=True)
        covs.append((B / (R * (R - 1)) * (d @ d.mT).sum(0)).float())
        shapes.append((m, n))
        keys.append(("nuc", i))
    return l1, pooled_sqrt_traces(npool, keys, covs, shapes, R, 1.0, method=method)


def _pool_U(npool) -> float:
    """U = sum_k w_k^2 / (S_k - 1) of a pool (every key folds every measurement here)."""
    return float(next(iter(npool._entries.values())).U)


class _TwoBeta:
    """The two-beta window extrapolation (prototype): a second pool at beta2 and
    r + (r - r2) U / (U2 - U) (0 while U2 <= U)."""

    def __init__(self, beta2):
        from gns_kernels.stats import NoisePool

        self.pool, self.n, self.last = NoisePool(beta2), 0, None

    def fold(self, x, layout, R, b):
        self.last = fold_measurement(self.pool, x, layout, R, b)
        self.n += 1

    def extrapolate(self, full_pool, r_l1, r_nuc):
        """(extrapolated l1 root, extrapolated nuclear root or None before a nuclear pair)."""
        U, U2 = _pool_U(full_pool), _pool_U(self.pool)
        k = U / (U2 - U) if U2 > U else 0.0
        l1b, vals2 = self.last
        r_nuc2 = float(vals2[0].sum())
        return r_l1 + (r_l1 - l1b) * k, (r_nuc + (r_nuc - r_nuc2) * k) if self.n > 1 else None


class _SplitHalves:
    """The split-half window extrapolation (prototype): pools of the even and of the odd
    measurements (beta^2 per fold: the same time weights as the full pool, half the
    samples, about twice its U, and the same lag), and r + (r - r_half) k,
    k = U / (U_half - U) clamped to [0, 2] (0 until both halves hold a measurement)."""

    def __init__(self, beta):
        from gns_kernels.stats import NoisePool

        self.halves = [NoisePool(beta * beta), NoisePool(beta * beta)]
        self.t = 0
        self.last = {}  # half index: (l1, vals) of its latest fold

    def fold(self, x, layout, R, b):
        self.last[self.t % 2] = fold_measurement(self.halves[self.t % 2], x, layout, R, b)
        self.t += 1

    def extrapolate(self, full_pool, r_l1, r_nuc):
        """(extrapolated l1 root, extrapolated nuclear root or None until both halves hold one)."""
        if len(self.last) < 2:
            return r_l1, None
        U = _pool_U(full_pool)
        Uh = sum(_pool_U(h) for h in self.halves) / 2
        k = min(max(U / (Uh - U), 0.0), 2.0) if Uh > U else 0.0
        l1h = sum(v[0] for v in self.last.values()) / 2
        nuch = sum(float(v[1][0].sum()) for v in self.last.values()) / 2
        return r_l1 + (r_l1 - l1h) * k, r_nuc + (r_nuc - nuch) * k


def _extrapolated(ex, full_pool, x, layout, R, b, l1, vals, nuc_default):
    """Fold x into the extrapolation ex and return its (l1 noise, nuclear noise): the
    nuclear one is nuc_default until ex has a nuclear value."""
    ex.fold(x, layout, R, b)
    a1, a2 = ex.extrapolate(full_pool, l1, float(vals[0].sum()))
    return a1 * a1, nuc_default if a2 is None else a2 * a2


def pooled_run(pool, layout, R, b, seqs, seed, beta2=None, beta=0.9, pool_at=None, split=False,
               methods=("eigh",)):
    """The hooks' noise pool on independent sequences of len POOL_AT[-1] measurements:
    {("l1" | "nuc", t): tensor[seqs] of the pooled noise after t measurements}. With
    beta2: a second pool at beta2 beside it, and ("l1x" | "nucx", t) the window
    extrapolation r + (r - r2) U / (U2 - U) of the two corrected roots (U, U2: the pools'
    sum_k w_k^2 / (S - 1)). The pool solves with methods[0]; each further method m solves
    a twin pool fed the same covariances (the same state): ("nuc/" + m, t) the ratio of its
    pooled corrected sum_l tr(P_l^{1/2}) to methods[0]'s after t >= 2 measurements, and
    ("nuc/" + m, "all") that ratio after every measurement 2..POOL_AT[-1]."""
    from gns_kernels.stats import NoisePool

    pool_at = pool_at or POOL_AT
    gen = torch.Generator().manual_seed(seed)
    B = R * b
    geos = ("l1", "nuc") + (("l1x", "nucx") if beta2 is not None else ()) + (("l1s", "nucs") if split else ())
    out = {(g, t): [] for g in geos for t in pool_at}
    out.update({("nuc/" + m, t): [] for m in methods[1:] for t in tuple(pool_at) + ("all",)})
    for _ in range(seqs):
        npool = NoisePool(beta)
        twins = {m: NoisePool(beta) for m in methods[1:]}
        exs = {}
        if beta2 is not None:
            exs["x"] = _TwoBeta(beta2)
        if split:
            exs["s"] = _SplitHalves(beta)
        xs = rank_means(pool, pool_at[-1], R, b, gen)  # (T, R, P) float64
        for t in range(pool_at[-1]):
            x = xs[t]
            l1, vals = fold_measurement(npool, x, layout, R, b, methods[0])
            for m, twin in twins.items():  # folds at t = 0 too: the twin holds the same state
                value = float(fold_measurement(twin, x, layout, R, b, m)[1][0].sum())
                if t:  # t = 0: no pooled value yet
                    r = value / float(vals[0].sum())
                    out[("nuc/" + m, "all")].append(r)
                    if t + 1 in pool_at:
                        out[("nuc/" + m, t + 1)].append(r)
            if t == 0:  # every matrix is new: the measurement's own corrected noise (gk.estimate's default)
                nuc = gk.estimate(rank_gradients(x, layout), B, geometry="nuclear").noise
            else:
                assert float(vals[1].sum()) == 0.0
                nuc = float(vals[0].sum()) ** 2
            got = {tag: _extrapolated(ex, npool, x, layout, R, b, l1, vals, nuc) for tag, ex in exs.items()}
            if t + 1 in pool_at:
                out[("l1", t + 1)].append(l1 * l1)
                out[("nuc", t + 1)].append(nuc)
                for tag, (l1n, nucn) in got.items():
                    out[("l1" + tag, t + 1)].append(l1n)
                    out[("nuc" + tag, t + 1)].append(nucn)
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def drift_pooled(arch, R, b, seqs, snapshots, every, steps, seed, beta=0.9, beta2=None, split=False):
    """The hooks' noise pool during training: one measurement per snapshot (every `every`
    SGD steps) per sequence, folded in order; at the end E[noise_pooled] against the truth
    at the last snapshot and against the EMA of the truths with the pool's weights (what
    the controller's noise EMA targets), beside the EMA of the per-measurement default
    estimates (what the controller averages without a pool)."""
    from gns_kernels.stats import NoisePool

    model, X, Y, loss_fn, lr = make_arch(arch, seed)
    train(model, X, Y, loss_fn, lr, steps, 64, seed)
    B = R * b
    gen = torch.Generator().manual_seed(seed + 17)
    pools = [NoisePool(beta) for _ in range(seqs)]
    kinds = {}  # name: (one extrapolation per sequence, {geometry: its noise per sequence})
    if beta2 is not None:
        kinds[f"window extrapolation with a second pool at {beta2} (prototype)"] = (
            [_TwoBeta(beta2) for _ in range(seqs)], {"l1": [0.0] * seqs, "nuc": [0.0] * seqs})
    if split:
        kinds["split-half extrapolation (prototype)"] = (
            [_SplitHalves(beta) for _ in range(seqs)], {"l1": [0.0] * seqs, "nuc": [0.0] * seqs})
    ema = {"l1": [None] * seqs, "nuc": [None] * seqs}
    pooled = {"l1": [0.0] * seqs, "nuc": [0.0] * seqs}
    truths = []
    for snap in range(snapshots):
        if snap:
            train(model, X, Y, loss_fn, lr, every, 64, seed + snap)
        pool, layout = per_example_pool(model, X, Y, loss_fn)
        truths.append(truth(pool, layout)[0])
        xs = rank_means(pool, seqs, R, b, gen)  # one measurement per sequence
        for q in range(seqs):
            x = xs[q]
            l1, vals = fold_measurement(pools[q], x, layout, R, b)
            rank_grads = rank_gradients(x, layout)
            single = {"l1": gk.estimate(rank_grads, B, geometry="l1").noise,
                      "nuc": gk.estimate(rank_grads, B, geometry="nuclear").noise}
            pooled["l1"][q] = l1 * l1
            pooled["nuc"][q] = single["nuc"] if snap == 0 else float(vals[0].sum()) ** 2
            for exs, noise in kinds.values():
                noise["l1"][q], noise["nuc"][q] = _extrapolated(exs[q], pools[q], x, layout, R, b, l1, vals,
                                                                pooled["nuc"][q])
            for g in ("l1", "nuc"):
                ema[g][q] = single[g] if ema[g][q] is None else beta * ema[g][q] + (1 - beta) * single[g]
        del pool
    w = [beta ** (snapshots - 1)] + [(1 - beta) * beta ** (snapshots - 1 - t) for t in range(1, snapshots)]
    print(f"\n### Drift: {arch}, R = {R}, b = {b}, {snapshots} measurements {every} SGD steps apart "
          f"(steps {steps}..{steps + every * (snapshots - 1)}), {seqs} sequences, beta {beta}\n")
    print("truth (nuclear, l1) at the first / last snapshot: "
          f"{truths[0]['nuclear']:.4g}/{truths[0]['l1']:.4g}, {truths[-1]['nuclear']:.4g}/{truths[-1]['l1']:.4g}")
    print("\n| geometry | estimate | E / truth at the last snapshot | E / EMA of the truths (the pool's weights) |")
    print("|---|---|---|---|")
    for g, tk in (("l1", "l1"), ("nuc", "nuclear")):
        last = truths[-1][tk]
        ema_truth = sum(wt * t[tk] for wt, t in zip(w, truths))
        rows = [("noise_pooled (the hooks' default)", pooled[g]),
                ("EMA of the per-measurement noise (no pool)", ema[g])]
        rows += [(name, noise[g]) for name, (_, noise) in kinds.items()]
        for name, v in rows:
            v = torch.tensor(v, dtype=torch.float64)
            print(f"| {'nuclear' if g == 'nuc' else 'l1'} | {name} | {fmt(ratio(v, last))} | {fmt(ratio(v, ema_truth))} |")


def method_cell(r) -> str:
    """mean [min, max] of the ratios r of two methods' pooled values ('–' if none)."""
    return f"{float(r.mean()):.6f} [{float(r.min()):.6f}, {float(r.max()):.6f}]" if r.numel() else "–"


def main_pooled(args) -> None:
    pool_at = tuple(int(v) for v in args.pool_at.split(",")) if args.pool_at else POOL_AT
    configs = [(int(R), int(b)) for R in args.R.split(",") for b in args.b.split(",")]
    configs += [tuple(int(v) for v in e.split(":")) for e in args.extra.split(",") if e]
    methods = tuple(args.methods.split(","))
    rows, method_rows = [], []
    for arch in args.arch.split(","):
        pool, layout, tn, ts = setup_arch(arch, args)
        for R, b in configs:
            t1 = time.time()
            o = pooled_run(pool, layout, R, b, args.seqs, args.seed + 1000 * R + b, beta2=args.beta2,
                           beta=args.beta, pool_at=pool_at, split=args.split, methods=methods)
            geos = (("l1", "l1"), ("nuc", "nuclear"))
            if args.split:
                geos += (("l1s", "l1"), ("nucs", "nuclear"))
            if args.beta2 is not None:
                geos += (("l1x", "l1"), ("nucx", "nuclear"))
            for g, tk in geos:
                cells = [fmt(ratio(o[(g, t)], tn[tk])) for t in pool_at]
                cv = ratio(o[(g, pool_at[-1])], tn[tk])[2]
                rows.append(f"| {arch} | {g} | {R} | {b} | " + " | ".join(cells)
                            + f" | {cv:.3f} |")
                print(rows[-1], f"  [{time.time() - t1:.0f}s]", flush=True)
            for m in methods[1:]:
                r = o[("nuc/" + m, "all")]
                method_rows.append(f"| {arch} | {R} | {b} | {m} | " + " | ".join(
                    method_cell(o[("nuc/" + m, t)]) for t in pool_at) + f" | {float((r - 1).abs().max()):.1e} |")
                print(method_rows[-1], flush=True)
        del pool
    extra = f", second pool {args.beta2} (l1x, nucx: the window extrapolation)" if args.beta2 is not None else ""
    print(f"\n### The noise pool (beta {args.beta}{extra}): E[noise_pooled] / truth ± one standard error "
          f"({args.seqs} sequences)\n")
    print("| arch | geometry | R | b | " + " | ".join(f"after {t}" for t in pool_at) + f" | CV at {pool_at[-1]} |")
    print("|---" * (5 + len(pool_at)) + "|")
    print("\n".join(rows))
    if method_rows:
        print(f"\n### Pooled sum_l tr(P_l^{{1/2}}) (corrected) of each method / {methods[0]}'s on the same pool "
              f"state: mean [min, max] over {args.seqs} sequences; max |ratio - 1| over the sequences and "
              f"measurements 2..{pool_at[-1]}\n")
        print("| arch | R | b | method | " + " | ".join(f"after {t}" for t in pool_at) + " | max abs(ratio - 1) |")
        print("|---" * (5 + len(pool_at)) + "|")
        print("\n".join(method_rows))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="mlp,cnn,transformer")
    ap.add_argument("--R", default="2,4,8")
    ap.add_argument("--b", default="4,16,64")
    ap.add_argument("--extra", default="3:16,4:8", help="extra R:b configurations")
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--check", type=int, default=2,
                    help="trials per configuration checked against gk.estimate (its default included)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift", default="", help="R:b:snapshots:every: run the drift experiment on --arch instead")
    ap.add_argument("--pooled", action="store_true", help="the hooks' noise pool (see the docstring)")
    ap.add_argument("--seqs", type=int, default=200, help="--pooled: independent sequences per configuration")
    ap.add_argument("--beta", type=float, default=0.9, help="--pooled: the pool's beta (the hooks' default 0.9)")
    ap.add_argument("--pool-at", default="", help="--pooled: measurement counts to report after (default 1,3,10,20,40)")
    ap.add_argument("--split", action="store_true",
                    help="--pooled: also the split-half extrapolation (rows l1s, nucs; a prototype)")
    ap.add_argument("--methods", default="eigh",
                    help="--pooled: the pooled matrices' solvers, e.g. eigh,newton: the pool solves with the "
                         "first; each further one solves a twin pool of the same state (ratio table)")
    ap.add_argument("--beta2", type=float, default=None,
                    help="--pooled: also a second pool at this beta and the window extrapolation (l1x, nucx)")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.pooled and args.drift:
        R, b, K, every = (int(v) for v in args.drift.split(":"))
        for arch in args.arch.split(","):
            drift_pooled(arch, R, b, args.seqs, K, every, args.steps, args.seed, beta=args.beta, beta2=args.beta2,
                         split=args.split)
        return
    if args.pooled:
        main_pooled(args)
        return
    if args.drift:
        R, b, K, every = (int(v) for v in args.drift.split(":"))
        for arch in args.arch.split(","):
            drift(arch, R, b, args.trials, K, every, args.steps, args.seed)
        return
    configs = [(int(R), int(b)) for R in args.R.split(",") for b in args.b.split(",")]
    configs += [tuple(int(v) for v in e.split(":")) for e in args.extra.split(",") if e]
    noise_rows, root_rows, dof_rows, cv_rows, sig_rows = [], [], [], [], []
    for arch in args.arch.split(","):
        pool, layout, tn, ts = setup_arch(arch, args)
        for R, b in configs:
            t1 = time.time()
            o = simulate(pool, layout, R, b, args.trials, args.seed + 1000 * R + b, check=args.check)
            B = R * b
            l2 = ratio(o["l2"], tn["l2"])
            l1 = {k: ratio(o["l1:" + k] ** 2, tn["l1"]) for k in L1_KINDS if "l1:" + k in o}
            nuc = {k: ratio(o["nuc:" + k] ** 2, tn["nuclear"]) for k in NUCLEAR_KINDS if "nuc:" + k in o}
            l1r = {k: ratio(o["l1:" + k], math.sqrt(tn["l1"])) for k in L1_KINDS if "l1:" + k in o}
            nucr = {k: ratio(o["nuc:" + k], math.sqrt(tn["nuclear"])) for k in NUCLEAR_KINDS if "nuc:" + k in o}
            cell = lambda d, k: fmt(d[k]) if k in d else "–"  # noqa: E731
            cv = lambda d, k: f"{d[k][2]:.3f}" if k in d else "–"  # noqa: E731
            head = f"| {arch} | {R} | {b} | "
            noise_rows.append(head + fmt(l2) + " | " + " | ".join(cell(l1, k) for k in L1_KINDS) + " | "
                              + " | ".join(cell(nuc, k) for k in NUCLEAR_KINDS) + " |")
            root_rows.append(head + " | ".join(cell(l1r, k) for k in L1_KINDS) + " | "
                             + " | ".join(cell(nucr, k) for k in NUCLEAR_KINDS) + " |")
            cv_rows.append(head + f"{l2[2]:.3f} | " + " | ".join(cv(l1, k) for k in L1_KINDS) + " | "
                           + " | ".join(cv(nuc, k) for k in NUCLEAR_KINDS) + " |")
            dofs = []
            for k in ("columns", "data", "gauss-sums", "pair", "pair8"):
                if "nu:" + k in o:
                    med = o["nu:" + k].median(dim=0).values
                    dofs.append("/".join(f"{v:.0f}" if math.isfinite(v) else "inf" for v in med.tolist()))
                else:
                    dofs.append("–")
            dof_rows.append(head + " | ".join(dofs) + " |")
            # signals and GNS; noise: the best hook-computable (jackknife at R >= 3, else c4 / pair8)
            g_true = {k: tn[k] / ts[k] for k in tn}
            l1n = (o["l1:jk-c4"] if R >= 3 else o["l1:c4"]) ** 2
            nn_ = (o["nuc:jk-columns"] if R >= 3 else o["nuc:pair8"]) ** 2
            sr = lambda k, t: ratio(o[k] ** 2, t)  # noqa: E731
            gr = lambda n_, k, t: ratio(n_ / o[k].clamp_min(1e-300) ** 2, t)  # noqa: E731
            s_l1d, s_l1f, s_nd = sr("sig:l1:deb", ts["l1"]), sr("sig:l1:fold", ts["l1"]), sr("sig:nuc:deb", ts["nuclear"])
            sig_rows.append(head + f"{g_true['l1'] / B:.2f} | {fmt(sr('sig:l1:raw', ts['l1']))} | {fmt(s_l1d)} "
                            f"({s_l1d[2]:.2f}) | {fmt(s_l1f)} ({s_l1f[2]:.2f}) | {fmt(gr(l1n, 'sig:l1:raw', g_true['l1']))} | "
                            f"{fmt(gr(l1n, 'sig:l1:deb', g_true['l1']))} | {fmt(gr(l1n, 'sig:l1:fold', g_true['l1']))} | "
                            f"{g_true['nuclear'] / B:.2f} | {fmt(sr('sig:nuc:raw', ts['nuclear']))} | {fmt(s_nd)} "
                            f"({s_nd[2]:.2f}) | {fmt(gr(nn_, 'sig:nuc:raw', g_true['nuclear']))} | "
                            f"{fmt(gr(nn_, 'sig:nuc:deb', g_true['nuclear']))} |")
            print(noise_rows[-1], f"  [{time.time() - t1:.0f}s]", flush=True)
        del pool
    kinds = " | ".join("l1 " + k for k in L1_KINDS) + " | " + " | ".join("nuc " + k for k in NUCLEAR_KINDS)
    sep = "|---" * (3 + len(L1_KINDS) + len(NUCLEAR_KINDS))
    print("\n### Noise: E[noise] / truth ± one standard error\n")
    print("| arch | R | b | l2 | " + kinds + " |")
    print(sep + "|---|")
    print("\n".join(noise_rows))
    print("\n### Root: E[||s||_1] / ||sigma||_1 and E[sum tr C^1/2] / sum tr Sigma^1/2 ± one standard error\n")
    print("| arch | R | b | " + kinds + " |")
    print(sep + "|")
    print("\n".join(root_rows))
    print("\n### Coefficient of variation of the noise (std / mean over trials)\n")
    print("| arch | R | b | l2 | " + kinds + " |")
    print(sep + "|---|")
    print("\n".join(cv_rows))
    print("\n### Median estimated nu per matrix (layer order)\n")
    print("| arch | R | b | columns | data | gauss-sums | pair | pair8 |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(dof_rows))
    print("\n### Signals: E[signal] / truth (CV), E[GNS] / true GNS (noise: jk at R >= 3, else l1 c4 / nuclear pair8)\n")
    print("| arch | R | b | l1 GNS/B | l1 sig raw | l1 sig debiased (CV) | l1 sig folded (CV) | l1 GNS, raw sig | "
          "l1 GNS, debiased sig | l1 GNS, folded sig | nuc GNS/B | nuc sig raw | nuc sig debiased (CV) | "
          "nuc GNS, raw sig | nuc GNS, debiased sig |")
    print("|---" * 15 + "|")
    print("\n".join(sig_rows))


if __name__ == "__main__":
    main()
