"""Issue 51's product features: the synchronous data-parallel pooled yardstick (federation.pooled_sync)
and the report's gap against it; the recipes that should close the gap: DiLoCo's outer Nesterov step
(aggregate.server_optimizer nesterov), kept site optimizers with it (federation.site_optimizer keep), a
warmup at each round's start (train.round_warmup_steps) and steps in proportion to a site's tokens
(federation.site_steps)."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedtune.aggregate.merge import AggregateJob, aggregate
from fedtune.core.options import ConfigError
from fedtune.core.participation import site_step_counts
from fedtune.report.build import (
    BEST_OF_SWEEP,
    SYNC_BEST_OF_SWEEP,
    SYNC_CAPTION,
    SYNC_YOUR_SETTINGS,
    YOUR_SETTINGS,
    ReportJob,
    report,
)
from fedtune.run.config import build_run_config
from fedtune.train.loop import RoundPlan
from fedtune.train.options import TrainOptions

from .test_aggregate import options as aggregate_options
from .test_aggregate import read_output, write_checkpoint
from .test_yardstick import four_sites, write_eval

pytest_plugins = ["tests.train_fixtures"]

DILOCO = {"name": "nesterov", "lr": 0.7, "momentum": 0.9}

# ---------------------------------------------------------------------------------------------------
# The outer Nesterov step (aggregate.server_optimizer nesterov)


def test_the_outer_nesterov_step_is_torch_sgd_with_nesterov_on_the_pseudo_gradient(tmp_path):
    """Two rounds of the streamed merge with nesterov (DiLoCo's lr 0.7, momentum 0.9) equal
    torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True) stepping the global model with the gradient
    start - mean, its momentum buffer kept across the rounds as the server state."""
    shapes = {"model.layers.0.mlp.up_proj.weight": (12, 8), "model.norm.weight": (8,)}
    g = torch.Generator().manual_seed(5)
    base = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    params = {n: torch.nn.Parameter(t.double().clone()) for n, t in base.items()}
    outer = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    start, state_in = write_checkpoint(tmp_path / "base", base), None
    for r in (1, 2):
        current = read_output(start)
        sites = [{n: t + 0.05 * torch.randn(*t.shape, generator=g) for n, t in current.items()} for _ in "ab"]
        models = {s: write_checkpoint(tmp_path / f"r{r}-{s}", t) for s, t in zip("ab", sites, strict=True)}
        out, state_out = tmp_path / f"round-{r}" / "model", tmp_path / f"round-{r}" / "state"
        options = aggregate_options(weights={"a": 1, "b": 3}, server_optimizer=dict(DILOCO))
        aggregate(
            AggregateJob(models, out, start=start, server_state_in=state_in, server_state_out=state_out),
            options,
        )
        outer.zero_grad()
        for n, p in params.items():
            mean = 0.25 * sites[0][n].double() + 0.75 * sites[1][n].double()
            p.grad = current[n].double() - mean  # the pseudo-gradient start - mean
        outer.step()
        merged = read_output(out)
        for n, p in params.items():
            torch.testing.assert_close(merged[n].double(), p.detach(), rtol=1e-6, atol=1e-6)
            momentum = outer.state[p]["momentum_buffer"]  # torch's buffer is -m (m sums the deltas)
            torch.testing.assert_close(
                read_output(state_out)[f"m.{n}"].double(), -momentum, rtol=1e-6, atol=1e-7
            )
        # Not heavy-ball: fedavgm would have stepped lr * m, without the look-ahead delta term.
        assert json.loads((state_out / "state.json").read_text())["optimizer"]["name"] == "nesterov"
        start, state_in = out, state_out


def test_nesterov_steps_adapters_exactly_and_refuses_averaged_factors():
    """With train.adapter the outer step runs on the exact low-rank update (the round's factors
    stacked with the momentum's: tests/test_adapter_aggregate.py checks the figures); average_factors,
    which is not the sites' mean update, is refused for it by name."""
    config = four_sites(rounds=2)
    config["train"]["adapter"] = {"r": 4}
    config["aggregate"] = {"server_optimizer": dict(DILOCO), "adapter_merge": "exact"}
    assert build_run_config(config).aggregate.server_optimizer.name == "nesterov"
    config["aggregate"]["adapter_merge"] = "average_factors"
    with pytest.raises(ConfigError, match="nesterov with train.adapter needs aggregate.adapter_merge: exact"):
        build_run_config(config)
    # DiLoCo's kept site optimizers are not: a round's adapter is new, with no moments of its own to keep.
    config["aggregate"]["adapter_merge"] = "exact"
    config["federation"]["site_optimizer"] = "keep"
    with pytest.raises(ConfigError, match="site_optimizer: keep; with train.adapter .* no optimizer state"):
        build_run_config(config)


# ---------------------------------------------------------------------------------------------------
# Kept site optimizers with the outer step: a real two-round run


@pytest.mark.slow
def test_kept_site_optimizers_and_the_outer_step_run_two_rounds(tiny_model_dir, site_manifest, tmp_path):
    """DiLoCo as the product runs it: two sites, two rounds, each round's AdamW state carried into the
    site's next round (--optimizer-in/--optimizer-out, federation.site_optimizer keep) and the rounds
    merged by nesterov with its state. The second round starts from the outer step's model with the
    kept moments, and the kept state is Adam's two fp32 moments: 8 bytes a parameter (the disk cost
    docs/federation.md gives for a 7B model)."""
    from tests.train_runs import REFERENCE_OPTIONS, run_training, weights

    options = REFERENCE_OPTIONS | {"max_steps": 2, "rounds": 2, "checkpoint_every": 0}
    start, state = tiny_model_dir, None
    for r in (1, 2):
        models = {}
        for i, site in enumerate(("a", "b")):
            folder = tmp_path / f"round-{r}" / site
            extra = ["--round", str(r), "--optimizer-out", str(folder / "optimizer")]
            if r == 2:
                extra += ["--optimizer-in", str(tmp_path / "round-1" / site / "optimizer")]
            run_training(start, site_manifest, folder, options | {"seed": 7 + i}, extra=extra)
            summary = json.loads((folder / "model" / "training.json").read_text())
            assert summary["optimizer_state"] == ("kept" if r == 2 else "new")
            assert (summary["round"], summary["first_step"]) == (r, 2 * (r - 1))
            models[site] = folder / "model"
        out, state_out = tmp_path / f"round-{r}" / "aggregate", tmp_path / f"round-{r}" / "server_state"
        aggregate(
            AggregateJob(models, out, start=start, server_state_in=state, server_state_out=state_out),
            aggregate_options(weights="uniform", server_optimizer=dict(DILOCO)),
        )
        assert json.loads((state_out / "state.json").read_text())["step"] == r
        start, state = out, state_out
    # What a round keeps per site: AdamW's exp_avg and exp_avg_sq, fp32, for every parameter (8 bytes a
    # parameter) and its step count; on disk that plus torch.distributed.checkpoint's framing.
    from torch.distributed.checkpoint import FileSystemReader

    kept = tmp_path / "round-1" / "a" / "optimizer"
    meta = FileSystemReader(str(kept)).read_metadata().state_dict_metadata
    moments = [v for k, v in meta.items() if k.endswith((".exp_avg", ".exp_avg_sq"))]
    assert {v.properties.dtype for v in moments} == {torch.float32}
    params = sum(t.numel() for t in weights(tiny_model_dir).values())
    assert sum(math.prod(v.size) * 4 for v in moments) == 8 * params
    on_disk = sum(f.stat().st_size for f in kept.rglob("*") if f.is_file())
    assert 8 * params <= on_disk < 12 * params, (on_disk, params)  # framing: much of a tiny model


# ---------------------------------------------------------------------------------------------------
# A warmup at each round's start (train.round_warmup_steps)


def test_each_round_ramps_its_first_steps():
    """With round_warmup_steps 3, a round's steps 0, 1, 2 train at 1/4, 2/4, 3/4 of the schedule's rate,
    in every round, with the schedule continuing over the rounds; 0 (the default) is the schedule."""
    plain = TrainOptions.from_mapping({"lr": 1.0, "warmup_steps": 2, "schedule": "cosine"})
    assert plain.round_warmup_steps == 0
    ramped = TrainOptions.from_mapping({"lr": 1.0, "warmup_steps": 2, "round_warmup_steps": 3})
    for r in (1, 2, 3):
        plan = RoundPlan(r, 3)
        rates = [plan.learning_rate(k, 6, ramped) for k in range(6)]
        scheduled = [plan.learning_rate(k, 6, plain) for k in range(6)]
        assert rates[:3] == pytest.approx([scheduled[k] * (k + 1) / 4 for k in range(3)])
        assert rates[3:] == scheduled[3:]
        assert rates[0] < rates[1] < rates[2]
    one_run = [RoundPlan(1, 1).learning_rate(k, 18, plain) for k in range(18)]
    assert [RoundPlan(r, 3).learning_rate(k, 6, plain) for r in (1, 2, 3) for k in range(6)] == one_run


def test_the_pooled_baseline_takes_no_round_warmup():
    config = four_sites(pooled_baseline=True)
    config["train"]["round_warmup_steps"] = 2
    run = build_run_config(config)
    assert all(site.train.round_warmup_steps == 2 for site in run.sites.values())
    assert run.pooled.round_warmup_steps == 0


# ---------------------------------------------------------------------------------------------------
# Steps in proportion to a site's tokens (federation.site_steps)


def test_token_steps_share_the_rounds_steps_by_tokens():
    # ref-fr (270 docs) + code (54 docs) at 12 steps a site: 20 and 4, 24 in all.
    assert site_step_counts(12, {"fr": 270, "code": 54}) == {"fr": 20, "code": 4}
    assert site_step_counts(4, {"a": 1, "b": 1}) == {"a": 4, "b": 4}
    # Largest remainders, and at least one step a site, taken from the site with the most.
    counts = site_step_counts(6, {"a": 1, "b": 1000, "c": 5})
    assert counts == {"a": 1, "b": 16, "c": 1} and sum(counts.values()) == 18
    for tokens in ({"a": 3, "b": 7, "c": 11}, {"a": 1, "b": 2}, {"a": 5, "b": 5, "c": 5, "d": 1}):
        assert sum(site_step_counts(7, tokens).values()) == 7 * len(tokens)


def test_the_run_plans_each_sites_steps_by_its_tokens():
    config = four_sites(site_steps="tokens")
    run = build_run_config(config)
    steps = next(iter(run.sites.values())).train.max_steps
    planned = run.token_steps({"alpha": 600, "beta": 200, "gamma": 100, "delta": 100})
    assert {s: o.max_steps for s, o in planned.items()} == site_step_counts(
        steps, {"alpha": 600, "beta": 200, "gamma": 100, "delta": 100}
    )
    assert sum(o.max_steps for o in planned.values()) == 4 * steps
    assert planned["alpha"].max_steps > planned["beta"].max_steps > planned["gamma"].max_steps
    # equal (the default): every site its own max_steps, whatever the tokens
    equal = build_run_config(four_sites())
    assert {o.max_steps for o in equal.token_steps(dict.fromkeys(SITES, 1)).values()} == {steps}


def test_a_train_job_takes_its_share_of_the_steps_from_every_sites_manifest(tmp_path):
    """The train stage's --token-steps (what the workflow passes with site_steps tokens): the same
    shares as RunConfig.token_steps, from the manifests' tokens_kept, recorded for training.json."""
    from fedtune.train.loop import token_steps

    tokens = {"alpha": 600, "beta": 200, "gamma": 100, "delta": 100}
    pairs = []
    for site, kept in tokens.items():
        path = tmp_path / site / "manifest.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"site": site, "splits": {"train": {"tokens_kept": kept}}}))
        pairs.append(f"{site}={path}")
    run = build_run_config(four_sites(site_steps="tokens"))
    planned = run.token_steps(tokens)
    for site in SITES:
        options, shares = token_steps(site, pairs, run.sites[site].train)
        assert options.max_steps == planned[site].max_steps
        assert shares == {"by": "tokens", "tokens": tokens, "steps": site_step_counts(10, tokens)}
    same, none = token_steps("alpha", [], run.sites["alpha"].train)
    assert same is run.sites["alpha"].train and none is None
    with pytest.raises(ConfigError, match="no manifest of site omega"):
        token_steps("omega", pairs, run.sites["alpha"].train)
    with pytest.raises(
        ConfigError, match=r"site alpha: manifest \S+beta/manifest.json belongs to site 'beta'"
    ):
        token_steps("alpha", [f"alpha={tmp_path / 'beta' / 'manifest.json'}"], run.sites["alpha"].train)
    # The merge's checks of a manifest that crossed (tokenize.blocks.manifest_tokens): a count no site
    # could have trained on shares out no steps.
    (tmp_path / "delta" / "manifest.json").write_text(
        json.dumps({"site": "delta", "splits": {"train": {"tokens_kept": -900, "tokens": 1000}}})
    )
    with pytest.raises(
        ConfigError, match="site delta: .*tokens_kept is -900; a site's token count must be positive"
    ):
        token_steps("alpha", pairs, run.sites["alpha"].train)


SITES = ["alpha", "beta", "gamma", "delta"]


@pytest.mark.parametrize(
    ("federation", "site_train", "message"),
    [
        ({"participation": 2}, {}, "participation"),
        ({}, {"max_steps": 3}, "same max_steps"),
        ({}, {"cluster": "elsewhere"}, "manifests cross only to federation.aggregate_on"),
    ],
)
def test_token_steps_refuse_what_they_cannot_share(federation, site_train, message):
    config = four_sites(site_steps="tokens", **federation)
    if "cluster" in site_train:
        config["sites"]["alpha"]["cluster"] = site_train.pop("cluster")
    config["sites"]["alpha"].setdefault("train", {}).update(site_train)
    with pytest.raises(ConfigError, match=message):
        build_run_config(config)


# ---------------------------------------------------------------------------------------------------
# The synchronous data-parallel pooled model (federation.pooled_sync)


def test_the_sync_pooled_model_takes_m_times_the_batch_for_a_sites_steps():
    """Four sites of S steps at batch B over R rounds: the serial pooled model trains 4RS steps of B
    blocks; the synchronous one RS steps of 4B blocks (4x the accumulation, the same micro batch): the
    same tokens, a site's number of sequential steps. One per point of the pooled sweep."""
    run = build_run_config(four_sites(pooled_baseline=True, pooled_sync=True, pooled_lr_factors=[1, 2]))
    site = run.sites["alpha"].train
    serial = run.pooled
    sync = {p.label: p for p in run.pooled_points if p.label.startswith("pooled-sync-")}
    assert set(sync) == {"pooled-sync-lr1x", "pooled-sync-lr2x"}
    one = sync["pooled-sync-lr1x"].options
    assert serial.max_steps == 4 * 2 * site.max_steps and serial.global_batch == site.global_batch
    assert one.max_steps == 2 * site.max_steps and one.global_batch == 4 * site.global_batch
    assert one.micro_batch == serial.micro_batch
    assert one.max_steps * one.global_batch == serial.max_steps * serial.global_batch
    assert (one.lr, sync["pooled-sync-lr2x"].options.lr) == (serial.lr, 2 * serial.lr)
    # The serial sweep is as before: pooled-lr2x beside pooled/model.
    assert [p.label for p in run.pooled_points] == ["pooled-lr2x", "pooled-sync-lr1x", "pooled-sync-lr2x"]
    # The default: the serial model only, as before.
    assert build_run_config(four_sites(pooled_baseline=True)).pooled_points == ()
    with pytest.raises(ConfigError, match="pooled_sync: true needs federation.pooled_baseline"):
        build_run_config(four_sites(pooled_sync=True))


def test_the_workflow_trains_and_scores_the_sync_pooled_model(tmp_path):
    """A dry run with pooled_sync: the synchronous pooled model is one more pooled model of the sweep's
    rules (pooled/sweep/pooled-sync-lr1x), trained with M times the batch for a site's steps, scored on
    every site and handed to the report with its lr."""
    from .workflow_harness import dry_run, write_config

    config = four_sites(pooled_baseline=True, pooled_sync=True)
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path)
    run = build_run_config(four_sites(pooled_baseline=True, pooled_sync=True))
    sync = run.pooled_points[0].options
    trained = [j for j in jobs if j.name == "train_pooled_sweep"]
    assert [j.wildcards["point"] for j in trained] == ["pooled-sync-lr1x"]
    options = json.loads(shlex.split(trained[0].shell.split("--options", 1)[1])[0])
    assert (options["global_batch"], options["max_steps"]) == (sync.global_batch, sync.max_steps)
    scored = {j.wildcards["point"] for j in jobs if j.name == "evaluate_pooled_sweep"}
    assert scored == {"pooled-sync-lr1x"}
    assert "pooled-sync-lr1x=" in next(j.shell for j in jobs if j.name == "report")


