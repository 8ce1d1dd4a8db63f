"""The report's tables have one row per (round, model) and one column per site, in a stable order, and
every figure is written; training summaries tolerate missing optional keys."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fedtune.report.build import ReportError, ReportJob, main, parse_labelled, report

SITES = ["alpha", "beta"]


def write_evals(folder, rounds=2):
    """Results for base (no round), each site model and the aggregate of every round, on every site."""
    paths = []
    models = [(None, "base")] + [(r, m) for r in range(1, rounds + 1) for m in ["aggregate", *SITES]]
    for rnd, model in models:
        for j, site in enumerate(SITES):
            ppl = 100.0 / (rnd or 0.5) + 10 * j + (0 if model == site else 5)
            result = {
                "model": model,
                "round": rnd,
                "site": site,
                "perplexity": ppl,
                "bits_per_byte": ppl / 100,
            }
            path = folder / f"{rnd}-{model}-{site}.json"
            path.write_text(json.dumps(result))
            paths.append(path)
    return paths


def write_site_runs(folder, rounds=2):
    training, losses = [], []
    for rnd in range(1, rounds + 1):
        for site in SITES:
            d = folder / f"round-{rnd}" / site
            d.mkdir(parents=True)
            summary = {"site": site, "steps": 10, "tokens_seen": 20480, "final_loss": 2.5, "wall_time_s": 4.0,
                       "step_time_s": 2.0, "tokens_per_s": 10240.0}  # fmt: skip
            if site == "alpha":
                summary.update(world_size=2, backend="fsdp", sharding="full")
            (d / "training.json").write_text(json.dumps(summary))
            pd.DataFrame({"step": range(1, 11), "loss": [5 - 0.1 * i for i in range(10)], "lr": 1e-3}).to_csv(
                d / "loss.csv", index=False
            )
            training.append(f"{rnd}:{site}={d / 'training.json'}")
            losses.append(f"{rnd}:{site}={d / 'loss.csv'}")
    return training, losses


def test_report_tables_and_figures(tmp_path, monkeypatch):
    from fedtune.core.offline import OFFLINE_VARIABLES

    for name in OFFLINE_VARIABLES:  # main() sets them; monkeypatch restores them afterwards
        monkeypatch.setenv(name, "0")
    evals = write_evals(tmp_path)
    training, losses = write_site_runs(tmp_path)
    out = tmp_path / "report"
    assert (
        main(["--out", str(out), "--eval", *map(str, evals), "--training", *training, "--loss", *losses]) == 0
    )

    table = pd.read_csv(out / "perplexity.csv")
    assert list(table.columns) == ["round", "model", *SITES]
    expected_rows = [(0, "base")] + [(r, m) for r in (1, 2) for m in [*SITES, "aggregate"]]
    assert list(zip(table["round"], table["model"], strict=True)) == expected_rows
    row = table[(table["round"] == 2) & (table["model"] == "alpha")].iloc[0]
    assert row["alpha"] == pytest.approx(50.0) and row["beta"] == pytest.approx(65.0)
    bpb = pd.read_csv(out / "bits_per_byte.csv")
    assert bpb.shape == table.shape and bpb.loc[0, "alpha"] == pytest.approx(2.05)

    md = (out / "perplexity.md").read_text().splitlines()
    header = next(i for i, line in enumerate(md) if line.startswith("| round"))
    assert md[header] == "| round | model | alpha | beta |"
    assert len(md) - header - 2 == len(expected_rows)
    assert "| 2 | alpha | **50.000** | 65.000 |" in md

    train = pd.read_csv(out / "training.csv")
    assert len(train) == 4 and list(train[["round", "site"]].itertuples(index=False, name=None))[:2] == [
        (1, "alpha"),
        (1, "beta"),
    ]
    # Per second of training steps (training.json's, as status shows it) and of the whole job, labelled.
    assert train["tokens_per_s"].tolist() == [10240.0] * 4
    assert train["job_tokens_per_s"].tolist() == [5120.0] * 4
    assert train["backend"].isna().tolist() == [False, True, False, True]  # optional keys may be absent
    training_md = (out / "training.md").read_text()
    assert "| 1 | beta | 10 | 20,480 | 4.0 | 10,240 | 5,120 | 2.5000 | – |" in training_md
    assert "tokens_per_s: tokens per second of training steps" in training_md
    assert "job_tokens_per_s: per second of the whole job" in training_md

    for figure in ("perplexity.png", "rounds.png", "loss.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure


def test_missing_training_files_are_left_out(tmp_path, capsys):
    evals = write_evals(tmp_path, rounds=1)
    paths = report(
        ReportJob(
            tmp_path / "out",
            evals,
            [(1, "alpha", tmp_path / "nope.json")],
            [(1, "alpha", tmp_path / "x.csv")],
        )
    )
    assert pd.read_csv(paths["training_csv"]).empty
    assert paths["loss_png"].is_file()
    assert "nope.json" in capsys.readouterr().err


def test_duplicate_results_are_refused(tmp_path):
    evals = write_evals(tmp_path, rounds=1)
    with pytest.raises(ReportError, match="two results for model beta"):
        report(ReportJob(tmp_path / "out", [*evals, evals[-1]]))


def test_labelled_paths():
    assert parse_labelled("3:beta=/x/y=z.json", "--loss")[:2] == (3, "beta")
    with pytest.raises(ReportError, match="ROUND:SITE=PATH"):
        parse_labelled("beta=/x.json", "--loss")


def test_the_gap_to_the_pooled_model_per_round_and_merged_model(tmp_path):
    """gap.csv: each merged model's perplexity over the pooled model's, per round and site; a compared
    merge method gets rows of its own; site models and the base get none."""
    evals = write_evals(tmp_path)
    pooled = {"alpha": 20.0, "beta": 40.0}
    for site, ppl in pooled.items():
        path = tmp_path / f"pooled-{site}.json"
        path.write_text(json.dumps({"model": "pooled", "round": 2, "site": site, "perplexity": ppl}))
        evals.append(path)
    ties = tmp_path / "ties.json"
    ties.write_text(json.dumps({"model": "ties", "round": 2, "site": "alpha", "perplexity": 30.0}))
    paths = report(ReportJob(tmp_path / "out", [*evals, ties]))
    gap = pd.read_csv(paths["gap_csv"])
    main = pd.read_csv(paths["perplexity_csv"])
    assert list(gap["model"]) == ["aggregate", "aggregate", "ties"] and list(gap["round"]) == [1, 1 + 1, 2]
    for _, row in gap[gap["model"] == "aggregate"].iterrows():
        merged = main[(main["round"] == row["round"]) & (main["model"] == "aggregate")].iloc[0]
        for site, ppl in pooled.items():
            assert row[site] == pytest.approx(merged[site] / ppl)
    assert gap[gap["model"] == "ties"].iloc[0]["alpha"] == pytest.approx(1.5)
    assert main["model"].iloc[-1] == "pooled"  # the pooled model is the table's last row
    assert paths["gap_png"].stat().st_size > 0 and "pooled model" in paths["gap_md"].read_text()


def test_no_pooled_model_no_gap(tmp_path):
    paths = report(ReportJob(tmp_path / "out", write_evals(tmp_path)))
    assert "gap_csv" not in paths and not (tmp_path / "out" / "gap.csv").exists()


def write_task_scores(folder, rounds=2):
    """fedtune.evaluate.downstream's CSVs: base and the last round's models on a task and on a group of two."""
    from fedtune.evaluate.downstream import to_csv

    paths = []
    for rnd, model in [(0, "base")] + [(rounds, m) for m in [*SITES, "aggregate"]]:
        score = 10.0 - rnd - len(model) / 10
        table = {"lambada": {"acc": score / 20, "perplexity": score}, "grp": {"acc": 0.5}}
        table.update({"grp_a": {"acc": score / 30}, "grp_b": {"acc": score / 40}})
        entries = {"lambada": "lambada", "grp": "grp", "grp_a": "grp", "grp_b": "grp"}
        path = folder / f"{model}.csv"
        path.write_text(to_csv(table, entries, model, rnd))
        paths.append(path)
    return paths


def test_one_table_per_downstream_task(tmp_path):
    scores = write_task_scores(tmp_path)
    out = tmp_path / "report"
    paths = report(ReportJob(out, write_evals(tmp_path), tasks=scores, task_names=["lambada", "grp"]))
    lambada = pd.read_csv(out / "tasks" / "lambada.csv")
    assert list(lambada.columns) == ["round", "model", "acc", "perplexity"]
    # The main table's order: base, the sites, the aggregate.
    assert list(zip(lambada["round"], lambada["model"], strict=True)) == [
        (0, "base"), (2, "alpha"), (2, "beta"), (2, "aggregate"),
    ]  # fmt: skip
    assert lambada.set_index("model").loc["beta", "perplexity"] == 10.0 - 2 - 0.4
    group = pd.read_csv(out / "tasks" / "grp.csv")
    assert list(group.columns) == ["round", "model", "acc", "grp_a acc", "grp_b acc"]
    assert group.set_index("model").loc["base", "grp_a acc"] == pytest.approx((10.0 - 0.4) / 30)
    for name in ("lambada", "grp"):
        assert paths[f"task_{name}_md"].read_text().startswith(f"Task {name} (lm-evaluation-harness)")
        assert "<table>" in paths[f"task_{name}_html"].read_text()
    with pytest.raises(ReportError, match="--tasks: no scores of task hellaswag"):
        report(ReportJob(out, write_evals(tmp_path), tasks=scores, task_names=["hellaswag"]))
    assert (
        main(["--out", str(out), "--eval", *map(str, write_evals(tmp_path)), "--tasks", str(scores[0])]) == 2
    )


def test_rounds_figure_draws_the_pooled_model_where_the_run_has_it(tmp_path):
    from fedtune.report.build import rounds_figure

    rows = [(0, "base", 90.0, 80.0), (1, "aggregate", 60.0, 55.0), (2, "aggregate", 50.0, 45.0)]
    table = pd.DataFrame(rows, columns=["round", "model", *SITES])
    drawn = rounds_figure(table, tmp_path / "rounds.png")
    assert drawn["aggregate"]["alpha"] == [(0, 90.0), (1, 60.0), (2, 50.0)] and drawn["pooled"] == {}
    pooled = pd.concat([table, pd.DataFrame([(2, "pooled", 40.0, 42.0)], columns=table.columns)])
    drawn = rounds_figure(pooled, tmp_path / "rounds.png")
    assert drawn["pooled"] == {"alpha": 40.0, "beta": 42.0}
    assert (tmp_path / "rounds.png").read_bytes()[:4] == b"\x89PNG"


def test_the_loss_figure_explains_rounds_that_start_without_warmup(tmp_path):
    """The demo's round 3 spiked to 7.7 after its first step: rounds under lr_schedule continue start
    at full rate on a fresh optimizer; the figure says so, and says nothing where each round warms up."""
    from fedtune.report.build import UNWARMED_ROUNDS_NOTE, loss_figure

    def curves(first_rates):
        entries = []
        for rnd, first in enumerate(first_rates, start=1):
            csv = tmp_path / f"{rnd}.csv"
            rates = [first * (k + 1) if first < 1e-3 else 3e-3 for k in range(4)]
            pd.DataFrame({"step": range(1, 5), "loss": [6.0, 7.7, 5.9, 5.8], "lr": rates}).to_csv(
                csv, index=False
            )
            entries.append((rnd, "alpha", csv))
        return entries

    continuing = loss_figure(curves([3e-4, 3e-3, 3e-3]), tmp_path / "loss.png")
    assert continuing == UNWARMED_ROUNDS_NOTE and "fresh site optimizer" in continuing
    assert loss_figure(curves([3e-4, 3e-4, 3e-4]), tmp_path / "loss.png") is None  # restart: warmed up
    assert loss_figure(curves([3e-4]), tmp_path / "loss.png") is None  # one round


# What the figures draw and the tables print, as a reader sees them (issue 48, part 2, point 4; issue 47:
# a diverged model).


@pytest.fixture
def kept_figures(monkeypatch):
    """The figures the report's functions draw, kept open after they are saved: a function that returns
    those drawn since its last call, in order."""
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "close", lambda *args: None)
    seen = set(plt.get_fignums())

    def newest():
        numbers = sorted(set(plt.get_fignums()) - seen)
        seen.update(numbers)
        return [plt.figure(number) for number in numbers]

    yield newest
    plt.close("all")


def tick_labels(axis, minor: bool = False) -> list[str]:
    """The tick labels a reader sees on an axis: those within its view, not blank."""
    low, high = sorted(axis.get_view_interval())
    ticks = axis.get_minorticklocs() if minor else axis.get_majorticklocs()
    labels = axis.get_ticklabels(minor=minor)
    return [
        label.get_text()
        for loc, label in zip(ticks, labels, strict=False)
        if low <= loc <= high and label.get_text()
    ]


def demo_gap_table():
    """A gap like the demo's: 2.6-2.8 in round 1 down to 1.4-1.5 in round 3, less than a decade."""
    from fedtune.core.options import CAUSAL_LM
    from fedtune.report.build import TASK_METRICS, eval_table, gap_table

    results = [
        {"model": "pooled", "round": 0, "site": s, "perplexity": v}
        for s, v in zip(SITES, [45.4, 49.5], strict=True)
    ]
    for rnd, values in {1: (120.0, 140.0), 2: (90.0, 100.0), 3: (65.2, 76.2)}.items():
        results += [
            {"model": "aggregate", "round": rnd, "site": s, "perplexity": v}
            for s, v in zip(SITES, values, strict=True)
        ]
    return gap_table(eval_table(results, "perplexity"), TASK_METRICS[CAUSAL_LM], {"pooled": (1e-4, 16.0)})


