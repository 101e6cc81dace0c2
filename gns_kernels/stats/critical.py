"""Critical batch sizes from a gradient noise scale (paper Sec. 3.3 and Appendix C)."""
from __future__ import annotations

import math

from .gns import GNSEstimate, check_geometry

__all__ = ["CBS_RULES", "critical_batch_size"]

CBS_RULES = ("fraction", "inflection", "efficiency")  # the rules of critical_batch_size


def critical_batch_size(gns, geometry: str, rule: str = "fraction", kappa: float = 0.5) -> float:
    """Critical batch size from a GNS (paper Sec. 3.3 and Appendix C).

    gns: a number (or a GNSEstimate, whose .gns is used; nan when it is invalid).
    rule:
      'fraction'   smallest B reaching a fraction kappa in (0, 1) of the deterministic
                   improvement: l2 (SGD): kappa/(1-kappa) * GNS (= GNS at kappa = 1/2);
                   l1 / nuclear: (1/(1-sqrt(kappa)))^2 * GNS. (B = GNS/theta^2 is
                   kappa = (1-theta)^2.)
      'inflection' inflection point of (1-sqrt(GNS/B))^2: 16/9 * GNS (l1 / nuclear only).
      'efficiency' maximum improvement per example: 4 * GNS (l1 / nuclear only).
    For l2 the improvement curve is concave with its efficiency maximum at B = 1, so
    'inflection' and 'efficiency' are undefined there (ValueError).
    """
    check_geometry(geometry)
    if isinstance(gns, GNSEstimate):
        gns = gns.gns
    try:
        g = float(gns)
    except (TypeError, ValueError):
        raise ValueError(f"gns: expected a number or a GNSEstimate, got {gns!r}") from None
    if g < 0:
        raise ValueError(f"gns: expected a non-negative noise scale, got {g}")
    if rule == "fraction":
        k = float(kappa)
        if not 0.0 < k < 1.0:
            raise ValueError(f"kappa: expected a fraction in (0, 1), got {kappa}")
        if geometry == "l2":
            return k / (1.0 - k) * g
        return g / (1.0 - math.sqrt(k)) ** 2
    if rule in ("inflection", "efficiency"):
        if geometry == "l2":
            raise ValueError(
                f"rule: {rule!r} is undefined for geometry 'l2' (SGD's improvement curve is "
                "concave with no inflection point); use rule='fraction'"
            )
        return (16.0 / 9.0 if rule == "inflection" else 4.0) * g
    raise ValueError(f"rule: expected one of {CBS_RULES}, got {rule!r}")
