"""CPU timing: the Newton-path bias correction (spectral.sqrt_trace_pair_sum + stats.nuclear_sqrt_trace_corrected_from_sums)
vs the eigh-based one (psd_eigvalsh + stats.nuclear_sqrt_trace_corrected), one covariance of
R = 2 Gaussian samples per size. Usage: python bench/bench_pair_sum.py (minutes at m = 2048)."""
import time, torch, sys
from gns_kernels import spectral as sp, stats
torch.manual_seed(0)
print("threads", torch.get_num_threads())
for m, n, reps in ((768, 2048, 3), (2048, 2048, 1)):
    G = [torch.randn(m, n) for _ in range(2)]
    mg = (G[0] @ G[0].T + G[1] @ G[1].T) / 2
    D = (G[0] + G[1]) / 2
    C = (mg - D @ D.T)[None].contiguous()
    ref = torch.linalg.matrix_norm(mg.double())[None]
    res = {}
    for it in range(reps):
        for name, fn in (
            ("eigh+correction", lambda: stats.nuclear_sqrt_trace_corrected(sp.psd_eigvalsh(C), 2, other_dim=n)),
            ("newton trace only", lambda: torch.ops.gns_kernels.newton_sqrt_trace(C, 25, 1e-6, ref, False)),
            ("newton trace+pair", lambda: stats.nuclear_sqrt_trace_corrected_from_sums(*sp.sqrt_trace_pair_sum(C, ref_norm=ref, project=False), 2, gram_dim=m, other_dim=n)),
        ):
            t0 = time.perf_counter(); out = fn(); dt = time.perf_counter() - t0
            res.setdefault(name, []).append((dt, float(out[0])))
    e = min(t for t, _ in res["eigh+correction"])
    for k, v in res.items():
        t = min(x for x, _ in v)
        print(f"m={m} {k:20s} min {t*1e3:9.1f} ms  ratio to eigh {t/e:6.2f}  value {v[-1][1]:.6g}")
    sys.stdout.flush()