def test_the_workflow_plans_steps_by_tokens_from_every_sites_manifest(tmp_path):
    """A dry run with site_steps tokens: every round's training reads every site's manifest
    (--token-steps, and the manifests are its inputs); the pooled models and their steps are unchanged."""
    from .workflow_harness import dry_run, write_config

    write_config(tmp_path, four_sites(site_steps="tokens", pooled_baseline=True))
    jobs = dry_run(tmp_path)
    trains = [j for j in jobs if j.name == "train"]
    assert len(trains) == 2 * len(SITES)
    for job in trains:
        words = shlex.split(job.shell.split("--token-steps ", 1)[1])
        pairs = words[: next(i for i, w in enumerate(words) if w.startswith("--") or w == ">>")]
        assert [p.split("=")[0] for p in pairs] == SITES
        assert all(p.split("=", 1)[1].endswith(f"data/{p.split('=')[0]}/manifest.json") for p in pairs)
    (pooled,) = [j for j in jobs if j.name == "train_pooled"]
    assert "--token-steps" not in pooled.shell
    plain = tmp_path / "plain"
    plain.mkdir()
    write_config(plain, four_sites(pooled_baseline=True))
    assert not any("--token-steps" in j.shell for j in dry_run(plain))


@pytest.mark.slow
def test_a_run_with_steps_by_tokens_trains_each_site_its_share(tmp_path):
    """The real workflow, two rounds on unequal sites (alpha 3 times beta's documents): each round's
    site models train their share of 2 x 4 steps by tokens (about 6 and 2), the same every round, and
    the report's training table gives those steps and says why."""
    from .workflow_harness import demo_config, snakemake, write_config

    config = demo_config()
    for site, documents in (("alpha", 240), ("beta", 80)):
        config["sites"][site]["dataset"]["max_documents"] = documents
    config["tokenize"]["shards"] = 1
    config["train"].update(max_steps=4, warmup_steps=1, checkpoint_every=0, micro_batch=8)
    config["federation"] = {"rounds": 2, "site_steps": "tokens"}
    config["aggregate"] = {"server_optimizer": {"name": "sgd", "lr": 1.0}}
    config["evaluate"]["intermediate"] = "none"
    write_config(tmp_path, config)
    snakemake(tmp_path, "results/demo/report/training.csv")
    run = tmp_path / "results" / "demo"
    tokens = {
        s: json.loads((run / "data" / s / "manifest.json").read_text())["splits"]["train"]["tokens_kept"]
        for s in ("alpha", "beta")
    }
    expected = site_step_counts(4, tokens)
    assert expected["alpha"] > expected["beta"] and sum(expected.values()) == 8
    for r in (1, 2):
        for site in ("alpha", "beta"):
            trained = json.loads((run / f"round-{r}" / site / "model" / "training.json").read_text())
            assert trained["steps"] == trained["options"]["max_steps"] == expected[site]
            assert trained["first_step"] == (r - 1) * expected[site]
            assert trained["site_steps"] == {"by": "tokens", "tokens": tokens, "steps": expected}
    table = pd.read_csv(run / "report" / "training.csv")
    steps = {
        (int(r), s): int(n) for r, s, n in zip(table["round"], table["site"], table["steps"], strict=True)
    }
    assert steps == {(r, s): expected[s] for r in (1, 2) for s in ("alpha", "beta")}
    assert "federation.site_steps tokens" in (run / "report" / "training.md").read_text()


