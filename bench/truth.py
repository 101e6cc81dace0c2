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

Estimators (per trial; the first trials of every configuration are checked against
gk.estimate to 1e-9 relative, nuclear 1e-6):
  l2, l1 raw / l1 c4-corrected (gk.estimate), nuclear raw and corrected with the dof
  'columns', 'data' (R >= 4), 'gauss-sums' (nuclear_dof.dof_from_sample_sums, R >= 3, the
  hook-computable per-sample quartic sums), 'pair' (nuclear_dof.dof_from_gram_pair with the
  previous independent measurement, any R), 'pair8' (its moments averaged over 8 pairs).
  Signals: raw, and the bias-reduced nuclear_dof.l1_signal_debiased / l1_signal_folded /
  nuclear_signal_debiased.

Usage (one thread; a few minutes per architecture on a shared 2-core machine):
    OMP_NUM_THREADS=1 python bench/truth.py --arch mlp,cnn,transformer --trials 1000
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
from gns_kernels import bias as gkb  # noqa: E402
from gns_kernels import nuclear_dof as nd  # noqa: E402

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

NUCLEAR_KINDS = ("raw", "columns", "data", "gauss-sums", "pair", "pair8")


def rank_means(pool, T, R, b, gen):
    idx = torch.randint(0, pool.shape[0], (T * R, b), generator=gen)
    return F.embedding_bag(idx, pool, mode="mean").double().reshape(T, R, -1)


def sqrt_trace(ev):
    return ev.clamp_min(0).sqrt().sum(-1)


def run_chunk(x, layout, R, b, check: int):
    """Per-trial statistics of one chunk x (T, R, P) float64 -> dict of (T,) tensors."""
    T = x.shape[0]
    B = R * b
    out = {}
    g = x.mean(1)
    dev = x - g[:, None]
    s2 = b * (dev * dev).sum(1) / (R - 1)  # == B/(R-1) (mean_j x^2 - g^2)
    out["l2"] = s2.sum(1)
    out["l1_raw_s"] = s2.sqrt().sum(1)
    out["l1_sig_raw"] = g.abs().sum(1)
    out["l1_sig_deb"] = torch.stack([nd.l1_signal_debiased(g[t], s2[t], B) for t in range(T)])
    out["l1_sig_fold"] = torch.stack([nd.l1_signal_folded(g[t], s2[t], B) for t in range(T)])
    out["l2_sig_raw"] = (g * g).sum(1)
    acc = {k: torch.zeros(T, dtype=torch.float64) for k in NUCLEAR_KINDS}
    acc["sig_raw"] = torch.zeros(T, dtype=torch.float64)
    acc["sig_deb"] = torch.zeros(T, dtype=torch.float64)
    nus = {k: [] for k in ("columns", "data", "gauss-sums", "pair", "pair8")}
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
        acc["columns"] += gkb.nuclear_sqrt_trace_corrected(ev, R, B, other_dim=n)
        nus["columns"].append(torch.full((T,), float((R - 1) * n), dtype=torch.float64))
        if R >= 4:
            nu = gkb.nuclear_dof_from_samples(xs)
            acc["data"] += gkb.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu / (R - 1))
            nus["data"].append(nu)
        if R >= 3:
            nu = nd.dof_from_samples_gaussian(xs)
            acc["gauss-sums"] += gkb.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu / (R - 1))
            nus["gauss-sums"].append(nu)
        # pair: the previous independent trial of the chunk (cyclic)
        num1, var1 = nd.gram_pair_moments(C, torch.roll(C, 1, dims=0))
        nu = nd.dof_from_moments(num1, var1)
        acc["pair"] += gkb.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu / (R - 1))
        nus["pair"].append(nu)
        nk, vk = torch.zeros_like(num1), torch.zeros_like(var1)
        for s in range(8):  # pairs (t-s, t-s-1), s = 0..7: the current and 7 earlier pairs
            a, v = nd.gram_pair_moments(torch.roll(C, s, dims=0), torch.roll(C, s + 1, dims=0))
            nk, vk = nk + a, vk + v
        nu = nd.dof_from_moments(nk, vk)
        acc["pair8"] += gkb.nuclear_sqrt_trace_corrected(ev, R, B, dof_per_sample=nu / (R - 1))
        nus["pair8"].append(nu)
        G = xs.mean(1)
        acc["sig_raw"] += torch.linalg.svdvals(G).sum(-1)
        acc["sig_deb"] += nd.nuclear_signal_debiased(G, C, B)
    for k, v in acc.items():
        out["nuc_" + k] = v
    for k, v in nus.items():
        if v:
            out["nu_" + k] = torch.stack(v, dim=1)  # (T, layers)
    # check against gk.estimate on the first trials
    for t in range(min(check, T)):
        rank_grads = []
        for j in range(R):
            ps = []
            for k, shape, off, num, mat in layout:
                v = x[t, j, off : off + num]
                ps.append(v.reshape(mat) if mat is not None and len(shape) == 4 else v.reshape(shape))
            rank_grads.append(ps)
        pairs = [("l2", {}, out["l2"][t]), ("l1", {"bias_correction": False}, out["l1_raw_s"][t] ** 2),
                 ("l1", {}, (out["l1_raw_s"][t] / gkb.c4(R)) ** 2),
                 ("nuclear", {"bias_correction": False}, out["nuc_raw"][t] ** 2),
                 ("nuclear", {"nuclear_dof": "columns"}, out["nuc_columns"][t] ** 2)]
        if R >= 4:
            pairs.append(("nuclear", {"nuclear_dof": "data"}, out["nuc_data"][t] ** 2))
        for geo, kw, mine in pairs:
            ref = gk.estimate(rank_grads, B, geometry=geo, **kw).noise
            tol = 1e-6 if geo == "nuclear" else 1e-9  # eigvalsh of the subtraction formula
            if not abs(ref - float(mine)) <= tol * abs(ref):
                raise AssertionError(f"harness != gk.estimate: {geo} {kw} {ref} vs {float(mine)}")
    return out


