"""Smoke test of an installed gns-kernels (a wheel or an sdist in a fresh venv).

Run it with the venv's python from a directory outside the repository:

    /path/to/venv/bin/python tools/smoke_installed.py --expect-extension yes

Checks that the package comes from the environment's site-packages (not a checkout), that
the distribution's metadata, ``gns_kernels.__version__`` and ``gns-kernels --version``
agree, that the wheel pins the torch it was built against when it carries the compiled
extension (else asks for torch>=2.8), that py.typed and the LICENSE are installed, and
that the ops match float64 formulas written out here on random data of odd sizes.
Exit status 0 when every check passes; the first failure raises with a message.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SystemExit(f"smoke_installed: FAILED: {msg}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--expect-extension", choices=("yes", "no"), required=True,
                    help="whether the install must carry the compiled extension gns_kernels._C")
    args = ap.parse_args()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch

        import gns_kernels as gk
        from gns_kernels import ops

        site = os.path.realpath(sysconfig.get_paths()["purelib"])
        plat = os.path.realpath(sysconfig.get_paths()["platlib"])
        where = os.path.realpath(gk.__file__)
        _check(where.startswith((site + os.sep, plat + os.sep)),
               f"gns_kernels imported from {where}, not from this environment's site-packages {site}")

        # one version everywhere
        dist_version = md.version("gns-kernels")
        _check(dist_version == gk.__version__,
               f"metadata version {dist_version} != gns_kernels.__version__ {gk.__version__}")
        exe = shutil.which("gns-kernels", path=os.path.dirname(sys.executable))
        _check(exe is not None, f"no gns-kernels script beside {sys.executable}")
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=300)
        _check(out.returncode == 0 and out.stdout.strip() == f"gns-kernels {dist_version}",
               f"gns-kernels --version printed {out.stdout.strip()!r} (rc {out.returncode})")

        # extension and the torch pin
        has_c = ops.cpp_available()
        _check(has_c == (args.expect_extension == "yes"),
               f"cpp_available() is {has_c}, expected extension: {args.expect_extension}")
        requires = md.requires("gns-kernels") or []
        torch_req = [r for r in requires if r.replace(" ", "").startswith("torch") and "extra" not in r]
        want = f"torch=={torch.__version__}" if has_c else "torch>=2.8"
        _check([r.replace(" ", "") for r in torch_req] == [want],
               f"torch requirement {torch_req}, expected [{want!r}]")

        files = {str(f) for f in (md.files("gns-kernels") or [])}
        _check("gns_kernels/py.typed" in files, "gns_kernels/py.typed is not installed")
        _check(any(f.endswith("LICENSE") for f in files), "no LICENSE in the installed distribution")

        # the ops against float64 formulas
        g = torch.Generator().manual_seed(11)
        for n in (1, 37, 4099):
            for dtype in (torch.float32, torch.bfloat16):
                d = torch.randn(n, generator=g).to(dtype)
                q = (d.float() ** 2 + torch.rand(n, generator=g)).to(dtype)
                shift = torch.randn(n, generator=g).to(dtype)
                scale = 2.5
                got = gk.variance_norms(d, q, scale, shift).double()
                d64, q64, s64 = d.double(), q.double(), shift.double()
                s2 = (scale * (q64 - d64 * d64)).clamp_min(0)
                g64 = d64 + s64
                want_vn = torch.stack([s2.sqrt().sum(), g64.abs().sum(), s2.sum(), (g64 * g64).sum()])
                _check(torch.allclose(got, want_vn, rtol=1e-5, atol=1e-6),
                       f"variance_norms n={n} {dtype}: {got.tolist()} vs {want_vn.tolist()}")
                out_buf = torch.empty(2 * n)
                gk.square_pack(d, out_buf, shift)
                x = d64 - s64
                _check(torch.allclose(out_buf.double(), torch.cat([x, x * x]), rtol=1e-6, atol=1e-6),
                       f"square_pack n={n} {dtype}")
        m = torch.randn(5, 9, generator=g)
        gram = gk.gram([m])[0].double()
        _check(torch.allclose(gram, m.double() @ m.double().T, rtol=1e-5, atol=1e-5), "gram")

    no_ext_warnings = [w for w in caught if "no C++ extension" in str(w.message)]
    _check(len(no_ext_warnings) == (0 if has_c else 1),
           f"{len(no_ext_warnings)} 'no C++ extension' warnings, expected {0 if has_c else 1}")
    print(f"smoke_installed: ok (gns-kernels {dist_version} from {os.path.dirname(where)}, "
          f"torch {torch.__version__}, extension: {'yes' if has_c else 'no, eager ops'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
