"""Timing that holds on a noisy machine: interleaved blocks, medians with their spread, an honest verdict.

Two things compared one after the other measure the load of the machine as much as themselves (a
baseline measured twice on a loaded machine differed 20x). Every bench here therefore

1. runs the compared sides in **alternating blocks** in one process — baseline, candidate, baseline,
   …, baseline — so load that comes and goes hits both; each candidate block is paired with the mean of
   the two baseline blocks around it (a linear drift cancels);
2. takes per block the wall time and the process CPU time (``time.process_time``: what this process
   itself ran; another process on the same cores inflates wall time, much less CPU time);
3. reports the **median** over blocks of each side and of the paired ratio, with the ratio's spread: its
   interquartile range, min–max, and a distribution-free 95% confidence interval of the median (order
   statistics of the paired ratios, the sign-test interval; no normality assumed);
4. gives a **verdict** instead of a bare number: if that interval contains 1 the effect is smaller than
   the noise and it prints "too noisy" with the interval, not a ratio; against a goal it says met (the
   whole interval on the right side), missed (the whole interval on the wrong side) or undecided.

    from bench.timing import Blocks, compare
    blocks = Blocks("plain", "fit")
    blocks.run("plain", lambda: step_plain(), n=20)   # or: with blocks.time("fit", n=20): ...
    print(compare(blocks, goal=1.03).report())
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Optional

Clock = Literal["wall", "cpu"]
CLOCKS: tuple[Clock, ...] = ("wall", "cpu")


@dataclass
class Sample:
    """Seconds per item of one block, by both clocks."""

    wall: float
    cpu: float

    def of(self, clock: Clock) -> float:
        return self.wall if clock == "wall" else self.cpu


@dataclass
class Blocks:
    """Per-block timings of a ``baseline`` and a ``candidate``, recorded in alternating order.

    The expected order is B C B C … C B: ``n`` candidate blocks between ``n + 1`` baseline blocks.
    ``next_side`` says which comes next; ``record`` refuses a block out of turn, so a bench cannot
    silently fall back to measuring one side after the other.
    """

    baseline: str
    candidate: str
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.samples = {self.baseline: [], self.candidate: []}

    @property
    def next_side(self) -> str:
        return self.candidate if self.order and self.order[-1] == self.baseline else self.baseline

    def record(self, side: str, wall: float, cpu: float, n: int) -> None:
        if side != self.next_side:
            raise RuntimeError(f"block of {side!r} out of turn: blocks alternate, {self.next_side!r} is next "
                               f"(order so far: {self.order})")
        self.samples[side].append(Sample(wall / n, cpu / n))
        self.order.append(side)

    @contextlib.contextmanager
    def time(self, side: str, n: int) -> Iterator[None]:
        """Time the body as one block of ``n`` items of ``side``."""
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        self.record(side, time.perf_counter() - wall, time.process_time() - cpu, n)

    def run(self, side: str, fn: Callable[[], object], n: int) -> None:
        """One block: ``fn()`` called ``n`` times."""
        with self.time(side, n):
            for _ in range(n):
                fn()


def interleave(baseline: Callable[[], object], candidate: Callable[[], object], blocks: int, per_block: int,
               names: tuple[str, str] = ("baseline", "candidate"), warmup: int = 1) -> Blocks:
    """``blocks`` candidate blocks between ``blocks + 1`` baseline blocks of ``per_block`` calls each,
    after ``warmup`` untimed calls of each side."""
    for _ in range(warmup):
        baseline()
        candidate()
    out = Blocks(*names)
    for _ in range(blocks):
        out.run(out.baseline, baseline, per_block)
        out.run(out.candidate, candidate, per_block)
    out.run(out.baseline, baseline, per_block)
    return out


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): the distribution-free interval of the median of ``values``.

    The median lies between the j-th smallest and j-th largest of n values with probability
    1 - 2·P(Binomial(n, 1/2) < j); j is the largest that keeps this >= ``confidence``. Below 6 values
    no j reaches 95%: the interval is min–max and its actual coverage is returned.
    """
    x, n = sorted(values), len(values)
    j, tail = 1, 0.5**n  # tail = P(Binomial(n, 1/2) <= j - 1)
    while True:
        nxt = tail + math.comb(n, j) * 0.5**n
        if j >= n // 2 or 1 - 2 * nxt < confidence:
            break
        j, tail = j + 1, nxt
    return x[j - 1], x[n - j], 1 - 2 * tail


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


