"""Regularised fits on top of any mode, ``calibrate --auto``, profiles that carry (and enforce) their whole mode,
and bootstrap intervals checked by hand."""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
from servers import run_decisiond

from decisiond import evaluation, evaluation_report
from decisiond.canonical import DecisionRequest, Level, Message, Option, Question, Text
from decisiond.engine.calibration import (
    MIN_FIT_QUESTIONS,
    STRENGTHS,
    Fit,
    Profile,
    ProfileError,
    Sample,
    VariantEvidence,
    combine,
    fit,
    folds,
    regularised_fit,
    shifts,
)
from decisiond.engine.local import LocalEngine
from decisiond.engine.prompt import PROMPT_FORMAT_VERSION
from decisiond.probability import label_probabilities

WORDS = ("invoice", "refund", "login", "crash", "upgrade", "password", "charged", "slow", "plan", "error", "today",
         "please", "angry", "thanks", "broken", "price")
TEAMS = ("billing", "technical", "account", "sales")
TRUE_TEMPERATURE = 2.5


def questions():
    return (Question("choice", "team", (Text("Which team should handle this ticket?"),),
                     options=tuple(Option(t, "handles " + t) for t in TEAMS)),
            Question("yes_no", "urgent", (Text("The customer needs an answer today."),)),
            Question("score", "frustration", (Text("How frustrated is the customer?"),),
                     levels=(Level("Calm"), Level("Frustrated but civil"), Level("Very angry"))))


@pytest.fixture(scope="module")
def synthetic(tiny_engine):
    """40 labeled items built from the tiny model: random tickets whose gold answers are drawn from the model's own
    raw probabilities softened to temperature 2.5, so the raw mode is overconfident by a known amount."""
    rng = random.Random(17)
    items = []
    for _ in range(40):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        request = DecisionRequest((Message("user", (Text(text),)),), questions())
        answers = tiny_engine.decide(request).answers
        gold = [rng.choices(range(len(a.label_logprobs)), weights=label_probabilities(a.label_logprobs,
                                                                                      TRUE_TEMPERATURE))[0]
                for a in answers]
        items.append(evaluation.LabeledItem(request, gold))
    samples, groups = evaluation.collect(tiny_engine, items, progress=False)
    return items, samples, groups


def held_out_log_loss(samples: list[Sample], contextual: bool, with_bias: bool, strength: float) -> float:
    """Cross-validated log loss computed the long way: a fit per fold, then the metrics on the held-out fold."""
    pairs = []
    for held in folds(len(samples)):
        fitted = fit([s for i, s in enumerate(samples) if i not in held], contextual, with_bias, strength)
        pairs += [(combine(samples[i].variants, contextual, fitted.temperature, fitted.bias)[0], samples[i].gold)
                  for i in held]
    return evaluation.metrics(pairs, 0.5)["log_loss"]


def test_fits_over_choices_with_different_option_counts():
    """Under cyclic order a 2-option and a 4-option choice have 2 and 4 variants: the padded variants and positions
    count for nothing. The fit's loss is checked against the metrics computed the long way through ``combine``."""
    rng = random.Random(5)
    samples = []
    for i in range(12):
        n = 2 if i % 2 else 4
        variants = [VariantEvidence(order, [rng.gauss(0, 2) for _ in range(n)]) for order in shifts(n, True)]
        samples.append(Sample("choice", variants, rng.randrange(n)))

    def long_way(fitted: Fit) -> float:
        return evaluation.metrics([(combine(s.variants, False, fitted.temperature, fitted.bias or None)[0], s.gold)
                                   for s in samples], 0.5)["log_loss"]

    assert regularised_fit(samples, with_bias=True).base_log_loss == pytest.approx(long_way(Fit()), rel=1e-9)
    fitted = fit(samples, with_bias=True)
    assert math.isfinite(fitted.temperature) and len(fitted.bias) == 4 and all(map(math.isfinite, fitted.bias))
    assert fitted.temperature != 1.0 and long_way(fitted) < long_way(Fit())


