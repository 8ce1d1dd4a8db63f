"""Evaluation where the data lives (evaluate.cross_site none): each site's text is scored on its own
cluster, the last round's aggregate travels there for it, and only the scores come back, one JSON per
(model, site), marked complete with its sha256 as models are; a corrupted score is refused naming it.
The two-controller run is in tests/test_multicluster.py, the dry runs in tests/test_data_stays.py and
tests/test_plan.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fedtune.core.transfer import mark
from fedtune.run import scoring
from fedtune.run.config import build_run_config
from fedtune.run.crossings import crossing_items, score_crossings

from .test_data_stays import two_clusters


def leo(cross_site=None, compare=()):
    config = two_clusters(private=(), aggregate_on="leo", rounds=2)
    config["cluster"] = "leo"
    config["aggregate"] = {"compare": list(compare)}
    config["evaluate"] = {"intermediate": "aggregate"}
    if cross_site:
        config["evaluate"]["cross_site"] = cross_site
    return build_run_config(config)


def test_each_site_is_scored_at_home_and_only_the_scores_and_the_last_aggregate_cross():
    run = leo(compare=["ties"])
    assert scoring.scoring_cluster(run, "alpha") == "leo" and scoring.scoring_cluster(run, "beta") == "karo"
    assert scoring.scored_sites(run, "beta") == ["beta"]  # a site's model on its own text only
    assert scoring.scored_sites(run, "aggregate") == ["alpha", "beta"]
    assert scoring.scored_sites(run, "ties") == ["alpha"]  # made on leo, scored on leo's sites' text
    items = {(c.item, c.maker, c.receiver) for c in crossing_items(run)}
    # Both rounds' aggregates go to karo: the next round starts from the first, karo scores both.
    assert {("round-1/aggregate/model", "leo", "karo"), ("round-2/aggregate/model", "leo", "karo")} <= items
    scores = [(c.item, c.maker, c.receiver, c.round) for c in score_crossings(run)]
    assert scores == [
        ("eval/base/beta.json", "karo", "leo", 0),
        # Made by beta's training of round 2 before it trains, in the same Slurm job.
        ("round-2/beta/before/aggregate.json", "karo", "leo", 1),
        ("round-2/eval/beta/beta.json", "karo", "leo", 2),
        ("round-2/eval/aggregate/beta.json", "karo", "leo", 2),
    ]
    # Every score the report reads, wherever it is made: the matrix's cells (site models on their own text).
    assert "round-2/eval/alpha/beta.json" not in scoring.score_paths(run)
    assert "round-2/eval/ties/alpha.json" in scoring.score_paths(run)


def test_where_the_models_do_not_meet_the_next_training_scores_the_round_unless_sites_skip_rounds():
    """The aggregate and the site's own model of each round but the last are scored by the site's next
    training job (one Slurm job per site and round); with intermediate none nothing before the last round
    is scored; with federation.participation a site may not train next round, so evaluation jobs do it."""

    def run_with(**changes):
        config = two_clusters(private=(), aggregate_on="leo", rounds=2)
        config["cluster"] = "leo"
        config["evaluate"] = {"intermediate": changes.pop("intermediate", "all")}
        config["federation"].update(changes)
        return build_run_config(config)

    run = run_with()
    assert scoring.before_training(run) == ["aggregate", "site"]
    assert scoring.made_at(run, "aggregate", "beta", 1) == "round-2/beta/before/aggregate.json"
    assert scoring.made_at(run, "beta", "beta", 1) == "round-2/beta/before/site.json"
    assert (
        scoring.made_at(run, "aggregate", "beta", 2) == "round-2/eval/aggregate/beta.json"
    )  # the last round
    assert (
        scoring.made_at(run, "aggregate", "alpha", 1) == "round-1/eval/aggregate/alpha.json"
    )  # where they meet
    assert scoring.made_at(run, "base", "beta") == "eval/base/beta.json"
    assert scoring.before_training(run_with(intermediate="aggregate")) == ["aggregate"]
    assert scoring.before_training(run_with(intermediate="none")) == []
    assert scoring.before_training(run_with(participation=1)) == []
    assert not scoring.scored_in_training(run_with(participation=1), "aggregate", "beta", 1)


def test_cross_site_text_to_models_scores_everything_where_the_models_meet():
    run = leo(cross_site="text_to_models")
    assert scoring.scoring_cluster(run, "beta") == "leo"
    assert scoring.scored_sites(run, "alpha") == ["alpha", "beta"]
    assert not score_crossings(run)
    # As before the setting: the last round's aggregate stays where it is made.
    assert "round-2/aggregate/model" not in {c.item for c in crossing_items(run)}


def test_a_corrupted_score_is_refused_naming_the_item(tmp_path):
    """A score JSON whose bytes differ from its maker's sha256 list (here: changed in karo's outbox after
    it was marked) is never taken: the fetch names the score and the item, and leaves nothing behind."""
    run = leo()
    crossing = next(c for c in score_crossings(run) if c.item == "round-2/beta/before/aggregate.json")
    karo = tmp_path / "karo" / "results" / "demo"
    score = karo / crossing.item
    score.parent.mkdir(parents=True)
    score.write_text(json.dumps({"model": "aggregate", "site": "beta", "round": 1, "perplexity": 41.25}))
    outbox = karo / "exchange" / "outbox" / crossing.item
    mark(score, outbox)
    published = json.loads(outbox.read_text())
    outbox.unlink()  # (a hard link: a new file, so that karo's own copy stays as it was)
    outbox.write_text(json.dumps({**published, "perplexity": 14.25}))
    out = tmp_path / "leo" / "results" / "demo" / crossing.item
    result = subprocess.run(
        [sys.executable, "-m", "fedtune.core.transfer", "fetch", "--source", str(outbox), "--out", str(out),
         "--wait", "2s", "--round", str(crossing.round), "--remote", crossing.maker, "--what", crossing.what,
         "--check", "On karo: did its evaluation job fail?"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert (
        "the score of aggregate on beta's text (round-2/beta/before/aggregate.json) of round 1 from karo: the "
        "copy failed verification 3 times (aggregate.json: sha256 differs from the marker's); deleted."
    ) in result.stderr
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name != ".gitkeep"]
