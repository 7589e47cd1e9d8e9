"""Tolerances derived from the precision used and the scale of what is compared.

Two correct computations of the same value in floating point differ by rounding: the
order of a reduction (how a kernel blocks it, which thread sums which part) changes the
last bits, and the difference scales with the size of the terms, not with the size of
the one element compared. An absolute tolerance fixed by hand ignores that scale: 1e-5
is forty float32 ulps of a value near 2 and a fifth of one ulp of a value near 64. So a
comparison here takes its bound from

* `eps`, the unit roundoff of the dtype the work is done in (`torch.finfo(dtype).eps`);
* `scale`, the largest magnitude among the values compared (the reference's largest
  entry): the terms a reduction sums are of that order;
* the work between the inputs and the compared value: `reductions` reductions in
  series, each over at most `width` terms. Blocked and pairwise summation, which BLAS
  and torch's CPU and CUDA reductions use, round about `log2(width) + 1` times along
  any one path through a reduction of `width` terms.

    bound = reductions * (log2(width) + 1) * eps * scale

A real error (a wrong weight, position, mask or step) moves values by a fraction of
their scale, thousands of ulps at least: `tests/test_numerics.py` checks that this
bound still fails on a perturbed head.
"""

from __future__ import annotations

import math

import torch


def rounding_bound(expected: torch.Tensor, dtype: torch.dtype, *, reductions: int, width: int) -> float:
    """Largest |difference| two correct `dtype` computations of `expected` may show (module docstring)."""
    if reductions < 1 or width < 1:
        raise ValueError(f"reductions and width must be >= 1, got {reductions} and {width}")
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    return reductions * (math.log2(width) + 1) * torch.finfo(dtype).eps * scale


def worst_difference(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, tuple[int, ...], float, float]:
    """(largest |actual - expected|, its index, actual there, expected there)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shapes differ: {list(actual.shape)} vs expected {list(expected.shape)}")
    actual, expected = actual.detach(), expected.detach()
    difference = (actual.double() - expected.double()).abs()
    if not bool(torch.isfinite(difference).all()):
        index = tuple(int(i) for i in torch.nonzero(~torch.isfinite(difference))[0])
        return math.inf, index, float(actual[index]), float(expected[index])
    flat = int(difference.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), difference.shape))
    return float(difference.reshape(-1)[flat]), index, float(actual[index]), float(expected[index])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, bound: float, what: str) -> None:
    """Fail unless every element of `actual` is within `bound` of `expected`; the message
    names the worst element, its two values and the scale of the compared values."""
    worst, index, got, want = worst_difference(actual, expected)
    if worst > bound:
        scale = float(expected.detach().abs().max())
        raise AssertionError(
            f"{what}: worst |difference| {worst:.3g} at index {list(index)} (got {got:.6g}, expected {want:.6g}); "
            f"bound {bound:.3g}, largest |expected| {scale:.3g}, {actual.numel()} elements"
        )