@pytest.mark.parametrize("base", ["raw", "both"])
def test_regularised_fit_is_never_worse_than_its_base_mode_in_cross_validation(synthetic, base):
    _, samples, _ = synthetic
    order, calibrate_mode = evaluation.MODES[base]
    contextual = calibrate_mode == "contextual"
    kept = []
    for kind in evaluation.KINDS:
        chosen = [evaluation.in_order(s, order) for s in samples if s.kind == kind]
        assert len(chosen) == 40
        selection = regularised_fit(chosen, contextual, with_bias=True)
        base_loss = evaluation.metrics([(combine(s.variants, contextual)[0], s.gold) for s in chosen], 0.5)["log_loss"]
        assert selection.base_log_loss == pytest.approx(base_loss, rel=1e-9)
        assert selection.cv_log_loss <= selection.base_log_loss  # compared in the fit's own arithmetic
        weights = [len(held) / len(chosen) for held in folds(len(chosen))]
        assert sum(w * f for w, f in zip(weights, selection.fold_base)) == pytest.approx(base_loss, rel=1e-9)
        if selection.kept_base:
            assert selection.fit == Fit() and selection.cv_log_loss == selection.base_log_loss
            continue
        # The reported number is the held-out log loss of fits with the chosen strength, fold by fold …
        assert selection.cv_log_loss == pytest.approx(
            held_out_log_loss(chosen, contextual, True, selection.strength), rel=1e-6)
        assert selection.cv_log_loss == selection.candidates[str(selection.strength)]
        assert sum(w * f for w, f in zip(weights, selection.fold_chosen)) == pytest.approx(selection.cv_log_loss)
        # … and its gain over the base mode is more than one standard error of the gain across folds.
        gains = np.array(selection.fold_chosen) - np.array(selection.fold_base)
        assert selection.gain_error == pytest.approx(gains.std(ddof=1) / math.sqrt(len(gains)))
        assert selection.cv_log_loss + selection.gain_error < base_loss
        kept.append(kind)
        if base == "raw":
            # The labels were drawn at temperature 2.5: the raw mode is overconfident, a temperature fit softens it
            # (as far as 40 questions show beyond noise: the score fit, with the strongest penalty, only just).
            assert regularised_fit(chosen, contextual).fit.temperature > 1.0
    if base == "raw":
        assert len(kept) >= 2


def test_unregularised_bias_fit_is_what_the_penalty_prevents(synthetic):
    """On 40 items an unpenalised temperature-and-bias fit does worse out of sample than the chosen strength."""
    _, samples, _ = synthetic
    chosen = [s for s in samples if s.kind == "choice"]
    chosen = [evaluation.in_order(s, "given") for s in chosen]
    selection = regularised_fit(chosen, with_bias=True)
    assert held_out_log_loss(chosen, False, True, 0.0) > selection.cv_log_loss


def test_a_fit_that_cannot_beat_the_base_mode_is_not_kept():
    # Every sample has the same logits, and the gold frequencies are exactly their probabilities (3 of 4 say
    # "yes"): the base mode is already the best fit on the whole set, and any fit on part of it does worse on the
    # rest.
    z = [math.log(0.75), math.log(0.25)]
    samples = [Sample("yes_no", [VariantEvidence([0, 1], z)], gold) for gold in (0, 0, 0, 1) * 6]
    selection = regularised_fit(samples, with_bias=True)
    assert selection.kept_base and selection.strength is None and selection.fit == Fit()
    assert selection.cv_log_loss == selection.base_log_loss == pytest.approx(
        -(18 * math.log(0.75) + 6 * math.log(0.25)) / 24)
    assert len(selection.candidates) == 5
    assert all(loss > selection.base_log_loss for loss in selection.candidates.values())
    # Under MIN_FIT_QUESTIONS a type keeps its base mode without trying: its folds cannot tell a gain from noise.
    few = regularised_fit(samples[: MIN_FIT_QUESTIONS - 1], with_bias=True)
    assert few.kept_base and few.candidates == {}


