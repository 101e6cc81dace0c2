#!/bin/bash
# One pilot run of the paper-cpu search: a single-rank demo run (R = 2 micro-batches, the
# paper's raw estimator), one thread, low priority; output folder /tmp/paper-pilot/<name>.
# usage: bench/paper_pilot.sh NAME [gns-kernels demo options...]
# The log (progress and summary line) goes to /tmp/paper-pilot/<name>.log.
name=$1; shift
cd "$(dirname "$0")/.." && export PYTHONPATH=$PWD OMP_NUM_THREADS=1
mkdir -p /tmp/paper-pilot
exec nice -n 10 python -m gns_kernels.cli demo --ranks 1 --micro-batches 2 --raw-gns \
    --checkpoint-every 1000000 --quiet --overwrite --out /tmp/paper-pilot/$name "$@" \
    > /tmp/paper-pilot/$name.log 2>&1
