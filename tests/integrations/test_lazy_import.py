"""`import gns_kernels` imports none of the integrations or their stacks; each
integration module imports only its own stack."""
from __future__ import annotations

import subprocess
import sys

STACKS = ("lightning", "pytorch_lightning", "transformers", "wandb", "torchdata", "torchtitan",
          "gns_kernels.integrations")


def _loaded(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", code + f"\nimport sys\nprint(sorted(m for m in {STACKS!r} if m in sys.modules))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_import_gns_kernels_loads_no_integration():
    assert _loaded("import gns_kernels, gns_kernels.adaptive") == []


def test_dcp_and_wandb_modules_load_no_other_stack():
    assert _loaded("import gns_kernels.integrations.dcp") == ["gns_kernels.integrations"]
    assert _loaded("import gns_kernels.integrations.wandb") == ["gns_kernels.integrations"]