def noisy(rng: random.Random, n: int) -> list[Sample]:
    """Choices whose gold answers are drawn from the base mode's own probabilities: nothing to correct."""
    out = []
    for _ in range(n):
        z = [rng.gauss(0, 1.5) for _ in range(3)]
        out.append(Sample("choice", [VariantEvidence([0, 1, 2], z)],
                          rng.choices(range(3), weights=label_probabilities(z))[0]))
    return out


def test_fits_chosen_on_noise_cost_little_on_fresh_data():
    """30 labeled questions from an already calibrated model, 20 times: keeping the strength with the lowest
    cross-validated loss whenever it beats the base mode at all (the rule before the standard-error one) keeps a
    fit most times, and on 3,000 fresh questions those fits lose more than twice what the selection loses."""
    def loss(samples: list[Sample], fitted: Fit) -> float:
        return evaluation.metrics([(combine(s.variants, False, fitted.temperature, fitted.bias or None)[0], s.gold)
                                   for s in samples], 0.5)["log_loss"]

    fresh = noisy(random.Random(1000), 3000)
    plain_harm, selected_harm, kept = 0.0, 0.0, 0
    for seed in range(20):
        train = noisy(random.Random(seed), 30)
        selection = regularised_fit(train, with_bias=True)
        lowest = min(STRENGTHS, key=lambda s: selection.candidates[str(s)])
        if selection.candidates[str(lowest)] < selection.base_log_loss:
            plain_harm += loss(fresh, fit(train, with_bias=True, strength=lowest)) - loss(fresh, Fit())
        selected_harm += loss(fresh, selection.fit) - loss(fresh, Fit())
        kept += not selection.kept_base
    assert plain_harm > 0.3 and selected_harm < plain_harm / 2, (plain_harm, selected_harm, kept)


def test_eval_reports_each_fitted_mode_beside_its_base_fold_by_fold(synthetic):
    _, samples, groups = synthetic
    report = evaluation.assess(samples, groups, with_bias=True, resamples=50)
    golds = [s.gold for s in samples]
    for mode in evaluation.MODES:
        fits = report["fits"][mode + "+fit"]
        assert fits["base"] == mode and len(fits["folds"]) == 5
        fitted = evaluation.cross_fitted(samples, *evaluation.MODES[mode], with_bias=True)
        base = [evaluation.probabilities(s, *evaluation.MODES[mode]) for s in samples]
        deltas = []
        for number, fold in enumerate(fits["folds"]):
            members = [i for i, f in enumerate(fitted.fold) if f == number]
            assert fold["questions"] == len(members) == 24  # 8 of each type
            assert fold["base"] == pytest.approx(evaluation.metrics([(base[i], golds[i]) for i in members],
                                                                    0.5)["log_loss"])
            assert fold["fit"] == pytest.approx(evaluation.metrics([(fitted.probabilities[i], golds[i])
                                                                    for i in members], 0.5)["log_loss"])
            deltas.append(fold["fit"] - fold["base"])
        assert fits["delta_mean"] == pytest.approx(np.mean(deltas))
        assert fits["delta_sd"] == pytest.approx(np.std(deltas, ddof=1))
        assert fits["folds_worse"] == sum(d > 0 for d in deltas)
        assert fits["strengths"] == fitted.strengths
    text = evaluation_report.table(report)
    assert "| fitted mode | base log loss | +fit log loss |" in text
    raw = report["fits"]["raw+fit"]
    assert (f"| raw+fit | {report['modes']['raw']['all']['log_loss']:.3f} | "
            f"{report['modes']['raw+fit']['all']['log_loss']:.3f} | {raw['delta_mean']:+.3f} ± ") in text


