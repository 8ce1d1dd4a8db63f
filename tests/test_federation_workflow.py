"""How the workflow wires a federation (dry runs): rounds tell the train stage where they are, the
pooled baseline trains on every site's data with the federation's tokens, and evaluate.intermediate
picks the evaluations of the rounds before the last."""

from __future__ import annotations

from collections import Counter

import pytest

from fedtune.core.options import ConfigError
from fedtune.run.config import build_run_config

from .workflow_harness import demo_config, dry_run, write_config


def federation(tmp_path, federation: dict, **sections):
    config = demo_config(federation=federation, **sections)
    write_config(tmp_path, config)
    return dry_run(tmp_path)


def test_each_round_tells_train_where_it_is_and_the_pooled_model_gets_the_federations_tokens(tmp_path):
    jobs = federation(
        tmp_path,
        {"rounds": 3, "pooled_baseline": True, "lr_schedule": "restart"},
        evaluate={"intermediate": "aggregate"},
    )
    trains = {
        (job.wildcards.get("round"), job.wildcards.get("site")): job for job in jobs if job.name == "train"
    }
    assert len(trains) == 6
    assert "--round 2 " in trains[("2", "beta")].shell and "--rounds" not in trains[("2", "beta")].shell
    assert '"rounds":3,"lr_schedule":"restart"' in trains[("2", "beta")].shell
    assert "round-1/aggregate/model" in trains[("2", "beta")].shell.split("--init ")[1].split()[0]
    assert "--optimizer" not in trains[("2", "beta")].shell
    (pooled,) = [job for job in jobs if job.name == "train_pooled"]
    assert "alpha/manifest.json" in pooled.shell and "beta/manifest.json" in pooled.shell
    steps = demo_config()["train"]["max_steps"]
    # 2 sites x 3 rounds x their steps, all of the same global batch.
    assert f'"max_steps":{2 * 3 * steps}' in pooled.shell
    assert "--round" not in pooled.shell and "model/base" in pooled.shell.split("--init ")[1].split()[0]
    # One training of its own: one round, its own schedule, whatever the federation's.
    assert '"rounds":1,"lr_schedule":"continue"' in pooled.shell
    evaluated = Counter(job.name for job in jobs if job.name.startswith("evaluate"))
    # One job per model, every site's test split in it: rounds 1 and 2 the aggregate; round 3 its 3 models.
    assert evaluated == {"evaluate_round": 2 + 3, "evaluate_pooled": 1, "evaluate_base": 1}


def test_kept_site_optimizers_pass_from_round_to_round(tmp_path):
    jobs = federation(tmp_path, {"rounds": 2, "site_optimizer": "keep"})
    trains = {
        (job.wildcards["round"], job.wildcards["site"]): job.shell for job in jobs if job.name == "train"
    }
    assert "--optimizer-out" in trains[("1", "alpha")] and "--optimizer-in" not in trains[("1", "alpha")]
    incoming = trains[("2", "alpha")].split("--optimizer-in ")[1].split()[0]
    assert incoming.endswith("round-1/alpha/optimizer")


@pytest.mark.parametrize(("rows", "flag"), [("counts", False), ("weights", True)])
def test_token_counts_stay_home_unless_the_merge_reads_them(tmp_path, rows, flag):
    """aggregate.vocab_rows: weights reads no token counts, so training writes none (the histogram
    would otherwise cross to the aggregating cluster with the model)."""
    jobs = federation(tmp_path, {"rounds": 2}, aggregate={"vocab_rows": rows})
    trains = [job.shell for job in jobs if job.name == "train"]
    assert len(trains) == 4 and all(('"token_counts":false' in shell) == flag for shell in trains)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: c.update(
                federation={"site_optimizer": "keep"}, train={**c["train"], "backend": "deepspeed"}
            ),
            "federation.site_optimizer: keep needs backend fsdp",
        ),
        (
            lambda c: (
                c["sites"]["beta"].update(cluster="karolina"),
                c.update(federation={"pooled_baseline": True}),
            ),
            "federation.pooled_baseline: needs every site's training data on one cluster",
        ),
        (
            lambda c: c["train"].update(backend="deepspeed", zero_stage=2, fedprox_mu=0.1),
            "sites.alpha.train.fedprox_mu: needs backend fsdp or deepspeed with zero_stage 3",
        ),
        (
            lambda c: c.update(federation={"lr_schedule": "cyclic"}),
            "federation.lr_schedule: 'cyclic' is not one of",
        ),
    ],
    ids=["keep-deepspeed", "pooled-two-clusters", "fedprox-zero2", "lr-schedule"],
)
def test_federation_settings_that_cannot_work_are_refused_by_name(edit, message):
    config = demo_config()
    edit(config)
    with pytest.raises(ConfigError) as error:
        build_run_config(config, source="my.yaml")
    assert message in str(error.value), error.value
