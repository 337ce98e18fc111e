"""Order debiasing, contextual calibration, regularised fits, profiles, and ``decisiond eval`` / ``calibrate``."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import openai
import pytest
from servers import run_decisiond
from typesafe_sdk import Choice, RetryPolicy, TypeSafeClient, TypeSafeUnprocessableEntityError

from decisiond import evaluation
from decisiond.canonical import DecisionRequest, Message, Option, Question, Text
from decisiond.engine.calibration import CONTENT_FREE, Fit, Profile, Sample, VariantEvidence, combine, fit
from decisiond.engine.local import LocalEngine
from decisiond.engine.prompt import PROMPT_FORMAT_VERSION, labels_for, render_question
from decisiond.probability import label_probabilities

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "tickets.jsonl"
OPTIONS = ("billing", "technical", "account", "sales")


def choice(options=OPTIONS):
    return Question("choice", "team", (Text("Which team should handle this ticket?"),),
                    options=tuple(Option(o, "handles " + o) for o in options))


def request(*questions, text="I was charged twice for one invoice.", **kw):
    return DecisionRequest((Message("user", (Text(text),)),), tuple(questions), **kw)


def test_cyclic_order_is_the_mean_of_explicitly_reordered_requests(tiny_engine):
    cyclic = tiny_engine.decide(request(choice(), order="cyclic")).answers[0]
    per_shift = []
    for k in range(4):
        shifted = OPTIONS[k:] + OPTIONS[:k]
        answer = tiny_engine.decide(request(choice(shifted))).answers[0]
        by_name = dict(zip(shifted, answer.probabilities))
        per_shift.append([by_name[o] for o in OPTIONS])
    mean = [sum(p[i] for p in per_shift) / 4 for i in range(4)]
    assert cyclic.probabilities == pytest.approx(mean, abs=1e-5)
    spread = max(max(p[i] for p in per_shift) - min(p[i] for p in per_shift) for i in range(4))
    assert cyclic.extensions["order_spread"] == pytest.approx(spread, abs=1e-5) and spread > 0.01
    # Other question types have no order to shift.
    yes_no = Question("yes_no", "u", (Text("It is urgent."),))
    assert tiny_engine.decide(request(yes_no, order="cyclic")).answers[0].extensions == {}


def test_contextual_calibration_equals_the_hand_computation(tiny_engine):
    q = choice()
    answer = tiny_engine.decide(request(q, calibrate="contextual")).answers[0]
    kwargs = tiny_engine.prompter.template_kwargs({})
    labels = labels_for(q)

    def lps(text):
        prompt = tiny_engine.prompter.encode(render_question(text, q, labels), labels, kwargs)
        return tiny_engine.scorer.reference(prompt.ids, prompt.label_ids)

    priors = [label_probabilities(lps(free)) for free in CONTENT_FREE]
    prior = [sum(p[i] for p in priors) / len(priors) for i in range(4)]
    raw = lps("I was charged twice for one invoice.")
    corrected = [math.exp(z) / p for z, p in zip(raw, prior)]
    expected = [c / sum(corrected) for c in corrected]
    assert answer.probabilities == pytest.approx(expected, abs=1e-5)
    assert answer.label_mass == pytest.approx(sum(math.exp(z) for z in raw), rel=1e-5)  # raw mass, unchanged
    # The prior is cached per rendered question: a second request scores only its own prompt.
    before = tiny_engine.scheduler.stats.prompt_tokens
    tiny_engine.decide(request(q, calibrate="contextual", text="Another ticket."))
    again = tiny_engine.scheduler.stats.prompt_tokens - before
    assert again == len(tiny_engine.prepare(request(q, text="Another ticket.")).questions[0].prompt.ids)


def test_both_modes_together(tiny_engine):
    answer = tiny_engine.decide(request(choice(), order="cyclic", calibrate="contextual")).answers[0]
    prepared, evidence = tiny_engine.evidence(request(choice()), order="cyclic", calibrate="contextual")
    assert answer.probabilities == pytest.approx(combine(evidence[0], contextual=True)[0], abs=1e-6)
    assert len(evidence[0]) == 4 and all(len(v.priors) == 3 for v in evidence[0])


def test_fit_recovers_a_known_temperature_and_bias():
    rng = random.Random(3)
    samples = []
    for _ in range(600):
        z = [rng.gauss(0, 2) for _ in range(4)]
        true = label_probabilities([v + b for v, b in zip(z, [0.8, 0, 0, -0.8])], 2.5)
        gold = rng.choices(range(4), weights=true)[0]
        samples.append(Sample("choice", [VariantEvidence([0, 1, 2, 3], z)], gold))
    fitted = fit(samples, with_bias=True)
    assert fitted.temperature == pytest.approx(2.5, rel=0.2)
    assert fitted.bias[0] - fitted.bias[3] == pytest.approx(1.6, abs=0.6)
    plain = fit(samples)
    assert plain.bias == [] and plain.temperature > 1.2


def test_profile_is_applied_by_the_engine(tiny, tmp_path):
    profile = Profile("tiny-random", PROMPT_FORMAT_VERSION, fits={"choice": Fit(temperature=3.0, bias=[0.5, 0, 0, 0])})
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded == profile
    engine = LocalEngine(tiny, profile=loaded)
    answer = engine.decide(request(choice())).answers[0]
    shifted = [z + b for z, b in zip(answer.label_logprobs, [0.5, 0, 0, 0])]
    assert answer.probabilities == pytest.approx(label_probabilities(shifted, 3.0), abs=1e-9)
    # A request temperature overrides the fitted one; the bias stays.
    explicit = engine.decide(request(choice(), temperature=1.0)).answers[0]
    shifted = [z + b for z, b in zip(explicit.label_logprobs, [0.5, 0, 0, 0])]  # after the cached prefix
    assert explicit.probabilities == pytest.approx(label_probabilities(shifted, 1.0), abs=1e-9)


def test_metrics_by_hand():
    pairs = [([0.7, 0.3], 0), ([0.4, 0.6], 0), ([0.9, 0.1], 0), ([0.2, 0.8], 1)]
    m = evaluation.metrics(pairs, threshold=0.75)
    assert m["accuracy"] == 0.75
    assert m["log_loss"] == pytest.approx(-(math.log(0.7) + math.log(0.4) + math.log(0.9) + math.log(0.8)) / 4)
    assert m["brier"] == pytest.approx((2 * 0.09 + 2 * 0.36 + 2 * 0.01 + 2 * 0.04) / 4)
    # bins: 0.7 (right), 0.6 (wrong), 0.9 (right), 0.8 (right) — each alone in its bin
    assert m["ece"] == pytest.approx((0.3 + 0.6 + 0.1 + 0.2) / 4)
    assert m["answered"] == 0.5 and m["answered_accuracy"] == 1.0
    # The most confident half is 0.9 and 0.8 (both right); three quarters add 0.7 (right); all add 0.6 (wrong).
    assert m["coverage_accuracy"] == 1.0
    assert evaluation.metrics(pairs, 0.5, coverage=0.75)["coverage_accuracy"] == 1.0
    assert evaluation.metrics(pairs, 0.5, coverage=1.0)["coverage_accuracy"] == 0.75
    assert evaluation.metrics([([0.2, 0.8], 0), ([0.6, 0.4], 0)], 0.5, coverage=0.5)["coverage_accuracy"] == 0.0


def test_calibrate_on_the_example_set_never_raises_cross_validated_log_loss(tiny_engine):
    items = evaluation.load(EXAMPLES)
    assert len(items) == 60 and items[0].gold == [0, 1, 0]
    profile, summary = evaluation.calibrate(tiny_engine, items, order="cyclic", calibrate_mode="contextual",
                                            with_bias=True, progress=False, source=str(EXAMPLES))
    assert (profile.order, profile.calibrate, profile.model) == ("cyclic", "contextual", "tiny-random")
    assert set(summary["kinds"]) == {"choice", "score", "yes_no"}
    for kind, row in summary["kinds"].items():
        assert row["questions"] == 60
        assert (kind in profile.fits) == (not row["kept_base"])
        # A fit that does nothing must not pass: on this set every kind's fit beats the base mode under cross-
        # validation by more than the standard error of its gain across folds (choice 1.386 -> 1.381 with T at its
        # 0.2 bound, score 1.119 -> 1.061, yes/no 1.052 -> 0.705 when written), and is kept.
        assert not row["kept_base"], kind
        assert row["cv_log_loss"] == row["cv_log_loss_by_strength"][str(row["strength"])]
        assert row["cv_log_loss"] + row["cv_gain_se"] < row["cv_log_loss_base"]
        assert not profile.fits[kind].identity
    assert summary["kinds"]["yes_no"]["cv_log_loss"] < summary["kinds"]["yes_no"]["cv_log_loss_base"] - 0.2


def test_labeled_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(EXAMPLES.read_text().splitlines()[0] + "\n" + json.dumps(
        {"input": "x", "questions": [{"type": "predicate", "name": "p", "instructions": "?"}], "gold": {"p": "yes"}}))
    with pytest.raises(ValueError, match="bad.jsonl:2: gold.p: must be true or false"):
        evaluation.load(bad)


def test_eval_and_calibrate_auto_end_to_end_on_the_real_model(smollm_dir, tmp_path):
    """A slice of the example set (3 items, 9 questions, every question type) through eval and calibrate --auto; the
    metrics, fits and profiles themselves are tested on the tiny model in test_fits.py."""
    subset = tmp_path / "three.jsonl"
    subset.write_text("\n".join(EXAMPLES.read_text().splitlines()[:3]) + "\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}

    def cli(*args):
        return run_decisiond(*args, env=env)

    done = cli("eval", str(subset), "--out-dir", str(tmp_path), "--resamples", "200", "--coverage", "0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["questions"] == 9 and report["items"] == 3 and set(report["modes"]) == set(evaluation.ALL_MODES)
    for mode in evaluation.ALL_MODES:
        m = report["modes"][mode]["all"]
        assert m["n"] == 9 and 0 <= m["accuracy"] <= 1 and m["log_loss"] > 0 and 0 <= m["ece"] <= 1
        assert m["interval"]["log_loss"][0] <= m["log_loss"] <= m["interval"]["log_loss"][1]
        assert sum(report["modes"][mode][k]["n"] for k in evaluation.KINDS) == 9
        assert sum(r["count"] for r in report["reliability"][mode]) == 9
    assert (tmp_path / "reliability.png").read_bytes().startswith(b"\x89PNG")
    best = report["best_mode"]
    assert f"| **{best}** ★ | 9 |" in done.stdout and done.stdout.count("★") == 3
    assert "scoring" in done.stderr  # the progress bar

    done = cli("calibrate", str(subset), "--auto", "--out", str(tmp_path / "profile.json"), "--resamples", "200")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"best mode by cross-validated log loss: {best}" in done.stdout
    profile = Profile.load(tmp_path / "profile.json")
    assert profile.model == "SmolLM2-135M-Instruct" and profile.prompt_format_version == PROMPT_FORMAT_VERSION
    assert evaluation.mode_name(profile.order, profile.calibrate, bool(profile.fits)) in (best, best.split("+")[0])


def test_extensions_through_the_sdks(server, openai_client):
    def team(options, **extra):
        return openai_client.decisions.create(
            model="default", input="I was charged twice.",
            questions=[{"type": "choice", "name": "team", "instructions": "Which team?",
                        "choices": [{"value": o} for o in options]}],
            extra_body=extra or None).answers[0]

    cyclic = team(OPTIONS, order="cyclic")
    # The spread is checked against the four explicitly rotated requests through the same server, not a range.
    per_shift = []
    for k in range(4):
        shifted = OPTIONS[k:] + OPTIONS[:k]
        by_value = {c.value: c.probability for c in team(shifted).probabilities}
        per_shift.append([by_value[o] for o in OPTIONS])
    spread = max(max(p[i] for p in per_shift) - min(p[i] for p in per_shift) for i in range(4))
    assert cyclic.order_spread == pytest.approx(spread, abs=1e-4) and spread > 0
    assert [c.probability for c in cyclic.probabilities] == pytest.approx(
        [sum(p[i] for p in per_shift) / 4 for i in range(4)], abs=1e-4)
    both = team(OPTIONS, order="cyclic", calibrate="contextual")
    assert both.order_spread is not None and 0 <= both.order_spread <= 1
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.decisions.create(model="default", input="x", questions=[
            {"type": "predicate", "instructions": "?"}], extra_body={"order": "random"})
    assert e.value.param == "order"
    with TypeSafeClient(base_url=server.url, api_key="unused", retry=RetryPolicy(max_retries=0), timeout=60) as ts:
        result = ts.system_one("I was charged twice.", {"team": Choice(criteria={o: None for o in OPTIONS})},
                               extra_body={"order": "cyclic"})
        assert "x_order_spread" in result.raw_http_response.json()["answers"]["team"]
        with pytest.raises(TypeSafeUnprocessableEntityError):
            ts.system_one("x", {"team": Choice(criteria={"a": None})}, extra_body={"calibrate": "always"})