def test_a_fit_stays_within_its_bounds():
    """Answers the base mode always gets right by a wide margin: the unbounded optimum is T → 0 (every answer
    certain), which one held-out mistake would make cost ~27 nats. T stops at 0.2, each bias at ±5."""
    samples = [Sample("choice", [VariantEvidence([0, 1, 2], [2.0, 0.0, -2.0])], 0) for _ in range(30)]
    assert fit(samples).temperature == pytest.approx(0.2)
    biased = fit(samples, with_bias=True)
    assert biased.temperature >= 0.2 - 1e-9 and max(map(abs, biased.bias)) <= 5.0 + 1e-9


@pytest.mark.slow
def test_calibrate_auto_writes_a_profile_for_the_best_cross_validated_mode(synthetic, tiny_engine, tmp_path):
    items, samples, groups = synthetic
    report = evaluation.assess(samples, groups, with_bias=True, resamples=200)
    assert set(report["modes"]) == set(evaluation.ALL_MODES)
    losses = {m: report["modes"][m]["all"]["log_loss"] for m in evaluation.ALL_MODES}
    assert report["best_mode"] == min(losses, key=losses.get)
    # Labels drawn at T = 2.5 from the raw probabilities: a fitted mode must win here.
    assert report["best_mode"].endswith("+fit") and losses["raw+fit"] < losses["raw"]
    text = evaluation_report.table(report)
    assert text.count("★") == 3 and f"**{report['best_mode']}** ★" in text  # both tables and the footnote
    profile, summary = evaluation.calibrate(tiny_engine, items, with_bias=True, auto=True, progress=False,
                                            resamples=200)
    assert summary["best_mode"] == report["best_mode"] and summary["log_loss_by_mode"] == pytest.approx(losses)
    order, calibrate_mode, _ = evaluation.parse_mode(report["best_mode"])
    assert (profile.order, profile.calibrate) == (order, calibrate_mode) and profile.fits
    profile.save(tmp_path / "auto.json")
    assert Profile.load(tmp_path / "auto.json") == profile


def test_profile_applies_its_whole_mode(tiny):
    from test_quality import choice, request

    bias = [0.4, 0.0, -0.2, 0.1]
    profile = Profile("tiny-random", PROMPT_FORMAT_VERSION, order="cyclic", calibrate="contextual",
                      fits={"choice": Fit(temperature=2.0, bias=bias)})
    engine = LocalEngine(tiny, profile=profile)
    assert (engine.order, engine.calibrate) == ("cyclic", "contextual")
    answer = engine.decide(request(choice())).answers[0]
    _, evidence = engine.evidence(request(choice()), order="cyclic", calibrate="contextual")
    # Float rounding apart: the evidence is computed again, after the cached prompt prefix.
    assert answer.probabilities == pytest.approx(combine(evidence[0], True, 2.0, bias)[0], abs=1e-6)
    unfitted = combine(evidence[0], True)[0]
    assert max(abs(a - b) for a, b in zip(answer.probabilities, unfitted)) > 1e-5
    assert len(evidence[0]) == 4 and "order_spread" in answer.extensions
    # A request that changes the mode gets no fitted correction: the fit belongs to the mode.
    given = engine.decide(request(choice(), order="given")).answers[0]
    assert given.probabilities == pytest.approx(combine(evidence[0][:1], True)[0], abs=1e-5)
    assert given.probabilities != pytest.approx(combine(evidence[0][:1], True, 2.0, bias)[0], abs=1e-3)
    # An explicit setting may repeat the profile's mode, not contradict it.
    assert LocalEngine(tiny, order="cyclic", calibrate="contextual", profile=profile).order == "cyclic"
    with pytest.raises(ProfileError, match="fitted with order 'cyclic', not 'given'"):
        LocalEngine(tiny, order="given", profile=profile)