def test_log_axes_label_plain_numbers(tmp_path, kept_figures):
    """gap.png and rounds.png: "1, 1.5, 2", never "2x10^0" or "10^0" (mathtext)."""
    from fedtune.report.build import gap_figure, rounds_figure

    gap_figure(demo_gap_table(), tmp_path / "gap.png")
    axis = kept_figures()[0].axes[0].yaxis
    labels = tick_labels(axis) + tick_labels(axis, minor=True)
    assert labels and not [text for text in labels if "$" in text or "times" in text or "^" in text], labels
    assert {"1", "1.5", "2"} <= set(labels), labels
    rows = [(0, "base", 410.0, 520.0), (1, "aggregate", 120.0, 140.0), (2, "aggregate", 65.2, 76.2)]
    rounds_figure(pd.DataFrame(rows, columns=["round", "model", *SITES]), tmp_path / "rounds.png")
    axis = kept_figures()[0].axes[0].yaxis
    labels = tick_labels(axis) + tick_labels(axis, minor=True)
    assert {"100", "200", "300"} <= set(labels) and not [t for t in labels if "$" in t], labels


def test_the_loss_figure_labels_whole_steps_only(tmp_path, kept_figures):
    """One round of 3 steps: ticks 1, 2, 3, not 1.00, 1.25, ... 3.00."""
    from fedtune.report.build import loss_figure

    csv = tmp_path / "loss.csv"
    pd.DataFrame({"step": [1, 2, 3], "loss": [5.0, 4.8, 4.7]}).to_csv(csv, index=False)
    loss_figure([(1, "alpha", csv)], tmp_path / "loss.png")
    axis = kept_figures()[0].axes[0].xaxis
    ticks = [loc for loc in axis.get_majorticklocs() if 1 <= loc <= 3]
    assert ticks == [1, 2, 3], ticks
    assert tick_labels(axis) == ["1", "2", "3"], tick_labels(axis)


