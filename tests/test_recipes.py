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

from fedtune.aggregate.merge import aggregate
from fedtune.core.config import (
    ConfigError,
    TrainOptions,
    build_run_config,
    site_step_counts,
    site_steps_problem,
)
from fedtune.report.build import (
    BEST_OF_SWEEP,
    SYNC_BEST_OF_SWEEP,
    SYNC_CAPTION,
    SYNC_YOUR_SETTINGS,
    YOUR_SETTINGS,
    report,
)
from fedtune.train.loop import RoundPlan

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
        aggregate(models, out, options, start=start, server_state_in=state_in, server_state_out=state_out)
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


def test_nesterov_is_refused_with_adapters():
    config = four_sites(rounds=2)
    config["train"]["adapter"] = {"r": 4}
    config["aggregate"] = {"server_optimizer": dict(DILOCO), "adapter_merge": "exact"}
    with pytest.raises(ConfigError, match="nesterov"):
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
            models,
            out,
            aggregate_options(weights="uniform", server_optimizer=dict(DILOCO)),
            start=start,
            server_state_in=state,
            server_state_out=state_out,
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
    # The workflow plans a train job's steps before the tokens are counted: refused there, for now.
    assert site_steps_problem(equal, "c") is None
    assert "site_steps: tokens" in site_steps_problem(run, "c")


SITES = ["alpha", "beta", "gamma", "delta"]


@pytest.mark.parametrize(
    ("federation", "site_train", "message"),
    [
        ({"participation": 2}, {}, "participation"),
        ({}, {"max_steps": 3}, "same max_steps"),
    ],
)
def test_token_steps_refuse_what_they_cannot_share(federation, site_train, message):
    config = four_sites(site_steps="tokens", **federation)
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
    every site and handed to the report with its lr; site_steps tokens is refused with its reason."""
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
    write_config(tmp_path, four_sites(site_steps="tokens"))
    with pytest.raises(AssertionError, match="site_steps: tokens is not yet planned"):
        dry_run(tmp_path)


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
    paths = report(tmp_path / "out", evals, pooled_points=points)
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
    text = report(tmp_path / "plain", plain)["gap_md"].read_text()
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