def simulate(pool, layout, R, b, trials, seed, chunk_elems=4e7):
    gen = torch.Generator().manual_seed(seed)
    P = pool.shape[1]
    per = max(16, int(chunk_elems // (R * P)))
    parts = []
    done = 0
    while done < trials:
        T = min(per, trials - done)
        T = max(T, 9)  # the pair8 columns need 9 trials in a chunk
        parts.append(run_chunk(rank_means(pool, T, R, b, gen), layout, R, b, check=2 if done == 0 else 0))
        done += T
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def ratio(v, t):
    v = v.double()
    mean = float(v.mean())
    se = float(v.std()) / math.sqrt(v.numel())
    return mean / t, se / t, float(v.std()) / mean if mean else math.nan


def fmt(r):
    return f"{r[0]:.3f} ± {r[1]:.3f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="mlp,cnn,transformer")
    ap.add_argument("--R", default="2,4,8")
    ap.add_argument("--b", default="4,16,64")
    ap.add_argument("--extra", default="3:16,4:8", help="extra R:b configurations")
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    configs = [(int(R), int(b)) for R in args.R.split(",") for b in args.b.split(",")]
    configs += [tuple(int(v) for v in e.split(":")) for e in args.extra.split(",") if e]
    noise_rows, dof_rows, cv_rows, sig_rows = [], [], [], []
    for arch in args.arch.split(","):
        t0 = time.time()
        model, X, Y, loss_fn, lr = make_arch(arch, args.seed)
        loss = train(model, X, Y, loss_fn, lr, args.steps, 64, args.seed)
        pool, layout = per_example_pool(model, X, Y, loss_fn)
        tn, ts = truth(pool, layout)
        mats = [(k, mat) for k, _, _, _, mat in layout if mat is not None]
        print(f"## {arch}: N = {pool.shape[0]}, P = {pool.shape[1]}, loss {loss:.3f} after "
              f"{args.steps} steps, matrices {mats}; truth l2 {tn['l2']:.4g} l1 {tn['l1']:.4g} "
              f"nuclear {tn['nuclear']:.4g}; setup {time.time() - t0:.0f}s", flush=True)
        for R, b in configs:
            t1 = time.time()
            o = simulate(pool, layout, R, b, args.trials, args.seed + 1000 * R + b)
            B = R * b
            c4 = gkb.c4(R)
            l2 = ratio(o["l2"], tn["l2"])
            l1r = ratio(o["l1_raw_s"] ** 2, tn["l1"])
            l1c = ratio((o["l1_raw_s"] / c4) ** 2, tn["l1"])
            nuc = {k: ratio(o["nuc_" + k] ** 2, tn["nuclear"]) for k in NUCLEAR_KINDS
                   if float(o["nuc_" + k].abs().sum()) > 0}
            cell = lambda k: fmt(nuc[k]) if k in nuc else "–"  # noqa: E731
            noise_rows.append(f"| {arch} | {R} | {b} | {fmt(l2)} | {fmt(l1r)} | {fmt(l1c)} | "
                              + " | ".join(cell(k) for k in NUCLEAR_KINDS) + " |")
            cv_rows.append(f"| {arch} | {R} | {b} | {l2[2]:.3f} | {l1c[2]:.3f} | "
                           + " | ".join(f"{nuc[k][2]:.3f}" if k in nuc else "–" for k in NUCLEAR_KINDS) + " |")
            dofs = []
            for k in ("columns", "data", "gauss-sums", "pair", "pair8"):
                if "nu_" + k in o:
                    nu = o["nu_" + k]
                    med = nu.median(dim=0).values
                    dofs.append("/".join(f"{v:.0f}" if math.isfinite(v) else "inf" for v in med.tolist()))
                else:
                    dofs.append("–")
            dof_rows.append(f"| {arch} | {R} | {b} | " + " | ".join(dofs) + " |")
            # signals and GNS (noise: l1 c4, nuclear best hook-computable available)
            s_l1r = ratio(o["l1_sig_raw"] ** 2, ts["l1"])
            s_l1d = ratio(o["l1_sig_deb"] ** 2, ts["l1"])
            s_l1f = ratio(o["l1_sig_fold"] ** 2, ts["l1"])
            s_nr = ratio(o["nuc_sig_raw"] ** 2, ts["nuclear"])
            s_nd = ratio(o["nuc_sig_deb"] ** 2, ts["nuclear"])
            g_true = {k: tn[k] / ts[k] for k in tn}
            l1n = (o["l1_raw_s"] / c4) ** 2
            nn_ = o["nuc_pair8"] ** 2
            gl1r = ratio(l1n / o["l1_sig_raw"] ** 2, g_true["l1"])
            gl1d = ratio(l1n / o["l1_sig_deb"].clamp_min(1e-300) ** 2, g_true["l1"])
            gnr = ratio(nn_ / o["nuc_sig_raw"] ** 2, g_true["nuclear"])
            gnd = ratio(nn_ / o["nuc_sig_deb"].clamp_min(1e-300) ** 2, g_true["nuclear"])
            sig_rows.append(f"| {arch} | {R} | {b} | {g_true['l1'] / B:.2f} | {fmt(s_l1r)} | {fmt(s_l1d)} "
                            f"({s_l1d[2]:.3f}) | {fmt(s_l1f)} ({s_l1f[2]:.3f}) | {fmt(gl1r)} | {fmt(gl1d)} | "
                            f"{g_true['nuclear'] / B:.2f} | {fmt(s_nr)} | {fmt(s_nd)} ({s_nd[2]:.3f}) | "
                            f"{fmt(gnr)} | {fmt(gnd)} |")
            print(noise_rows[-1], f"  [{time.time() - t1:.0f}s]", flush=True)
        del pool
    print("\n### Noise: E[noise] / truth ± one standard error\n")
    print("| arch | R | b | l2 | l1 raw | l1 / c4 | nuclear raw | columns | data | gauss-sums | pair | pair8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(noise_rows))
    print("\n### Coefficient of variation of the noise (std / mean over trials)\n")
    print("| arch | R | b | l2 | l1 / c4 | nuclear raw | columns | data | gauss-sums | pair | pair8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(cv_rows))
    print("\n### Median estimated nu per matrix (layer order)\n")
    print("| arch | R | b | columns | data | gauss-sums | pair | pair8 |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(dof_rows))
    print("\n### Signals: E[signal] / truth (CV), E[GNS] / true GNS\n")
    print("| arch | R | b | l1 GNS/B | l1 sig raw | l1 sig debiased (CV) | l1 sig folded (CV) | l1 GNS raw sig | "
          "l1 GNS debiased sig | nuc GNS/B | nuc sig raw | nuc sig debiased (CV) | nuc GNS raw sig | nuc GNS debiased sig |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(sig_rows))


if __name__ == "__main__":
    main()
