"""The GPU window's hooks phase: the hooks as users run them, on CUDA tensors.

    python bench/gpu_hooks.py --device cuda     # on the GPU machine (bench/gpu_window.sh)
    python bench/gpu_hooks.py --device cpu      # the dry run: the same code on CPU tensors

1. One process, NCCL (gloo on CPU), world size 1:
   a. DDP with ``gk.MicroBatchGNS`` as its comm hook state, A = 4 micro-batches (the first
      three under ``no_sync()``), l1 and nuclear: the estimate against ``gk.estimate`` in
      float64 over the same micro-batch gradients (taken one by one from a copy of the
      model; 'columns' dof, as MicroBatchGNS);
   b. ``gk.AdaptiveBatching`` driving that DDP model and its MicroBatchGNS for 6 steps of a
      noisy regression (every = 1): B must grow; a checkpoint of model, optimizer and
      coordinator after step 3 (``torch.save`` / ``torch.load(weights_only=True)``) is
      loaded into a freshly built model, optimizer and coordinator, whose steps 4-6 must
      repeat the uninterrupted run's batches, learning rates and GNS.
2. Two processes sharing the one GPU over gloo (NCCL refuses two ranks on one device):
   DDP (``GNSHookState`` + ``gk.ddp_gns_hook``) and FSDP2 (``gk.attach_fsdp_gns``), each
   with l1 and with nuclear (noise pool on, the default), 3 measured steps, run on CUDA
   tensors and then on CPU tensors from the same seeds: the CUDA estimates against the
   CPU ones (float32 sums in other orders and, for nuclear, Newton on CUDA against eigh on
   the CPU: within 1e-3 relative). A collective that gloo refuses for CUDA tensors gives a
   row saying so, and the next scenario runs.

One summary row per check (``@@ | hooks | ... |``); exit 0 when every check that ran
passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

TOL = {"l1": 1e-4, "nuclear": 1e-3}  # relative, CUDA against float64 / against the CPU run
IN, HID, OUT = 24, 40, 12


def row(what: str, value: str, target: str = "") -> None:
    print(f"@@ | hooks | {what} | {value} | {target} |", flush=True)


def left() -> float:
    ends = [float(os.environ[k]) for k in ("GPU_WINDOW_END", "GPU_WINDOW_PHASE_END") if os.environ.get(k)]
    return (min(ends) - time.time()) if ends else math.inf


def rel(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-300)


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:150]}"


def make_model(device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)  # identical on every rank
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID),
                               torch.nn.Tanh(), torch.nn.Linear(HID, OUT, bias=False)).to(device)


def batch(seed: int, n: int, device):
    """A noisy regression batch: targets a fixed linear map plus noise of unit scale."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(99)) / IN ** 0.5
    x = torch.randn(n, IN, generator=g)
    y = x @ w + torch.randn(n, OUT, generator=g)
    return x.to(device), y.to(device)


# ----------------------------------------------------------------------------- 1. one process
@contextlib.contextmanager
def one_process_group(device: str):
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                init_method=f"file://{folder}/store", rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        try:
            yield
        finally:
            dist.destroy_process_group()


def ddp_microbatch_check(device: str, geometry: str, A: int = 4, b: int = 8) -> tuple[float, float, float]:
    """(noise, signal, gns) relative errors of DDP + MicroBatchGNS against gk.estimate(float64)."""
    import gns_kernels as gk
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(device)
    ref_model = make_model(device)
    ddp = DDP(model)
    B = A * b
    mb = gk.MicroBatchGNS(list(model.parameters()), geometry=geometry, every=1, batch_size=B,
                          micro_batches=A)
    ddp.register_comm_hook(mb, gk.ddp_gns_hook)
    grads = []
    for a in range(A):
        x, y = batch(100 + a, b, device)
        with ddp.no_sync() if a < A - 1 else contextlib.nullcontext():
            (F.mse_loss(ddp(x), y) / A).backward()
        mb.micro_step()
        ref_model.zero_grad(set_to_none=True)
        F.mse_loss(ref_model(x), y).backward()
        grads.append([p.grad.detach().cpu().clone() for p in ref_model.parameters()])
    est = mb.estimate
    kw = {"nuclear_dof": "columns"} if geometry == "nuclear" else {}
    ref = gk.estimate(grads, batch_size=B, geometry=geometry, bias_correction=True, dtype=torch.float64, **kw)
    return rel(est.noise, ref.noise), rel(est.signal, ref.signal), rel(est.gns, ref.gns)


