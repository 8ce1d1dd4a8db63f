"""The train stage inside a federation: rounds that continue the site's data order and learning-rate
schedule (and, with site_optimizer keep, its Adam moments), and FedProx's proximal term."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedtune.tokenize.blocks import BlockOrder
from fedtune.train.loop import RoundPlan
from fedtune.train.options import TrainOptions
from tests.train_runs import BASE_OPTIONS, REFERENCE_OPTIONS, losses, run_training, weights

pytest_plugins = ["tests.train_fixtures"]

ROUNDS, STEPS = 2, BASE_OPTIONS["max_steps"] // 2


def lr_column(model_out) -> list[str]:
    rows = (model_out / "loss.csv").read_text().strip().splitlines()[1:]
    return [row.split(",")[3] for row in rows]


def test_rounds_read_disjoint_stretches_of_one_data_order():
    """R rounds of S steps train R x S x global_batch distinct blocks (within an epoch), exactly the
    blocks of one run of R x S steps."""
    order = BlockOrder(num_blocks=200, global_batch=8, micro_batch=2, world_size=2, seed=3)
    rounds, steps = 4, 6
    plans = [RoundPlan(r, rounds) for r in range(1, rounds + 1)]
    seen = [order.global_indices(plan.first_step(steps) + k) for plan in plans for k in range(steps)]
    one_run = [order.global_indices(k) for k in range(rounds * steps)]
    assert len(set(np.concatenate(seen))) == rounds * steps * 8
    assert all(np.array_equal(a, b) for a, b in zip(seen, one_run, strict=True))


def test_the_learning_rate_spans_the_federation_or_restarts():
    options = TrainOptions.from_mapping({"lr": 1.0, "warmup_steps": 2, "schedule": "cosine"})
    one_run = [RoundPlan(1, 1).learning_rate(k, 12, options) for k in range(12)]
    rounds = [RoundPlan(r, 3).learning_rate(k, 4, options) for r in (1, 2, 3) for k in range(4)]
    assert rounds == one_run  # exactly: the same function of the same step
    restart = [RoundPlan(r, 3, "restart").learning_rate(k, 4, options) for r in (1, 2, 3) for k in range(4)]
    assert restart[:4] == restart[4:8] == [RoundPlan(1, 1).learning_rate(k, 4, options) for k in range(4)]


@pytest.fixture(scope="module")
def chained_rounds(tiny_model_dir, site_manifest, tmp_path_factory):
    """One site, two rounds of half the reference run's steps, round 2 starting from round 1's model
    (a federation of one: the aggregate is the site model) with round 1's optimizer state."""
    root = tmp_path_factory.mktemp("rounds")
    options = REFERENCE_OPTIONS | {"max_steps": STEPS}
    first, second = root / "round-1", root / "round-2"
    options = options | {"rounds": ROUNDS}
    run_training(
        tiny_model_dir, site_manifest, first, options,
        extra=["--round", "1", "--optimizer-out", str(first / "optimizer")],
    )  # fmt: skip
    run_training(
        first / "model", site_manifest, second, options,
        extra=["--round", "2", "--optimizer-in", str(first / "optimizer")],
    )  # fmt: skip
    return first, second


def test_rounds_that_keep_the_optimizer_equal_one_long_run(chained_rounds, reference_run):
    first, second = chained_rounds
    reference = reference_run / "model"
    assert lr_column(first / "model") + lr_column(second / "model") == lr_column(reference)
    assert losses(first / "model") + losses(second / "model") == pytest.approx(losses(reference), abs=1e-6)
    assert_same_training_weights(second / "model", reference)
    summary = json.loads((second / "model" / "training.json").read_text())
    assert (summary["round"], summary["rounds"], summary["first_step"]) == (2, ROUNDS, STEPS)
    assert summary["optimizer_state"] == "kept"


def assert_same_training_weights(run, reference, tolerance=1e-6):
    mine, theirs = weights(run), weights(reference)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=tolerance, rtol=0, msg=name)


