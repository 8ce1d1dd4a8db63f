"""Issue 39's product features: the pooled yardstick's lr sweep (federation.pooled_lr_factors and
pooled_embedding_lr_factors) and the report's gap against both yardsticks, the embedding/head lr factor
(train.embedding_lr_factor), and partial participation (federation.participation)."""

from __future__ import annotations

import json
import shlex

import pandas as pd
import pytest
import torch

from fedtune.core.options import ConfigError
from fedtune.core.participation import participation_count, sample_participants
from fedtune.report.build import BEST_OF_SWEEP, YOUR_SETTINGS, ReportJob, parse_pooled_point, report
from fedtune.run.config import build_run_config
from fedtune.train.options import TrainOptions

from .test_aggregate import random_tensors, write_checkpoint, write_manifest
from .workflow_harness import demo_config, dry_run, write_config

pytest_plugins = ["tests.train_fixtures"]

SITES = ["alpha", "beta", "gamma", "delta"]


def four_sites(**federation) -> dict:
    """The generated demo with four sites (gamma and delta read alpha's and beta's files)."""
    config = demo_config()
    config["sites"]["gamma"] = json.loads(json.dumps(config["sites"]["alpha"]))
    config["sites"]["delta"] = json.loads(json.dumps(config["sites"]["beta"]))
    config["federation"] = {"rounds": 2, **federation}
    return config


# ---------------------------------------------------------------------------------------------------
# train.embedding_lr_factor


