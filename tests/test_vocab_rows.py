"""aggregate.vocab_rows: the rows of the tensors with a row per token id are merged with the sites'
weights times each site's frequency of the token (fedtune.core.token_counts), read from the
token_counts.json that training writes beside each site model; everything else, and every fallback,
stays the weighted mean. In a federation's round the merged rows' update is multiplied by
aggregate.vocab_step (the number of sites by default). vocab_rows counts is asked for here: the
default is weights (plain FedAvg), which reads no counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedtune.aggregate.merge import AggregateJob, aggregate
from fedtune.core import token_counts
from tests.test_aggregate import options as aggregate_options
from tests.test_aggregate import random_tensors, read_output, write_checkpoint

VOCAB = 32  # random_tensors' embeddings and LM head: (32, 8)
ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def options(**values):
    """The aggregate section with vocab_rows counts unless `values` say otherwise."""
    return aggregate_options(**{"vocab_rows": "counts", **values})


def test_row_weights_by_hand():
    counts = [np.array([4, 0, 2, 0, 6]), np.array([0, 3, 2, 0, 1])]
    table = token_counts.row_weights(counts, [0.25, 0.75]).double()
    # Token 0 only site a saw, token 1 only site b: the update of the one that saw it, whole.
    assert table[:, 0].tolist() == [1.0, 0.0] and table[:, 1].tolist() == [0.0, 1.0]
    # Token 2: weights times frequencies, 0.25 * 2/12 against 0.75 * 2/6.
    a, b = 0.25 * 2 / 12, 0.75 * 2 / 6
    torch.testing.assert_close(table[:, 2], torch.tensor([a / (a + b), b / (a + b)], dtype=torch.float64))
    # A token nobody saw keeps the sites' weights; every column sums to 1.
    assert table[:, 3].tolist() == [0.25, 0.75]
    torch.testing.assert_close(table.sum(dim=0), torch.ones(5, dtype=torch.float64))


def sites_with_counts(tmp_path, counts, *, seed=1):
    base = random_tensors(0)
    g = torch.Generator().manual_seed(seed)
    models = {}
    for site, c in counts.items():
        tensors = {
            n: (t.float() + 0.1 * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in base.items()
        }
        models[site] = write_checkpoint(tmp_path / site, tensors)
        if c is not None:
            token_counts.write(models[site], np.asarray(c), ROWS, first_step=0, steps=1)
    return write_checkpoint(tmp_path / "start", base), models


def expected_rows(start, models, table, name):
    base = read_output(start)[name].double()
    delta = sum(
        table[i].double()[:, None] * (read_output(m)[name].double() - base)
        for i, m in enumerate(models.values())
    )
    return base + delta


COUNTS = {"a": [5] * 16 + [0] * 16, "b": [0] * 8 + [2] * 24}


@pytest.mark.parametrize(
    ("server", "step", "state", "factor"),
    [
        ({"name": "sgd"}, "sites", False, 1.0),  # a one-shot merge: the sites' mean, no step
        ({"name": "sgd"}, "sites", True, 2.0),  # a federation's round: 2 sites, 2x the merged rows
        ({"name": "fedavgm", "lr": 1.5, "momentum": 0.5}, "sites", True, 2.0),
        ({"name": "fedavgm", "lr": 1.5, "momentum": 0.5}, 0.5, True, 0.5),
        ({"name": "sgd"}, 1, True, 1.0),
    ],
)
def test_vocab_rows_follow_the_sites_token_counts(tmp_path, server, step, state, factor):
    start, models = sites_with_counts(tmp_path, COUNTS)
    out = tmp_path / "merged"
    record = aggregate(
        AggregateJob(models, out, start=start, server_state_out=tmp_path / "state" if state else None),
        options(weights="uniform", server_optimizer=server, vocab_step=step),
    )
    assert record["vocab_rows"] == {"mode": "counts", "tensors": sorted(ROWS), "step": factor}
    merged, lr = read_output(out), server.get("lr", 1.0) if state else 1.0
    table = token_counts.row_weights([np.asarray(c) for c in COUNTS.values()], [0.5, 0.5])
    base = read_output(start)
    for name in ROWS:
        row_delta = expected_rows(start, models, table, name) - base[name].double()
        want = base[name].double() + lr * factor * row_delta
        # In the model's dtype (bf16): fp32 arithmetic against this double reference may round one
        # entry the other way; a wrong step is off by far more than one unit in the last place.
        torch.testing.assert_close(merged[name], want.to(merged[name].dtype))
        # Rows 0-7 only site a saw: site a's update, whole, not half of it (times the step).
        site_a = read_output(models["a"])[name][:8].double()
        torch.testing.assert_close(
            merged[name][:8],
            (base[name][:8].double() + lr * factor * (site_a - base[name][:8].double())).to(
                merged[name].dtype
            ),
        )
    # Every other tensor: the plain weighted mean's step.
    name = "model.layers.0.self_attn.q_proj.weight"
    mean = sum(read_output(m)[name].double() for m in models.values()) / 2
    want = base[name].double() + lr * (mean - base[name].double())
    torch.testing.assert_close(merged[name].double(), want.to(merged[name].dtype).double())


@pytest.mark.parametrize(
    "case",
    ["one site without counts", "vocab_rows weights", "method ties"],
)
def test_without_counts_every_row_takes_the_sites_weights(tmp_path, case):
    counts = dict(COUNTS, b=None) if case == "one site without counts" else COUNTS
    start, models = sites_with_counts(tmp_path, counts)
    extra = {"vocab_rows": "weights"} if case == "vocab_rows weights" else {}
    if case == "method ties":
        extra = {"method": "ties", "server_optimizer": {"name": "sgd"}}
    plain = aggregate(
        AggregateJob(models, tmp_path / "merged", start=start), options(weights="uniform", **extra)
    )
    for site in models:  # the reference: the same merge without any counts
        (models[site] / token_counts.FILE).unlink(missing_ok=True)
    reference = aggregate(
        AggregateJob(models, tmp_path / "reference", start=start), options(weights="uniform", **extra)
    )
    assert plain["vocab_rows"]["tensors"] == []
    if case != "vocab_rows weights":
        assert plain["vocab_rows"]["fallback"]
        assert reference["vocab_rows"]["fallback"]
    merged, want = read_output(tmp_path / "merged"), read_output(tmp_path / "reference")
    assert all(torch.equal(merged[n], want[n]) for n in want)


def test_a_token_nobody_saw_keeps_the_weighted_mean(tmp_path):
    counts = {"a": [3] * 4 + [0] * 28, "b": [1] * 4 + [0] * 28}
    start, models = sites_with_counts(tmp_path, counts)
    aggregate(AggregateJob(models, tmp_path / "merged", start=start), options(weights={"a": 1, "b": 3}))
    merged = read_output(tmp_path / "merged")
    for name in ROWS:
        mean = 0.25 * read_output(models["a"])[name].double() + 0.75 * read_output(models["b"])[name].double()
        torch.testing.assert_close(merged[name][4:].double(), mean[4:].to(merged[name].dtype).double())


def test_the_record_is_read_back(tmp_path):
    token_counts.write(tmp_path, np.array([1, 0, 2]), ROWS, first_step=4, steps=2)
    back = token_counts.read(tmp_path)
    assert back.counts.tolist() == [1, 0, 2] and back.tensors == ROWS and back.tokens == 3
    assert json.loads((tmp_path / token_counts.FILE).read_text())["first_step"] == 4
    assert token_counts.read(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("text", ["{not json", '{"tensors": []}', '{"counts": [1, -2], "tensors": []}'])
def test_a_damaged_record_is_named_before_anything_is_merged(tmp_path, text):
    start, models = sites_with_counts(tmp_path, COUNTS)
    (models["b"] / token_counts.FILE).write_text(text)
    with pytest.raises(token_counts.TokenCountsError, match=str(models["b"] / token_counts.FILE)):
        aggregate(AggregateJob(models, tmp_path / "merged", start=start), options(weights="uniform"))
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(("value", "factor"), [("sites", 3.0), (2, 2.0), (0.5, 0.5), (1, 1.0)])
def test_the_vocab_step_is_the_number_of_sites_unless_a_number_is_given(value, factor):
    from fedtune.aggregate.options import AggregateOptions

    options = AggregateOptions.from_mapping({"vocab_step": value})
    assert options.vocab_factor(3) == factor
    assert AggregateOptions.from_json(options.to_json()) == options
    assert AggregateOptions.from_mapping({}).vocab_step == "sites"  # the schema's default


@pytest.mark.parametrize("value", [0, -1, "all", None])
def test_a_bad_vocab_step_is_named(value):
    from fedtune.aggregate.options import AggregateOptions
    from fedtune.core.options import ConfigError

    with pytest.raises(ConfigError, match="vocab_step"):
        AggregateOptions.from_mapping({"vocab_step": value})