def test_a_small_learning_rate_keeps_its_digits(tmp_path):
    """gap.md printed the pooled lr 1e-4 as 0.000: a value too small for its decimals gets significant
    digits."""
    from fedtune.report.build import markdown

    text = markdown(demo_gap_table(), digits={site: 2 for site in SITES})
    assert "| 0.0001 | 16.000 | 2.64 | 2.83 |" in text, text
    assert "0.000 |" not in text
    assert markdown(pd.DataFrame({"lr": [3e-6, 0.25, 0.0]}), digits=3).splitlines()[2:] == [
        "| 3e-06 |", "| 0.250 |", "| 0.000 |",
    ]  # fmt: skip


def test_a_diverged_model_reads_diverged_and_a_missing_result_reads_a_dash(tmp_path, kept_figures):
    """issue 47: a NaN perplexity (a diverged model) printed "–", the mark of "not evaluated"."""
    results = {
        ("base", None, "alpha"): 100.0,  # base on beta: not evaluated
        ("aggregate", 1, "alpha"): float("nan"),
        ("aggregate", 1, "beta"): 50.0,
        ("beta", 1, "beta"): float("inf"),
        ("pooled", 1, "alpha"): 40.0,
        ("pooled", 1, "beta"): 40.0,
    }
    evals = []
    for (model, rnd, site), ppl in results.items():
        path = tmp_path / f"{model}-{site}.json"
        result = {"model": model, "round": rnd, "site": site, "perplexity": ppl, "bits_per_byte": ppl / 100}
        path.write_text(json.dumps(result))
        evals.append(path)
    paths = report(ReportJob(tmp_path / "out", evals))
    text = paths["perplexity_md"].read_text()
    assert "| 0 | base | 100.000 | – |" in text, text
    assert "| 1 | aggregate | diverged | 50.000 |" in text and "| 1 | beta | – | diverged |" in text, text
    assert "diverged: a perplexity that is NaN or infinite" in text
    assert "<td class='n'>diverged</td>" in paths["perplexity_html"].read_text()
    gap = paths["gap_md"].read_text()
    assert "| diverged | 1.25 |" in gap, gap
    # The heatmap writes it in its cell; the figures draw no line to it.
    figures = kept_figures()  # gap, perplexity heatmap, rounds, loss
    texts = [t.get_text() for fig in figures for ax in fig.axes for t in ax.texts]
    assert "diverged" in texts, texts
