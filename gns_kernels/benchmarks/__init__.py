"""Benchmarks shipped with the package.

``harness``: what every multi-rank step-time benchmark here shares (spawning gloo ranks,
a timed training step, the interleaved schedule, the peak-memory probe).
``overhead``: the step-time and memory cost of the GNS hooks under DDP and FSDP2
(``gns-kernels bench overhead``).
"""