@dataclass
class Ratio:
    """Paired ratios candidate/baseline of one clock and their summary."""

    clock: Clock
    values: list[float]
    median: float
    ci: tuple[float, float]
    coverage: float
    iqr: tuple[float, float]

    @property
    def resolved(self) -> bool:
        """The difference from 1 exceeds the noise: the median's interval does not contain 1."""
        return not self.ci[0] <= 1.0 <= self.ci[1]

    def goal(self, goal: Optional[float], higher_is_better: bool) -> str:
        if goal is None:
            return ""
        lo, hi = self.ci
        sign = ">=" if higher_is_better else "<="
        if (lo >= goal) if higher_is_better else (hi <= goal):
            return f"goal {sign} {goal}: met"
        if (hi < goal) if higher_is_better else (lo > goal):
            return f"goal {sign} {goal}: missed"
        return f"goal {sign} {goal}: undecided (the interval straddles it)"


def paired_ratios(blocks: Blocks, clock: Clock) -> list[float]:
    """candidate_k / mean(baseline_k, baseline_k+1): each candidate block against the baseline blocks
    either side of it."""
    base, cand = blocks.samples[blocks.baseline], blocks.samples[blocks.candidate]
    if len(base) != len(cand) + 1 or not cand:
        raise ValueError(f"need n candidate blocks between n + 1 baseline blocks, got {len(cand)} and {len(base)}")
    return [c.of(clock) / ((base[k].of(clock) + base[k + 1].of(clock)) / 2) for k, c in enumerate(cand)]


@dataclass
class Comparison:
    blocks: Blocks
    ratios: dict[str, Ratio]
    goal: Optional[float] = None
    higher_is_better: bool = False
    unit: str = "ms"
    per: str = "iteration"
    ratio_name: str = ""

    def verdict(self, clock: Clock = "wall") -> str:
        """One line: the ratio with its interval, or "too noisy" with the interval; then the goal."""
        r = self.ratios[clock]
        lo, hi = r.ci
        name = self.ratio_name or f"{self.blocks.candidate}/{self.blocks.baseline}"
        if r.resolved:
            text = f"{name} ({clock}) = {r.median:.3f}  [{r.coverage:.0%} CI of the median {lo:.3f}–{hi:.3f}]"
        else:
            text = (f"{name} ({clock}): too noisy to give a ratio — the {r.coverage:.0%} interval of the median "
                    f"{lo:.3f}–{hi:.3f} contains 1 (median {r.median:.3f})")
        goal = r.goal(self.goal, self.higher_is_better)
        return f"{text}; {goal}" if goal else text

    def report(self) -> str:
        scale = {"ms": 1e3, "s": 1.0, "us": 1e6}[self.unit]
        b = self.blocks
        n = len(b.samples[b.candidate])
        lines = []
        width = max(len(b.baseline), len(b.candidate))
        for side in (b.baseline, b.candidate):
            parts = []
            for clock in CLOCKS:
                vals = [s.of(clock) * scale for s in b.samples[side]]
                q1, q3 = quartiles(vals)
                parts.append(f"{clock} {statistics.median(vals):8.2f} {self.unit} (IQR {q1:.2f}–{q3:.2f})")
            lines.append(f"  {side:<{width}} : " + "   ".join(parts) + f"  per {self.per}, "
                         f"{len(b.samples[side])} blocks")
        for clock in CLOCKS:
            r = self.ratios[clock]
            lines.append(f"  ratio ({clock}) over {n} paired blocks: median {r.median:.3f}, IQR "
                         f"{r.iqr[0]:.3f}–{r.iqr[1]:.3f}, min–max {min(r.values):.3f}–{max(r.values):.3f}")
        for clock in CLOCKS:
            lines.append("  verdict: " + self.verdict(clock))
        return "\n".join(lines)


def compare(blocks: Blocks, goal: Optional[float] = None, higher_is_better: bool = False, unit: str = "ms",
            per: str = "iteration", ratio_name: str = "") -> Comparison:
    """Summarize alternating blocks: per-clock paired ratios, medians, spreads and verdicts."""
    ratios = {}
    for clock in CLOCKS:
        values = paired_ratios(blocks, clock)
        lo, hi, coverage = median_interval(values)
        ratios[clock] = Ratio(clock, values, statistics.median(values), (lo, hi), coverage, quartiles(values))
    return Comparison(blocks, ratios, goal, higher_is_better, unit, per, ratio_name)
