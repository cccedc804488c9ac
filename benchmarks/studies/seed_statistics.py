"""The numbers a study's table reports: the paper's tokens-to-match metric, seed statistics (spread, paired
differences with their t-interval) and loss-vs-size fits."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# ---- curves --------------------------------------------------------------------------------------------------------


def tokens_to_reach(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """Training tokens at which a validation curve first reaches `target`, interpolated linearly between
    evaluations; None if it never does."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l0 <= target:
            return float(t0)
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def interpolate_curve(curve: Sequence[Sequence[float]], tokens: Sequence[float]) -> np.ndarray:
    """The curve's loss at each of `tokens` (linear between evaluations), to compare runs evaluated at other steps."""
    xs, ys = zip(*curve)
    return np.interp(np.asarray(tokens, dtype=float), np.asarray(xs, dtype=float), np.asarray(ys, dtype=float))


@dataclass
class Spread:
    """Mean and sample standard deviation (n − 1) of per-seed values."""

    mean: float
    std: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.std:.4f}" if self.n > 1 else f"{self.mean:.4f}"

    def format(self, spec: str) -> str:
        return f"{self.mean:{spec}} ± {self.std:{spec}}" if self.n > 1 else f"{self.mean:{spec}}"


def spread(values: Sequence[float]) -> Spread:
    values = [float(v) for v in values]
    if not values:
        raise ValueError("spread() needs at least one value")
    return Spread(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values))


@dataclass
class PairedDifference:
    """Per-seed differences `a − b` of two models trained on the same seeds (same init draw and data order).

    `low`, `high`: the two-sided t confidence interval of the mean difference. The difference *exceeds seed noise*
    when that interval excludes 0; `negative` counts the seeds where `a` is lower, a check that needs no normality.
    """

    differences: list[float]
    mean: float
    std: float
    low: float
    high: float
    confidence: float
    negative: int

    @property
    def n(self) -> int:
        return len(self.differences)

    @property
    def significant(self) -> bool:
        return self.n > 1 and (self.high < 0 or self.low > 0)

    def describe(self) -> str:
        """`mean ± std [low, high]` as every study table prints a difference (one seed: the difference alone)."""
        if self.n < 2:
            return f"{self.mean:+.4f} (one seed)"
        return f"{self.mean:+.4f} ± {self.std:.4f} [{self.low:+.3f}, {self.high:+.3f}]"

    def verdict(self) -> str:
        if self.n < 2:
            return "one seed: no interval"
        if not self.significant:
            return "within seed noise"
        return "lower, beyond seed noise" if self.high < 0 else "higher, beyond seed noise"


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> PairedDifference:
    """Paired comparison of per-seed values (`a[i]` and `b[i]` from seed i): mean ± std of `a − b`, its t-interval."""
    from scipy import stats

    if len(a) != len(b) or not a:
        raise ValueError(f"paired_difference needs equally long, non-empty per-seed lists (got {len(a)}, {len(b)})")
    differences = [float(x) - float(y) for x, y in zip(a, b)]
    summary = spread(differences)
    low, high = (stats.t.interval(confidence, summary.n - 1, summary.mean, stats.sem(differences))
                 if summary.n > 1 else (-math.inf, math.inf))
    return PairedDifference(differences, summary.mean, summary.std, float(low), float(high), confidence,
                            sum(d < 0 for d in differences))


# ---- loss vs model size --------------------------------------------------------------------------------------------


@dataclass
class LogLinearFit:
    """`L(N) = alpha − beta·ln N`: validation loss falling by `beta` per e-fold of non-embedding parameters."""

    alpha: float
    beta: float

    def loss(self, parameters) -> np.ndarray:
        return self.alpha - self.beta * np.log(np.asarray(parameters, dtype=float))

    def parameters_for(self, loss: float) -> float:
        """The model size at which this fit reaches `loss` (inverse of `loss`)."""
        if self.beta <= 0:
            return math.nan
        return float(math.exp((self.alpha - loss) / self.beta))

    def describe(self) -> str:
        return f"L = {self.alpha:.3f} − {self.beta:.4f}·ln N"


def fit_log_linear(parameters: Sequence[float], losses: Sequence[float]) -> LogLinearFit:
    """Least-squares `L = alpha − beta·ln N` over every (size, loss) point, one point per run."""
    if len(set(parameters)) < 2:
        raise ValueError("a loss-vs-size fit needs at least two model sizes")
    slope, intercept = np.polyfit(np.log(np.asarray(parameters, dtype=float)), np.asarray(losses, dtype=float), 1)
    return LogLinearFit(float(intercept), float(-slope))


@dataclass
class PowerLawFit:
    """`L(N) = a·(N / 1e6)^(−b) + c`, the scaling-law form with an irreducible loss `c` (N in parameters)."""

    a: float
    b: float
    c: float

    def loss(self, parameters) -> np.ndarray:
        return self.a * (np.asarray(parameters, dtype=float) / 1e6) ** (-self.b) + self.c

    def parameters_for(self, loss: float) -> float:
        if loss <= self.c or self.a <= 0 or self.b <= 0:
            return math.nan
        return float(1e6 * ((loss - self.c) / self.a) ** (-1 / self.b))

    def describe(self) -> str:
        return f"L = {self.a:.3f}·(N/1M)^−{self.b:.3f} + {self.c:.3f}"


def fit_power_law(parameters: Sequence[float], losses: Sequence[float]) -> PowerLawFit | None:
    """Least-squares `L = a·(N/1e6)^−b + c`; None when it is not identifiable (fewer than 4 sizes) or does not
    converge to a > 0, b > 0."""
    from scipy.optimize import curve_fit

    if len(set(parameters)) < 4:
        return None
    x = np.asarray(parameters, dtype=float) / 1e6
    y = np.asarray(losses, dtype=float)

    def model(n, a, b, c):
        return a * n ** (-b) + c

    try:
        (a, b, c), _ = curve_fit(model, x, y, p0=(float(np.ptp(y)) or 1.0, 0.5, float(y.min()) - 0.5),
                                 bounds=([0, 0, 0], [np.inf, 5, np.inf]), maxfev=20000)
    except (RuntimeError, ValueError):
        return None
    if a <= 0 or b <= 0:
        return None
    return PowerLawFit(float(a), float(b), float(c))


def parameter_saving(llama_fit, resformer_fit, largest: float) -> float:
    """`1 − N_res / N_max`: the share of parameters ResFormer can drop and still reach Llama's fitted loss at the
    largest size `N_max` (negative when it needs more)."""
    return 1.0 - resformer_fit.parameters_for(float(llama_fit.loss(largest))) / largest
