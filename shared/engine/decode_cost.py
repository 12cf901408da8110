"""What a decode step costs by its number of rows, from the worker's own decode steps.

A decode step's time grows with its rows: about `a + b * rows` (on a CPU, 0.077 s for one row and
0.78 s for 48; on a GPU `b` is tiny next to `a`). The engine records every step that ran only
decode rows; this module fits that line and says how many more rows a step may take while its
predicted time stays within `1 + slack` of its own: `b * extra <= slack * (a + b * rows)`, so
`extra <= slack * (a / b + rows)`. Only the ratio `a / b` (the fixed cost, in rows) matters.
Other work in the step (prompt chunks, timed by the caller from its prefill rate) adds to the
step's own time, and so to the rows it may take.

The fit is least squares over the sizes seen, each size once, at the median of its last
`SAMPLES_PER_SIZE` steps (a step slowed by something else, a collection or another process on
the same cores, does not move it), counted once it has `MIN_SAMPLES` of them. Each size counting
once keeps the slope: a worker that runs thousands of steps at one size (a chat beside a held
batch job) would otherwise fade out the far size that pins it. A size not seen for `MAX_AGE`
decode steps is dropped: a slope measured when the machine was busier or idler than now is not
kept for good, and a size the bound no longer lets run is measured again (see below).

Before two sizes `MIN_SPAN_ROWS` apart are counted, the slope is unknown, and the model assumes
the most a row can cost: no fixed cost (`a = 0`, time proportional to rows), so only
`slack * rows` extra rows (and none beside prompt chunks alone, whose cost in rows it does not
know yet). The bound then holds whatever the true line, and the step it leaves (the interactive
rows with few or no bulk rows) is the second size the fit needs. A line that does not rise
(`b <= 0`: a GPU whose step time the rows do not change) bounds nothing but a slack of 0.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

MIN_SPAN_ROWS = 2  # sizes this far apart, at least, before the slope is trusted
SAMPLES_PER_SIZE = 5
MIN_SAMPLES = 3
MAX_AGE = 500  # decode steps
MAX_SIZES = 16


class DecodeCost:
    def __init__(self, max_sizes: int = MAX_SIZES, max_age: int = MAX_AGE):
        if max_sizes < 2:
            raise ValueError(f"max_sizes must be >= 2 (a line needs two sizes), got {max_sizes}")
        if max_age < 1:
            raise ValueError(f"max_age must be >= 1, got {max_age}")
        self.max_sizes = max_sizes
        self.max_age = max_age
        self.num_steps = 0  # decode steps recorded
        # rows -> (its latest steps' seconds, the step it was last seen); least recent first
        self._sizes: dict[int, tuple[deque[float], int]] = {}

    def record(self, num_rows: int, seconds: float) -> None:
        """One decode-only step's rows and time. A sample no step could give (no rows, a time
        below zero or not finite) is ignored: one bad clock reading must not skew every bound."""
        if num_rows < 1 or not 0 <= seconds < math.inf:
            return
        self.num_steps += 1
        samples, _ = self._sizes.pop(num_rows, (deque(maxlen=SAMPLES_PER_SIZE), 0))
        samples.append(seconds)
        self._sizes[num_rows] = (samples, self.num_steps)
        oldest = next(iter(self._sizes))
        if (
            len(self._sizes) > self.max_sizes
            or self._sizes[oldest][1] <= self.num_steps - self.max_age
        ):
            del self._sizes[oldest]

    def line(self) -> tuple[float, float] | None:
        """The fitted (a, b) of `seconds = a + b * rows`; None before sizes far enough apart."""
        points = {
            rows: statistics.median(samples)
            for rows, (samples, seen) in self._sizes.items()
            if len(samples) >= MIN_SAMPLES and seen > self.num_steps - self.max_age
        }
        if len(points) < 2 or max(points) - min(points) < MIN_SPAN_ROWS:
            return None
        mean_x = sum(points) / len(points)
        mean_y = sum(points.values()) / len(points)
        spread = sum((x - mean_x) ** 2 for x in points)
        b = sum((x - mean_x) * (y - mean_y) for x, y in points.items()) / spread
        return mean_y - b * mean_x, b

    def predict(self, num_rows: int) -> float | None:
        """A decode step's predicted seconds; None before the line is known."""
        line = self.line()
        if line is None:
            return None
        a, b = line
        return a + b * num_rows

    def max_extra_rows(self, num_rows: int, slack: float, other_seconds: float = 0.0) -> int | None:
        """The most rows that may join a step of `num_rows` rows (and `other_seconds` of other
        work: prompt chunks) while its predicted time stays within `1 + slack` of the step's
        own; None: no bound (the time does not grow with rows)."""
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        if not 0 <= slack < math.inf:
            raise ValueError(f"slack must be >= 0 and finite, got {slack}")
        if not 0 <= other_seconds < math.inf:
            raise ValueError(f"other_seconds must be >= 0 and finite, got {other_seconds}")
        if slack == 0:
            return 0
        line = self.line()
        if line is None:  # the most a row can cost, and no other work known to cost anything
            return math.floor(slack * num_rows + 1e-9)
        a, b = line
        if b <= 0:
            return None
        # (A fixed cost below zero is noise.)
        extra = slack * (max(0.0, a) + other_seconds + b * num_rows) / b
        return math.floor(extra + 1e-9) if extra < math.inf else None  # (b far below a)