class Run:
    """DDP (world size 1) + MicroBatchGNS + AdaptiveBatching + AdamW, built afresh."""

    def __init__(self, device: str, b: int = 8, B0: int = 16):
        import gns_kernels as gk
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.device = device
        self.model = make_model(device, seed=3)
        self.ddp = DDP(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.mb = gk.MicroBatchGNS(list(self.model.parameters()), geometry="l1", every=1,
                                   batch_size=B0, micro_batches=B0 // b)
        self.ddp.register_comm_hook(self.mb, gk.ddp_gns_hook)
        self.coord = gk.AdaptiveBatching(self.mb, self.opt, micro_batch_size=b, initial_batch_size=B0,
                                         max_batch_size=16 * B0, theta=0.3)
        x, y = batch(7, 4096, "cpu")
        self.data = torch.utils.data.TensorDataset(x, y)
        self.loader = torch.utils.data.DataLoader(self.data, batch_sampler=self.coord.batch_sampler(len(self.data)))

    def steps(self, n: int) -> list[tuple]:
        """n optimizer steps: [(B, lr, gns)] of each."""
        out = []
        for _ in range(n):
            A = self.coord.accum_steps
            k = self.coord.current_step
            for (x, y), ctx in self.coord.micro_batches(self.loader, model=self.ddp):
                with ctx:
                    (F.mse_loss(self.ddp(x.to(self.device)), y.to(self.device)) / A).backward()
            B, lr = self.coord.batch_size, self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.coord.step(k)
            m = self.coord.metrics()
            out.append((B, lr, m.get("gns")))
        return out

    def checkpoint(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "coord": self.coord.state_dict()}, buf)
        return buf.getvalue()

    def load(self, blob: bytes) -> None:
        ck = torch.load(io.BytesIO(blob), weights_only=True, map_location=self.device)
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["opt"])
        self.coord.load_state_dict(ck["coord"])


def adaptive_check(device: str) -> tuple[list, list, list]:
    """(the uninterrupted run's 6 steps, steps 4-6 of the resumed run, their differences)."""
    first = Run(device)
    head = first.steps(3)
    blob = first.checkpoint()
    tail = first.steps(3)
    del first
    second = Run(device)
    second.load(blob)
    again = second.steps(3)
    diffs = [(a[0] - c[0], rel(c[1], a[1]), rel(c[2], a[2]) if a[2] is not None and c[2] is not None else math.inf)
             for a, c in zip(tail, again)]
    return head + tail, again, diffs


def one_process(device: str) -> bool:
    ok = True
    backend = "NCCL" if device == "cuda" else "gloo (dry run)"
    try:
        with one_process_group(device):
            for geometry in ("l1", "nuclear"):
                what = f"DDP ({backend}, 1 rank) + MicroBatchGNS, {geometry}, 4 micro-batches, vs float64"
                try:
                    en, es, eg = ddp_microbatch_check(device, geometry)
                    good = max(en, es, eg) < TOL[geometry]
                    ok &= good
                    print(f"{what}: noise {en:.2e} signal {es:.2e} gns {eg:.2e}", flush=True)
                    row(what, f"{'ok' if good else 'MISMATCH'}: noise {en:.1e}, signal {es:.1e}, gns {eg:.1e}",
                        f"< {TOL[geometry]:g}")
                except Exception as exc:  # noqa: BLE001  (report and go on)
                    traceback.print_exc()
                    ok = False
                    row(what, f"FAILED: {first_line(exc)}", f"< {TOL[geometry]:g}")
            what = f"AdaptiveBatching on DDP ({backend}) + MicroBatchGNS, l1: 6 steps, resume after 3"
            try:
                steps, again, diffs = adaptive_check(device)
                grew = steps[-1][0] > steps[0][0]
                exact = all(d[0] == 0 and d[1] <= 1e-6 and d[2] <= 1e-5 for d in diffs)
                ok &= grew and exact
                print(f"{what}: B {[s[0] for s in steps]}; gns {[f'{s[2]:.4g}' for s in steps]}; "
                      f"resumed B {[s[0] for s in again]}, differences {diffs}", flush=True)
                row(what, f"B {'grew' if grew else 'DID NOT GROW'} {steps[0][0]} -> {steps[-1][0]}; resume "
                    + ("repeats B, LR and GNS" if exact else f"DIFFERS: {diffs}")
                    + f" (largest GNS difference {max(d[2] for d in diffs):.1e})",
                    "B grows; resume repeats (GNS within 1e-5)")
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                ok = False
                row(what, f"FAILED: {first_line(exc)}", "B grows; resume repeats")
    except Exception as exc:  # noqa: BLE001  (the process group itself)
        traceback.print_exc()
        row(f"one process, {backend}", f"FAILED: {first_line(exc)}")
        return False
    return ok


# ----------------------------------------------------------------------------- 2. two processes
SCENARIOS = [("DDP", "l1"), ("DDP", "nuclear"), ("FSDP2", "l1"), ("FSDP2", "nuclear")]