@pytest.mark.parametrize("tied", [False, True])
def test_the_embeddings_and_head_step_at_lr_times_the_factor(tied):
    """AdamW's first step moves every weight by about lr; with the factor 3 the embeddings and the
    head move 3 lr, the rest lr. Tied embeddings are one parameter, stepped once (not 9 lr)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedtune.train.backends import adamw, set_lr

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
        )
    )
    lr = 0.01
    optimizer = adamw(
        model, TrainOptions.from_mapping({"lr": lr, "embedding_lr_factor": 3.0}), torch.device("cpu")
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    set_lr(optimizer.param_groups, lr)
    optimizer.step()
    moved = {name: float((p.detach() - before[name]).abs().max()) for name, p in model.named_parameters()}
    vocab = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    assert set(moved) >= vocab
    for name, step in moved.items():
        assert step == pytest.approx(3 * lr if name in vocab else lr, rel=1e-3), name


def test_the_train_stage_steps_the_embeddings_and_head_further_under_fsdp(
    tiny_model_dir, site_manifest, tmp_path
):
    """Through `python -m fedtune.train` (FSDP2, 2 ranks): one step of Adam moves every weight by
    about the step's lr, so with the factor 4 the embeddings and the untied head move 4 times as far as
    the attention weights."""
    from .train_runs import run_training, weights

    options = {"backend": "fsdp", "sharding": "full", "max_steps": 1, "warmup_steps": 0}
    run_training(tiny_model_dir, site_manifest, tmp_path, options | {"embedding_lr_factor": 4.0})
    start, end = weights(tiny_model_dir), weights(tmp_path / "model")

    def moved(name):
        return float((end[name].double() - start[name].double()).abs().max())

    attention = moved("model.layers.0.self_attn.q_proj.weight")
    assert moved("model.embed_tokens.weight") == pytest.approx(4 * attention, rel=0.02)
    assert moved("lm_head.weight") == pytest.approx(4 * attention, rel=0.02)


def test_one_lr_for_all_by_default():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedtune.train.backends import parameter_groups

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
        )
    )
    groups = parameter_groups(model, TrainOptions.from_mapping({}))
    assert len(groups) == 1 and groups[0]["lr_factor"] == 1.0


# ---------------------------------------------------------------------------------------------------
# The pooled model's lr sweep


def test_the_pooled_sweep_crosses_lr_and_embedding_factors_beside_your_settings():
    config = four_sites(pooled_baseline=True, pooled_lr_factors=[1, 2, 4], pooled_embedding_lr_factors=[1, 2])
    run = build_run_config(config)
    lr = config["train"]["lr"]
    assert run.pooled.lr == lr and run.pooled.embedding_lr_factor == 1
    points = {p.label: (p.lr, p.embedding_lr_factor) for p in run.pooled_points}
    # (1, 1) is the pooled model at your settings (pooled/model), not a second copy of it.
    assert points == {
        "pooled-lr1x-emb2x": (lr, 2.0),
        "pooled-lr2x-emb1x": (2 * lr, 1.0),
        "pooled-lr2x-emb2x": (2 * lr, 2.0),
        "pooled-lr4x-emb1x": (4 * lr, 1.0),
        "pooled-lr4x-emb2x": (4 * lr, 2.0),
    }
    assert all(p.options.max_steps == run.pooled.max_steps for p in run.pooled_points)
    default = build_run_config(four_sites(pooled_baseline=True))
    assert default.pooled_points == ()  # one pooled model unless asked


def write_eval(folder, model, round, values):
    paths = []
    for site, ppl in values.items():
        path = folder / f"{model}-{round}-{site}.json"
        path.write_text(
            json.dumps(
                {"model": model, "round": round, "site": site, "perplexity": ppl, "bits_per_byte": 1.0}
            )
        )
        paths.append(path)
    return paths


def test_the_gap_table_measures_against_your_settings_and_the_best_of_the_sweep(tmp_path):
    """Two rows per merged model: the pooled model at your settings and the sweep's best (lowest
    geometric mean), named with its lr; the figures are the ratios to each."""
    evals = write_eval(tmp_path, "base", 0, {"alpha": 100.0, "beta": 100.0})
    evals += write_eval(tmp_path, "aggregate", 1, {"alpha": 30.0, "beta": 60.0})
    evals += write_eval(tmp_path, "pooled", 1, {"alpha": 40.0, "beta": 80.0})
    evals += write_eval(tmp_path, "pooled-lr2x", 1, {"alpha": 20.0, "beta": 50.0})  # the best
    evals += write_eval(tmp_path, "pooled-lr4x", 1, {"alpha": 15.0, "beta": 90.0})  # best on alpha only
    points = {"pooled": (0.003, 1.0), "pooled-lr2x": (0.006, 1.0), "pooled-lr4x": (0.012, 1.0)}
    paths = report(ReportJob(tmp_path / "out", evals, pooled_points=points))
    gap = pd.read_csv(paths["gap_csv"])
    assert list(gap["yardstick"]) == [YOUR_SETTINGS, BEST_OF_SWEEP]
    yours, best = gap.iloc[0], gap.iloc[1]
    assert (yours["pooled_model"], yours["pooled_lr"]) == ("pooled", 0.003)
    assert (yours["alpha"], yours["beta"]) == (pytest.approx(0.75), pytest.approx(0.75))
    assert (best["pooled_model"], best["pooled_lr"]) == ("pooled-lr2x", 0.006)
    assert (best["alpha"], best["beta"]) == (pytest.approx(1.5), pytest.approx(1.2))
    text = paths["gap_md"].read_text()
    assert BEST_OF_SWEEP in text and "pooled-lr2x" in text and paths["gap_png"].stat().st_size > 0
    # The sweep's pooled models are no merged models: they get no gap rows of their own.
    assert set(gap["model"]) == {"aggregate"}


def test_without_a_sweep_the_gap_has_one_yardstick(tmp_path):
    evals = write_eval(tmp_path, "aggregate", 1, {"alpha": 30.0})
    evals += write_eval(tmp_path, "pooled", 1, {"alpha": 40.0})
    gap = pd.read_csv(report(ReportJob(tmp_path / "out", evals))["gap_csv"])
    assert list(gap["yardstick"]) == [YOUR_SETTINGS] and gap.iloc[0]["alpha"] == pytest.approx(0.75)


def test_pooled_point_arguments():
    assert parse_pooled_point("pooled-lr2x=0.006,2") == ("pooled-lr2x", (0.006, 2.0))
    with pytest.raises(Exception, match="MODEL=LR,FACTOR"):
        parse_pooled_point("aggregate=0.1,1")


# ---------------------------------------------------------------------------------------------------
# Partial participation


def test_participation_counts_and_fractions():
    assert participation_count(None, 4, "x") == 4
    assert participation_count(2, 4, "x") == 2
    assert participation_count(0.5, 4, "x") == 2
    assert participation_count(1.0, 4, "x") == 4  # a fraction: every site
    assert participation_count(1, 4, "x") == 1  # a count: one site
    assert participation_count(0.3, 4, "x") == 2  # rounded up


def test_the_sample_is_deterministic_per_seed_and_differs_between_seeds():
    first = sample_participants(SITES, 2, 8, seed=1234)
    assert first == sample_participants(SITES, 2, 8, seed=1234)
    assert first != sample_participants(SITES, 2, 8, seed=7)
    assert all(len(sites) == 2 and len(set(sites)) == 2 for sites in first)
    assert len(set(first)) > 1  # drawn afresh each round
    # In the sites' order, whatever the draw.
    assert all(list(sites) == sorted(sites, key=SITES.index) for sites in first)


@pytest.mark.parametrize(
    ("federation", "train", "message"),
    [
        ({"participation": 5}, {}, "5 sites per round, but the federation has 4"),
        ({"participation": 1.5}, {}, "1.5 is a fraction above 1"),
        ({"participation": 0}, {}, "federation.participation"),
        ({"participation": 2, "site_optimizer": "keep"}, {}, "site_optimizer: keep"),
        ({"participation": 2}, {"adapter": {"r": 4}}, "not supported with train.adapter"),
        (
            {"participation": 2, "exchange": {"dtype": "int8", "error_feedback": True}},
            {},
            "error_feedback carries each site's residual",
        ),
    ],
)
def test_impossible_participation_is_refused_by_name(federation, train, message):
    config = four_sites(**federation)
    config["train"].update(train)
    if "adapter" in train:  # the demo's fedadam is refused with adapters before participation is read
        config["aggregate"]["server_optimizer"] = {"name": "sgd"}
    with pytest.raises(ConfigError, match=message) as error:
        build_run_config(config, source="my.yaml")
    assert str(error.value).startswith("my.yaml: federation.participation")


def aggregate_argv(job) -> list[str]:
    """The aggregate CLI's arguments of a planned aggregate job (its shell up to the log redirection)."""
    words = shlex.split(job.shell.split(" > ")[0])
    return words[words.index("fedtune.aggregate") + 1 :]


