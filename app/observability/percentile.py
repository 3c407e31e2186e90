"""One percentile for the whole project: the load reports (load_tests.stats) and the TTFT split by hop
(app.observability.ttft_hops) must agree on what "p99" means. Pure, stdlib only."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default); None for no
    values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
