"""Progress display of a demo run (rank 0) and the CSV number format.

On a terminal with tqdm installed: a tqdm bar over the sample budget with the step, loss,
batch, GNS and LR as postfix. Otherwise: one text line (rewritten in place on a terminal,
a new line every ~5% of the budget when the output is a file or pipe).
"""
from __future__ import annotations

import math
import sys
import time


def fmt(x) -> str:
    """A CSV cell: '' for None and nan, 8 significant digits for floats."""
    if x is None:
        return ""
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.8g}"
    return str(x)


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """update(...) after each optimizer step, close() at the end; nothing when disabled."""

    def __init__(self, total_samples: int, enabled: bool, start_samples: int = 0):
        self.total = total_samples
        self.enabled = enabled
        self.tty = enabled and sys.stdout.isatty()
        self.next_print = 0.0
        self.t0 = time.time()
        tqdm = _tqdm() if self.tty else None
        self.bar = None
        if tqdm is not None:
            self.bar = tqdm(total=total_samples, initial=start_samples, unit="seq",
                            dynamic_ncols=True, file=sys.stdout)
        self.done = start_samples

    def update(self, step, samples, tokens, loss, batch, gns, lr):
        if not self.enabled:
            return
        gns_text = "  -  " if gns is None else f"{gns:7.1f}"
        if self.bar is not None:
            self.bar.update(samples - self.done)
            self.done = samples
            self.bar.set_postfix_str(f"step {step} tokens {tokens / 1e6:.2f}M loss {loss:.3f} "
                                     f"batch {batch} GNS {gns_text.strip()} lr {lr:.2e}",
                                     refresh=False)
            return
        frac = min(1.0, samples / self.total)
        elapsed = time.time() - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        width = 20
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (f"[{bar}] {100 * frac:5.1f}% step {step:5d} tokens {tokens / 1e6:6.2f}M "
                f"loss {loss:6.3f} batch {batch:4d} GNS {gns_text} lr {lr:.2e} "
                f"{elapsed:5.0f}s eta {eta:4.0f}s")
        if self.tty:
            sys.stdout.write("\r" + line)
            sys.stdout.flush()
        elif frac >= self.next_print:
            print(line, flush=True)
            self.next_print = frac + 0.05

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stdout.write("\n")
            sys.stdout.flush()