def test_half_participation_trains_and_merges_only_the_sampled_sites(tmp_path, monkeypatch):
    """4 sites, 2 per round: each round trains the sampled sites only, and its aggregate merges them
    alone, their explicit weights normalised among themselves (run on stand-in models at the paths the
    rule names); two dry runs plan the same sites, another seed others; the pooled model sees the
    federation's trained tokens, and its lr sweep trains beside it."""
    federation = {"participation": 0.5, "pooled_baseline": True, "pooled_lr_factors": [1, 2]}
    weights = {"alpha": 1.0, "beta": 2.0, "gamma": 3.0, "delta": 4.0}
    config = four_sites(**federation)
    config["aggregate"] = {**config.get("aggregate", {}), "weights": weights}
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path)
    expected = build_run_config(four_sites(**federation)).participants
    assert expected == sample_participants(SITES, 2, 2, seed=config["train"].get("seed", 1234))
    for round, sites in enumerate(expected, start=1):
        trained = {
            job.wildcards["site"]
            for job in jobs
            if job.name == "train" and job.wildcards["round"] == str(round)
        }
        assert trained == set(sites)
    steps = config["train"]["max_steps"]
    (pooled,) = [job for job in jobs if job.name == "train_pooled"]
    assert f'"max_steps":{2 * 2 * steps}' in pooled.shell  # 2 rounds x 2 sites, not 4
    (swept,) = [job for job in jobs if job.name == "train_pooled_sweep"]
    assert (
        f'"lr":{2 * config["train"]["lr"]}' in swept.shell and "pooled/sweep/pooled-lr2x/model" in swept.shell
    )

    # The first round's merge as the rule runs it, on stand-in site models.
    (merge,) = [job for job in jobs if job.name == "aggregate" and job.wildcards["round"] == "1"]
    argv = aggregate_argv(merge)
    monkeypatch.chdir(tmp_path)
    start = argv[argv.index("--start") + 1]
    write_checkpoint(tmp_path / start, random_tensors(0))
    for k, site in enumerate(SITES):
        (tmp_path / "results" / "demo" / "data" / site).mkdir(parents=True, exist_ok=True)
        write_manifest(tmp_path / "results" / "demo" / "data" / site / "manifest.json", site, 10 * (k + 1))
    models = [arg for arg in argv if "=" in arg and "/model" in arg and not arg.startswith("{")]
    assert [m.split("=")[0] for m in models] == list(expected[0])
    for k, item in enumerate(models):
        write_checkpoint(tmp_path / item.split("=", 1)[1], random_tensors(k + 1))
    from fedtune.aggregate.merge import main

    assert main(argv) == 0
    record = json.loads((tmp_path / argv[argv.index("--out") + 1] / "aggregate.json").read_text())
    raw = {site: weights[site] for site in expected[0]}
    assert record["weights"]["raw"] == raw
    total = sum(raw.values())
    assert record["weights"]["normalised"] == {site: pytest.approx(w / total) for site, w in raw.items()}

    # Deterministic: a second dry run plans the same; another seed samples other sites.
    again = [(j.wildcards["round"], j.wildcards["site"]) for j in dry_run(tmp_path) if j.name == "train"]
    assert sorted(again) == sorted((str(r), s) for r, sites in enumerate(expected, start=1) for s in sites)
    other = four_sites(**federation, participation_seed=7)
    assert build_run_config(other).participants != expected
    write_config(tmp_path, other)
    moved = {(j.wildcards["round"], j.wildcards["site"]) for j in dry_run(tmp_path) if j.name == "train"}
    assert moved == {
        (str(r), s) for r, sites in enumerate(build_run_config(other).participants, 1) for s in sites
    }
    assert moved != set(again)


