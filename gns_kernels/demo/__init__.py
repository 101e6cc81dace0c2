"""Demo parts: the byte-level transformer, the stdlib corpus, `gns-kernels demo` and `gns-kernels estimate`."""