def test_a_round_with_a_fresh_optimizer_differs_from_the_long_run(
    chained_rounds, tiny_model_dir, site_manifest, reference_run, tmp_path
):
    """site_optimizer reset (the default): same data and rates as the long run, new Adam moments, so
    round 2 trains differently; its rates still continue the schedule."""
    first, _ = chained_rounds
    options = REFERENCE_OPTIONS | {"max_steps": STEPS, "rounds": 2}
    # Tracked to TensorBoard on the way: the curves carry the federation's step numbers.
    tracked = json.dumps({"backend": "tensorboard", "dir": str(tmp_path / "tracking")})
    extra = ["--round", "2", "--tracking", tracked, "--run-name", "demo"]
    run_training(first / "model", site_manifest, tmp_path, options, extra=extra)
    assert lr_column(tmp_path / "model") == lr_column(reference_run / "model")[STEPS:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tracking" / "tensorboard" / "demo" / "round-2" / "site"))
    events.Reload()
    logged = events.Scalars("train/loss")
    assert [e.step for e in logged] == list(range(STEPS + 1, 2 * STEPS + 1))
    assert [e.value for e in logged] == pytest.approx(losses(tmp_path / "model"), rel=1e-6)
    assert events.Scalars("summary/steps")[0].value == STEPS
    assert losses(tmp_path / "model")[0] == pytest.approx(losses(reference_run / "model")[STEPS], abs=1e-6)
    assert losses(tmp_path / "model")[1:] != pytest.approx(
        losses(reference_run / "model")[STEPS + 1 :], abs=1e-6
    )


def distance_to_start(model_out, start_dir) -> float:
    start, end = weights(start_dir), weights(model_out)
    return float(sum(((end[name] - start[name]) ** 2).sum() for name in start) ** 0.5)


def test_fedprox_with_mu_zero_is_plain_training(tiny_model_dir, site_manifest, reference_run, tmp_path):
    run_training(tiny_model_dir, site_manifest, tmp_path, REFERENCE_OPTIONS | {"fedprox_mu": 0})
    mine, theirs = weights(tmp_path / "model"), weights(reference_run / "model")
    assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


@pytest.mark.parametrize(
    "backend",
    [{"backend": "fsdp", "sharding": "full"}, {"backend": "deepspeed", "zero_stage": 3}],
    ids=["fsdp-full", "deepspeed-zero3"],
)
def test_fedprox_keeps_the_site_model_near_the_round_start(
    tiny_model_dir, site_manifest, reference_run, tmp_path, backend
):
    """A strong proximal term shrinks how far training moves the weights from where the round began."""
    run_training(tiny_model_dir, site_manifest, tmp_path, REFERENCE_OPTIONS | backend | {"fedprox_mu": 30.0})
    plain = distance_to_start(reference_run / "model", tiny_model_dir)
    proximal = distance_to_start(tmp_path / "model", tiny_model_dir)
    assert proximal < 0.8 * plain, (proximal, plain)
    assert losses(tmp_path / "model")[-1] < losses(tmp_path / "model")[0]  # it still learns


def test_training_writes_the_token_counts_of_the_blocks_it_trained_on(reference_run, site_manifest):
    """token_counts.json (aggregate.vocab_rows): every rank's blocks of the round, counted once."""
    from fedtune.core import token_counts
    from fedtune.tokenize.blocks import Blocks, manifest_shards

    model = reference_run / "model"
    record = token_counts.read(model)
    summary = json.loads((model / "training.json").read_text())
    blocks = Blocks(manifest_shards(site_manifest))
    order = BlockOrder(len(blocks), summary["global_batch"], summary["micro_batch"], 2, BASE_OPTIONS["seed"])
    expected = np.zeros(len(record.counts), dtype=np.int64)
    for step in range(summary["steps"]):
        for rank in (0, 1):
            for indices in order.micro_batches(step, rank):
                ids, _ = blocks.get(indices)
                expected += np.bincount(ids.numpy().ravel(), minlength=len(expected))
    assert record.counts.tolist() == expected.tolist()
    assert record.tokens == summary["steps"] * summary["global_batch"] * summary["block_size"]
    assert record.tensors == ("model.embed_tokens.weight", "lm_head.weight")
    assert len(record.counts) == weights(model)["model.embed_tokens.weight"].shape[0]


@pytest.mark.parametrize(("options", "writes"), [({}, True), ({"token_counts": False}, False)])
def test_the_train_cli_writes_token_counts_unless_its_options_say_not_to(options, writes):
    from fedtune.train.loop import parse_args

    args = ["--site", "a", "--init", "m", "--manifest", "x.json", "--checkpoints", "c", "--out", "o"]
    parsed = parse_args([*args, "--options", json.dumps(options)])
    assert TrainOptions.from_json(parsed.options).token_counts is writes
    with pytest.raises(SystemExit):  # the flag is gone: the setting is in the options
        parse_args([*args, "--options", "{}", "--no-token-counts"])
