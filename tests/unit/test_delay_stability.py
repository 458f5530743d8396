"""The stability bounds the delay benchmark measures through the product's rule, against closed forms and against the
eigenvalues of each correction's linear map written out by hand (benchmarks/delay_stability.py)."""

import numpy as np
import pytest

from benchmarks.delay_stability import threshold


def by_hand(beta1: float, coefficients: tuple[float, float, float]) -> float:
    """The largest stable lr * h of w(t+1) = w(t) + c0 D(t) + c1 D(t-1) + c2 D(t-2), D(t) = -lr m(t),
    m(t) = beta1 m(t-1) + (1 - beta1) h w(t-1) (the gradient of the weights one update old): the spectral radius of
    the map on (w(t), w(t-1), m(t-1), D(t-1), D(t-2)), bisected."""

    def radius(step: float) -> float:
        columns = []
        for state in np.eye(5):
            w, w_old, m, d1, d2 = state
            m_new = beta1 * m + (1 - beta1) * w_old
            d = -step * m_new
            columns.append([w + coefficients[0] * d + coefficients[1] * d1 + coefficients[2] * d2, w, m_new, d, d1])
        return max(abs(np.linalg.eigvals(np.array(columns).T)))

    low, high = 0.0, 50.0
    while high - low > 1e-4:
        low, high = (low, (low + high) / 2) if radius((low + high) / 2) > 1 + 1e-9 else ((low + high) / 2, high)
    return low


@pytest.mark.parametrize("beta1", [0.8, 0.9])
def test_sync_and_a_stale_gradient_meet_their_closed_forms(beta1):
    # 1% bisection and a finite run bound the measured threshold; the two rules differ by a factor of 18 or more
    assert threshold(beta1, "sync", steps=1000, tolerance=1e-2) == pytest.approx(
        2 * (1 + beta1) / (1 - beta1), rel=0.02
    )
    assert threshold(beta1, "2bw", steps=1000, tolerance=1e-2) == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize(
    "correction, strength, coefficients",
    [
        ("error_feedback", 1.0, (2.0, -1.0, 0.0)),  # W += D(t) + (D(t) - D(t-1))
        ("predictive_error_feedback", 1.0, (4.0, -4.0, 1.0)),
        ("predictive_error_feedback", 0.5, (2.25, -1.5, 0.25)),  # (1+s)^2, -2s(1+s), s^2
    ],
)
def test_the_corrections_meet_their_linear_maps(correction, strength, coefficients):
    measured = threshold(0.9, "2bw", correction, strength, steps=1000, tolerance=1e-2)
    assert measured == pytest.approx(by_hand(0.9, coefficients), rel=0.02)
