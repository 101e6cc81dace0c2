"""`gns-kernels bench overhead`: the command lives in gns_kernels.benchmarks.overhead.

This module keeps the path the command line and ``python -m gns_kernels.demo.overhead``
use; everything here is that module's.
"""
from __future__ import annotations

import sys

from gns_kernels.benchmarks.overhead import (  # noqa: F401
    QUICK,
    add_arguments,
    format_results,
    main,
    run,
)

if __name__ == "__main__":
    sys.exit(main())
