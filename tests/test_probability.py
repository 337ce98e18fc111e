from __future__ import annotations

import math

import pytest

from decisiond import probability


def test_softmax_with_temperature_hand_values():
    lps = [math.log(0.3), math.log(0.1)]
    assert probability.label_probabilities(lps) == pytest.approx([0.75, 0.25], abs=1e-12)
    # T = 2: exp(lp/2) ∝ sqrt(p): sqrt(.3) / (sqrt(.3) + sqrt(.1))
    expected = math.sqrt(0.3) / (math.sqrt(0.3) + math.sqrt(0.1))
    assert probability.label_probabilities(lps, 2.0)[0] == pytest.approx(expected, abs=1e-12)
    assert probability.label_mass(lps) == pytest.approx(0.4, abs=1e-12)


def test_probabilities_sum_to_one_and_never_nan():
    for lps in ([-1000.0, -1001.0, -2000.0], [-math.inf, -3.0], [-math.inf, -math.inf], [0.0]):
        probs = probability.label_probabilities(lps, 0.5)
        assert math.fsum(probs) == pytest.approx(1.0, abs=1e-9)
        assert not any(math.isnan(p) for p in probs)


def test_bad_temperature():
    for t in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            probability.label_probabilities([0.0, -1.0], t)


def test_choice_confidence():
    # clip((n·max p − 1)/(n − 1), 0, 1)
    assert probability.choice_confidence([0.47, 0.28, 0.25]) == pytest.approx((3 * 0.47 - 1) / 2)
    assert probability.choice_confidence([1 / 3] * 3) == pytest.approx(0.0)
    assert probability.choice_confidence([1.0, 0.0]) == 1.0
    assert probability.choice_confidence([1.0]) == 1.0


def test_score_confidence():
    # max(0, 1 − Σ p_i·|i − mode| / U), U = mean_i |i − (n−1)/2|
    probs = [0.1, 0.1, 0.8]
    u = (1 + 0 + 1) / 3
    assert probability.score_confidence(probs) == pytest.approx(1 - (0.1 * 2 + 0.1 * 1) / u)
    assert probability.score_confidence([0.5, 0.0, 0.0, 0.5]) == 0.0  # split between distant levels
    assert probability.score_confidence([0.0, 1.0, 0.0]) == 1.0
    assert probability.score_confidence([1.0]) == 1.0
    assert probability.expected_level([0.1, 0.1, 0.8]) == pytest.approx(1.7)