def _scenario(kind: str, geometry: str, device: str, rank: int, world: int, steps: int = 3) -> list:
    """[(gns, noise, signal)] of ``steps`` measured steps on this rank."""
    import gns_kernels as gk

    model = make_model(device, seed=5)
    B = 8 * world
    if kind == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, bucket_cap_mb=0.002)  # several buckets
        state = gk.GNSHookState(geometry, every=1, batch_size=B)
        net.register_comm_hook(state, gk.ddp_gns_hook)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (world,))
        kw = {"mesh": mesh}
        if geometry == "nuclear":
            kw["shard_placement_fn"] = lambda p: gk.fsdp_gns_shard_placement(p, world)
        for sub in (model[0], model[2]):
            fully_shard(sub, **kw)
        net = fully_shard(model, **kw)
        state = gk.GNSHookState(geometry, every=1, batch_size=B)
        gk.attach_fsdp_gns(net, state)
    out = []
    for k in range(steps):
        for p in net.parameters():
            p.grad = None
        x, y = batch(1000 + 10 * k + rank, 8, device)
        F.mse_loss(net(x), y).backward()
        e = state.estimate
        out.append((e.gns, e.noise, e.signal))
    return out


def _worker(rank: int, world: int, folder: str, device: str) -> None:
    torch.set_num_threads(2)
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one GPU
    res = {}
    path = os.path.join(folder, f"rank{rank}.pt")
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        for kind, geometry in SCENARIOS:
            for dev in ((device, "cpu") if device != "cpu" else ("cpu",)):
                try:
                    res[(kind, geometry, dev)] = ("ok", _scenario(kind, geometry, dev, rank, world))
                except Exception as exc:  # noqa: BLE001  (a refused collective: next scenario)
                    res[(kind, geometry, dev)] = ("error", first_line(exc) + "\n" + traceback.format_exc())
                    dist.barrier()
                torch.save(res, path)  # what is known so far survives a hang in the next one
    except Exception as exc:  # noqa: BLE001
        res["fatal"] = first_line(exc) + "\n" + traceback.format_exc()
    finally:
        torch.save(res, path)
        if dist.is_initialized():
            dist.destroy_process_group()


def two_processes(device: str) -> bool:
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(_worker, args=(world, folder, device), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.time() + max(5.0, left() - 3)
        try:
            while not ctx.join(timeout=1.0):
                if time.time() > deadline:
                    raise TimeoutError("deadline")
        except Exception as exc:  # noqa: BLE001  (a child died, or the deadline)
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            row("2 ranks over gloo", f"FAILED: {first_line(exc)}")
        results = []
        for r in range(world):
            path = os.path.join(folder, f"rank{r}.pt")
            try:
                results.append(torch.load(path, weights_only=False))  # our own file, just written
            except Exception:  # noqa: BLE001  (missing, or cut by a terminated rank)
                results.append({})
    ok = True
    for r in results:
        if "fatal" in r:
            print(r["fatal"], flush=True)
            row("2 ranks over gloo", "FAILED: " + r["fatal"].splitlines()[0])
            ok = False
    for kind, geometry in SCENARIOS:
        what = f"{kind} over gloo, 2 ranks on one {'GPU' if device == 'cuda' else 'CPU'}, {geometry}" \
               + (", pool on" if geometry == "nuclear" else "") + ", 3 steps"
        got = [r.get((kind, geometry, device)) for r in results]
        cpu = [r.get((kind, geometry, "cpu")) for r in results]
        if any(g is None for g in got):
            ok = False
            row(what, "FAILED: no result (a rank died, hung or ran out of time: see hooks.log)")
            continue
        errors = [g[1] for g in got + cpu if g is not None and g[0] == "error"]
        if errors:
            print("\n".join(errors), flush=True)
            msg = errors[0].splitlines()[0]
            refused = "gloo" in msg.lower() or "not supported" in msg.lower() or "unsupported" in msg.lower()
            row(what, ("skipped: gloo refused CUDA tensors: " if refused else "FAILED: ") + msg)
            ok &= refused
            continue
        # every rank reads the same estimate; the CUDA run against the CPU run of the same seeds
        same = all(got[0][1] == g[1] for g in got[1:])
        worst = 0.0
        for s_dev, s_cpu in zip(got[0][1], cpu[0][1] if cpu[0] else got[0][1]):
            worst = max(worst, *(rel(a, b) for a, b in zip(s_dev, s_cpu)))
        good = same and worst < TOL[geometry] and all(math.isfinite(v) for s in got[0][1] for v in s)
        ok &= good
        print(f"{what}: {device} {got[0][1]} / cpu {cpu[0][1] if cpu[0] else None}; worst rel {worst:.2e}; "
              f"ranks agree {same}", flush=True)
        vs = "against the CPU run" if device != "cpu" else "CPU only (dry run)"
        row(what, f"{'ok' if good else 'MISMATCH'}: worst relative difference {worst:.1e} {vs} "
            f"(gns, noise, signal); ranks agree: {same}", f"< {TOL[geometry]:g}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    t0 = time.time()
    ok = one_process(a.device)
    print(f"one process: {time.time() - t0:.1f} s", flush=True)
    t0 = time.time()
    ok &= two_processes(a.device)
    print(f"two processes: {time.time() - t0:.1f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