def test_status_waits_only_for_the_sampled_sites(tmp_path):
    """python -m fedtune.report.status lists each round's sampled sites and expects their evaluations
    only: a site left out of a round is not "waiting" for it."""
    from fedtune.report.status import collect, layout_from_config

    config = four_sites(participation=2)
    config["results"] = str(tmp_path / "results")
    expected = build_run_config(json.loads(json.dumps(config))).participants
    layout = layout_from_config(write_config(tmp_path, config))
    status = collect(layout)
    listed = [(s["round"], s["site"]) for s in status["sites"]]
    assert listed == [(r, s) for r, sites in enumerate(expected, start=1) for s in sites]
    assert layout.evaluated(2) == (*expected[1], "aggregate")
    assert status["rounds"][-1]["evaluations_expected"] == 3 * 4  # 2 sites + aggregate, on 4 test sets


# ---------------------------------------------------------------------------------------------------
# The yardstick benchmark (benchmarks/federation_yardstick.py) on these features


def _benchmark():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import federation_yardstick

    return federation_yardstick


def test_the_benchmark_samples_with_the_product_and_pools_only_the_trained_blocks(tmp_path):
    """16 sites at half participation: each round trains the product's draw (seeded by the cell's seed),
    and the pooled model trains as many blocks as those sites did, not every site's every round; its
    grid point sets lr and train.embedding_lr_factor on the product's pooled options."""
    from argparse import Namespace

    bench = _benchmark()
    sites = [f"s{k:02d}" for k in range(16)]
    for site in sites:
        (tmp_path / site).mkdir()
        for split in ("train", "test"):
            (tmp_path / site / f"{split}.jsonl").write_text('{"text": "x"}\n')
    args = Namespace(rounds=4, steps=4, participation=0.5, strategies=["default"], regime="scratch")
    run = bench.cell_runs(sites, tmp_path, args, seed=3)["default"]
    drawn = [run.round_sites(r) for r in range(1, 5)]
    assert drawn == list(sample_participants(sites, 8, 4, seed=3))
    assert all(len(d) == 8 for d in drawn) and len(set(drawn)) > 1
    assert run.pooled.max_steps == 4 * 8 * 4  # rounds x sampled sites x steps (same batch), not 4 x 16 x 4
    point = bench.pooled_options(run, 0.25, 2.0)
    assert (point.lr, point.embedding_lr_factor) == (pytest.approx(run.pooled.lr / 4), 2.0)
    assert point.max_steps == run.pooled.max_steps
    full = bench.cell_runs(sites, tmp_path, Namespace(**{**vars(args), "participation": 1.0}), seed=3)
    assert full["default"].participants == () and full["default"].pooled.max_steps == 4 * 16 * 4


def test_the_benchmark_reads_the_pooled_models_best_lr_and_embedding_pair(tmp_path):
    """The pooled model is read at its best (lr, embedding) pair, chosen for the confirmation half as a
    pair; the old yardstick (x1, x1) stays the gap_x1 column; a CSV from before the embedding factor
    reads as 1."""
    bench = _benchmark()
    cell = dict(half="tuning", split="topic", sites=2, participation=1.0, rounds=4, steps=4, seed=0)
    rows = []
    for model, lr_factor, embedding, ppl in [
        ("pooled", 1.0, 1.0, 40.0),
        ("pooled", 0.5, 2.0, 20.0),  # the best pooled point: a lower lr with a larger embedding step
        ("pooled", 0.5, 1.0, 30.0),
        ("default", 1.0, 1.0, 25.0),
    ]:
        for site in ("a", "b"):
            rows.append({**cell, "model": model, "lr_factor": lr_factor, "embedding_factor": embedding,
                         "site": site, "perplexity": ppl})  # fmt: skip
    new = tmp_path / "new.csv"
    pd.DataFrame(rows).to_csv(new, index=False)
    old = tmp_path / "old.csv"
    pd.DataFrame([{**r, "half": "confirmation"} for r in rows if r["embedding_factor"] == 1]).drop(
        columns="embedding_factor"
    ).to_csv(old, index=False)
    frame = bench.read_results([new, old, new])  # a point in two CSVs counts once
    assert len(frame) == len(rows) + len(pd.read_csv(old))
    assert (frame[frame.half == "confirmation"].embedding_factor == 1).all()
    assert bench.chosen_points(frame) == {"pooled": (0.5, 2.0), "default": (1.0, 1.0)}
    gaps = bench.gaps(frame[frame.half == "tuning"])
    assert set(gaps.model) == {"default"}
    assert list(gaps.gap) == [pytest.approx(1.25)] * 2 and list(gaps.gap_x1) == [pytest.approx(0.625)] * 2
    assert (gaps.pooled_factor == 0.5).all() and (gaps.pooled_emb == 2.0).all()
