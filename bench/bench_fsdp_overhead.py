"""Step-time and memory cost of the FSDP2 GNS hook (gk.attach_fsdp_gns): the paper's
Table 9 / Table 10 FSDP rows, on this machine.

    python bench/bench_fsdp_overhead.py [--ranks 2] [--every 100] [--rounds 10] ...

The same as ``gns-kernels bench overhead --parallel fsdp2`` (gns_kernels.benchmarks.overhead,
where the configurations, the schedule and the memory probe are described), with this
script's defaults: --f1-rounds 6 --warmup 3 --timeout 3600.
"""
from __future__ import annotations

import argparse
import sys

from gns_kernels.benchmarks import overhead


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_fsdp_overhead.py", description=__doc__.splitlines()[0])
    overhead.add_arguments(p)
    p.set_defaults(parallel="fsdp2", f1_rounds=6, warmup=3, timeout=3600.0)
    return overhead.run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