def test_profile_for_another_model_or_prompt_format_is_refused(tiny, tiny_dir, tmp_path):
    with pytest.raises(ProfileError, match="fitted for model 'SmolLM2-135M-Instruct', not 'tiny-random'"):
        LocalEngine(tiny, profile=Profile("SmolLM2-135M-Instruct", PROMPT_FORMAT_VERSION))
    with pytest.raises(ProfileError, match=f"prompt format version {PROMPT_FORMAT_VERSION + 1}, but this decisiond "
                                           f"renders version {PROMPT_FORMAT_VERSION}"):
        LocalEngine(tiny, profile=Profile("tiny-random", PROMPT_FORMAT_VERSION + 1))
    (tmp_path / "broken.json").write_text('{"model": "x"}')
    with pytest.raises(ProfileError, match="not a decisiond calibration profile"):
        Profile.load(tmp_path / "broken.json")
    # The server refuses to start with a clear message and a non-zero exit.
    Profile("tiny-random", PROMPT_FORMAT_VERSION, order="cyclic").save(tmp_path / "other.json")
    done = run_decisiond("serve", "--model", tiny_dir, "--port", "1", "--calibration", str(tmp_path / "other.json"),
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 2
    assert f"fitted for model 'tiny-random', not '{os.path.basename(tiny_dir)}'" in done.stderr


def test_bootstrap_intervals_by_hand():
    rng = random.Random(4)
    groups = [0, 0, 1, 2, 2, 2, 3, 4, 4, 5]  # 6 items, 10 questions
    golds = [rng.randrange(3) for _ in groups]
    raw = [label_probabilities([rng.gauss(0, 2) for _ in range(3)]) for _ in groups]
    other = [label_probabilities([rng.gauss(0, 1) for _ in range(3)]) for _ in groups]
    resamples, seed = 40, 11
    out = evaluation.bootstrap({"raw": raw, "other": other}, golds, groups, resamples=resamples, seed=seed)

    # By hand: the same draws of 6 items, each draw's resampled question list, metrics on it, then the 2.5th and
    # 97.5th percentiles by linear interpolation between order statistics.
    draws = np.random.default_rng(seed).integers(0, 6, size=(resamples, 6))

    def resampled(probs, draw):
        return [(probs[q], golds[q]) for item in draw for q in range(len(groups)) if groups[q] == item]

    def percentile(values, q):
        ordered = sorted(values)
        rank = q * (len(ordered) - 1)
        low = math.floor(rank)
        return ordered[low] + (rank - low) * (ordered[min(low + 1, len(ordered) - 1)] - ordered[low])

    per_draw = {mode: [evaluation.metrics(resampled(probs, draw), 0.5) for draw in draws]
                for mode, probs in (("raw", raw), ("other", other))}
    for metric in ("accuracy", "log_loss", "ece"):
        for mode in ("raw", "other"):
            values = [m[metric] for m in per_draw[mode]]
            assert out[mode]["interval"][metric] == pytest.approx([percentile(values, 0.025),
                                                                   percentile(values, 0.975)], abs=1e-12)
        diffs = [a[metric] - b[metric] for a, b in zip(per_draw["other"], per_draw["raw"])]
        assert out["other"]["vs_raw"][metric] == pytest.approx([percentile(diffs, 0.025), percentile(diffs, 0.975)],
                                                               abs=1e-12)
        assert out["raw"]["vs_raw"][metric] == [0.0, 0.0]
    lo, hi = out["other"]["interval"]["log_loss"]
    assert lo < evaluation.metrics(list(zip(other, golds)), 0.5)["log_loss"] < hi and hi - lo > 0.05
    # A fixed seed gives the same intervals; another seed other ones.
    assert evaluation.bootstrap({"raw": raw}, golds, groups, resamples=resamples, seed=seed)["raw"] == out["raw"]
    assert evaluation.bootstrap({"raw": raw}, golds, groups, resamples=resamples, seed=seed + 1)["raw"] != out["raw"]