def test_the_gap_table_gives_both_yardsticks(tmp_path):
    """With the synchronous pooled models, gap.md measures every merged model against the serial
    yardsticks (the sync models left out of the serial sweep's best) and against the synchronous ones,
    and says in one sentence each what they mean."""
    evals = write_eval(tmp_path, "aggregate", 1, {"alpha": 30.0, "beta": 60.0})
    evals += write_eval(tmp_path, "pooled", 1, {"alpha": 40.0, "beta": 80.0})
    evals += write_eval(tmp_path, "pooled-lr2x", 1, {"alpha": 25.0, "beta": 50.0})
    evals += write_eval(tmp_path, "pooled-sync-lr1x", 1, {"alpha": 24.0, "beta": 48.0})
    evals += write_eval(tmp_path, "pooled-sync-lr2x", 1, {"alpha": 20.0, "beta": 40.0})  # best of all
    points = {
        "pooled": (0.003, 1.0),
        "pooled-lr2x": (0.006, 1.0),
        "pooled-sync-lr1x": (0.003, 1.0),
        "pooled-sync-lr2x": (0.006, 1.0),
    }
    paths = report(ReportJob(tmp_path / "out", evals, pooled_points=points))
    gap = pd.read_csv(paths["gap_csv"])
    assert list(gap["yardstick"]) == [YOUR_SETTINGS, BEST_OF_SWEEP, SYNC_YOUR_SETTINGS, SYNC_BEST_OF_SWEEP]
    assert list(gap["pooled_model"]) == ["pooled", "pooled-lr2x", "pooled-sync-lr1x", "pooled-sync-lr2x"]
    assert list(gap["alpha"]) == pytest.approx([0.75, 1.2, 1.25, 1.5])
    assert set(gap["model"]) == {"aggregate"}
    text = paths["gap_md"].read_text()
    assert SYNC_CAPTION in text and "synchronous data-parallel" in text and "serial" in text
    # Without them, gap.md says what it said before.
    plain = write_eval(tmp_path, "aggregate", 1, {"alpha": 30.0, "beta": 60.0})
    plain += write_eval(tmp_path, "pooled", 1, {"alpha": 40.0, "beta": 80.0})
    text = report(ReportJob(tmp_path / "plain", plain))["gap_md"].read_text()
    assert SYNC_CAPTION not in text and "synchronous" not in text


# ---------------------------------------------------------------------------------------------------
# The benchmark reaches the settings (benchmarks/federation_yardstick.py)


def test_the_benchmark_builds_the_arms_on_the_products_settings(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import federation_yardstick as bench

    recipe = {"round_warmup_steps": 2, "site_steps": "tokens", "pooled_sync": True}
    config = bench.cell_config(["a", "b"], tmp_path, 4, 3, 0, "diloco-olr0.7", recipe=recipe)
    assert config["aggregate"]["server_optimizer"] == DILOCO
    assert config["federation"]["site_optimizer"] == "keep" and config["federation"]["site_steps"] == "tokens"
    assert config["federation"]["pooled_sync"] and config["train"]["round_warmup_steps"] == 2
    plain = bench.cell_config(["a", "b"], tmp_path, 4, 3, 0, "fedavg")
    assert "site_steps" not in plain["federation"] and "round_warmup_steps" not in plain["train"]
    assert plain["federation"].get("site_optimizer", "reset") == "reset"
    assert bench.STRATEGIES["fedavg-keep"]["_federation"] == {"site_optimizer": "keep"}
