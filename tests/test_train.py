"""Train stage, the parts that need no training run: schedule, data order, shard reading, option and
batch-size errors, the launcher's own options and the rule's Slurm resources."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import yaml

from fedtune.core.cli import EXIT_USER_ERROR
from fedtune.core.options import ConfigError
from fedtune.tokenize.blocks import BlockOrder, Blocks, DataError, manifest_shards
from fedtune.train.options import TrainOptions
from fedtune.train.schedule import learning_rate
from tests.train_runs import BLOCK_SIZE, LAUNCH, PYTHON, ROOT, env
from tests.workflow_harness import demo_config, dry_run, write_config

pytest_plugins = ["tests.train_fixtures"]


def test_learning_rate_warms_up_then_decays_to_the_floor():
    kwargs = {"lr": 1.0, "total_steps": 20, "warmup_steps": 4, "min_lr_ratio": 0.1}
    for schedule in ("cosine", "linear"):
        rates = [learning_rate(s, schedule=schedule, **kwargs) for s in range(20)]
        assert rates[:4] == sorted(rates[:4]) and rates[0] < rates[3] < 1.0
        assert rates[4] == pytest.approx(1.0)
        assert all(a >= b for a, b in zip(rates[4:], rates[5:], strict=False))
        assert rates[-1] == pytest.approx(0.1)
    assert learning_rate(10, schedule="constant", **kwargs) == 1.0
    # Cosine stays above linear in the first half of the decay.
    assert learning_rate(8, schedule="cosine", **kwargs) > learning_rate(8, schedule="linear", **kwargs)


def test_block_order_is_seeded_and_the_same_for_any_world_size():
    two = BlockOrder(num_blocks=50, global_batch=8, micro_batch=2, world_size=2, seed=3)
    four = BlockOrder(num_blocks=50, global_batch=8, micro_batch=1, world_size=4, seed=3)
    assert two.steps_per_epoch == 6 and two.accumulation == 2 and four.accumulation == 2
    for step in range(14):
        batch = two.global_indices(step)
        assert np.array_equal(batch, four.global_indices(step))
        for order in (two, four):
            ranks = [np.concatenate(order.micro_batches(step, r)) for r in range(order.world_size)]
            assert sorted(np.concatenate(ranks)) == sorted(batch)
    epoch = np.concatenate([two.global_indices(s) for s in range(6)])
    assert len(set(epoch)) == 48  # an epoch visits distinct blocks; the last partial batch is dropped
    assert two.position(13) == {"epoch": 2, "batch": 1}
    assert not np.array_equal(two.global_indices(6), two.global_indices(0))  # each epoch reshuffles
    other_seed = BlockOrder(num_blocks=50, global_batch=8, micro_batch=2, world_size=2, seed=4)
    assert not np.array_equal(other_seed.global_indices(0), two.global_indices(0))


def test_blocks_reads_the_shards_of_a_manifest(site_manifest):
    from datasets import load_from_disk

    shards = manifest_shards(site_manifest)
    blocks = Blocks(shards)
    first = load_from_disk(str(shards[0]))
    second = load_from_disk(str(shards[1]))
    assert len(blocks) == len(first) + len(second) and blocks.block_size == BLOCK_SIZE
    input_ids, labels = blocks.get([0, len(first)])
    assert input_ids.tolist() == [first[0]["input_ids"], second[0]["input_ids"]]
    assert labels.tolist() == [first[0]["labels"], second[0]["labels"]]
    assert (labels == -100).any()


def test_global_batch_must_divide_into_micro_batches():
    with pytest.raises(ConfigError, match=r"global_batch: 10 must be a multiple of .* = 4.*8 or 12"):
        BlockOrder(num_blocks=50, global_batch=10, micro_batch=2, world_size=2, seed=0)
    with pytest.raises(DataError, match="larger than the 6 training blocks"):
        BlockOrder(num_blocks=6, global_batch=8, micro_batch=2, world_size=2, seed=0)


def run_cli(tmp_path, manifest, options, **extra_env):
    args = [PYTHON, "-m", "fedtune.train", "--site", "s", "--init", str(tmp_path / "no-model"), "--manifest"]
    args += [str(manifest), "--options", json.dumps(options)]
    args += ["--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    return subprocess.run(args, capture_output=True, text=True, env=env(**extra_env), timeout=120)


def test_cli_reports_indivisible_batch_before_starting(tmp_path, site_manifest):
    # WORLD_SIZE without RANK or MASTER_ADDR: the check must come before any process group exists.
    result = run_cli(tmp_path, site_manifest, {"global_batch": 10, "micro_batch": 2}, WORLD_SIZE="2")
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert (
        "--options: global_batch: 10 must be a multiple of micro_batch (2) x world size (2)" in result.stderr
    )
    assert not (tmp_path / "ckpt").exists()


def test_cli_options_error_names_the_key(tmp_path, site_manifest):
    result = run_cli(tmp_path, site_manifest, {"backend": "fsdp", "zero_stage": 7})
    assert result.returncode == EXIT_USER_ERROR
    assert "--options: zero_stage:" in result.stderr and "7" in result.stderr
    result = run_cli(tmp_path, site_manifest, {"learning_rate": 0.1})
    assert result.returncode == EXIT_USER_ERROR and "learning_rate" in result.stderr


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"precision": "fp8"}, "precision"),
        ({"betas": [0.9]}, "betas"),
        ({"backend": "deepspeed", "zero_stage": 2, "offload_params": True}, "offload_params"),
        ({"backend": "fsdp", "offload_optimizer": True}, "offload_optimizer"),
        ({"backend": "deepspeed", "sharding": "hybrid"}, "sharding"),
        ({"backend": "fsdp", "deepspeed_extra": {"zero_optimization": {}}}, "deepspeed_extra"),
    ],
)
def test_check_options_names_the_key(options, key):
    with pytest.raises(ConfigError, match=rf"--options: {key}:"):
        TrainOptions.from_mapping(options)


def test_bf16_is_refused_where_the_cluster_says_its_gpus_lack_it(monkeypatch):
    monkeypatch.setenv("FEDTUNE_NO_BF16", "1")
    with pytest.raises(ConfigError, match="--options: precision: bf16, but this cluster's GPUs have none"):
        TrainOptions.from_mapping({"precision": "bf16"})
    assert TrainOptions.from_mapping({"precision": "fp16"}).precision == "fp16"


def test_a_corrupted_shard_is_named_before_training(tmp_path, tiny_model_dir):
    from tests.train_runs import make_site_data

    manifest = make_site_data(tmp_path, tiny_model_dir, shards=2)
    arrow = next((manifest.parent / "train" / "shard-1").glob("*.arrow"))
    blob = bytearray(arrow.read_bytes())
    blob[-64] ^= 0xFF
    arrow.write_bytes(bytes(blob))
    args = [PYTHON, "-m", "fedtune.train", "--site", "s", "--init", str(tiny_model_dir), "--manifest",
            str(manifest), "--options", json.dumps({"micro_batch": 2, "global_batch": 4, "max_steps": 1}),
            "--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, env=env(), timeout=300)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert f"{arrow.name}: missing or corrupted" in result.stderr and "shard-1" in result.stderr
    assert not (tmp_path / "out").exists()


def test_corrupted_starting_weights_are_named_before_training(tmp_path, tiny_model_dir, site_manifest):
    import shutil

    init = tmp_path / "init"
    shutil.copytree(tiny_model_dir, init)
    weights = init / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    weights.write_bytes(bytes(blob))
    args = [PYTHON, "-m", "fedtune.train", "--site", "s", "--init", str(init), "--manifest", str(site_manifest),
            "--options", json.dumps({"micro_batch": 2, "global_batch": 4, "max_steps": 1}),
            "--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, env=env(), timeout=300)
    assert result.returncode == EXIT_USER_ERROR, result.stderr
    assert "model.safetensors: sha256 differs" in result.stderr
    assert not (tmp_path / "out").exists()


def test_check_options_fills_defaults():
    options = TrainOptions.from_mapping({"backend": "deepspeed"})
    assert options.zero_stage == 2 and options.deepspeed_extra == {} and options.retries >= 1


def test_train_options_round_trip_through_their_json_form():
    options = TrainOptions.from_mapping(
        {"backend": "deepspeed", "betas": [0.8, 0.9], "deepspeed_extra": {"a": 1}}
    )
    again = TrainOptions.from_json(options.to_json())
    assert again == options and again.betas == (0.8, 0.9)
    # Every key of the schema is a field, and nothing else is but the run's keys: the two cannot drift apart.
    section = set(yaml.safe_load((ROOT / "fedtune/schemas/train.schema.yaml").read_text())["properties"])
    assert set(options.section()) == section == set(options.to_dict()) - set(TrainOptions.RUN_KEYS)
    with pytest.raises(ConfigError, match="--options: not valid JSON"):
        TrainOptions.from_json("{nope")


def test_the_run_keys_travel_in_the_json_form_checked_and_not_in_a_config_section():
    """dtype, allow_pickle, rounds, lr_schedule and token_counts reach the train CLI inside --options
    (they were flags), checked there; a config's train section cannot set them (the schema's keys)."""
    run = {
        "dtype": "bfloat16",
        "allow_pickle": True,
        "rounds": 3,
        "lr_schedule": "restart",
        "token_counts": False,
    }
    options = TrainOptions.from_json(json.dumps({"max_steps": 4, **run}))
    assert {key: getattr(options, key) for key in TrainOptions.RUN_KEYS} == run
    assert TrainOptions.from_json(options.to_json()) == options
    assert TrainOptions.from_json("{}").rounds == 1 and TrainOptions.from_json("{}").token_counts
    with pytest.raises(ConfigError, match="--options: rounds: 0 is not a whole number >= 1"):
        TrainOptions.from_json('{"rounds": 0}')
    with pytest.raises(ConfigError, match="--options: dtype: 'int8' is not one of float32"):
        TrainOptions.from_json('{"dtype": "int8"}')
    with pytest.raises(ConfigError, match="train: Additional properties are not allowed .'rounds' was"):
        TrainOptions.from_mapping({"rounds": 3}, source="config", prefix="train")


def test_launch_rejects_an_unknown_launcher():
    result = subprocess.run(
        ["bash", str(LAUNCH), "--launcher", "mpirun", "--", "true"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "local, torchrun or srun" in result.stderr


def test_launch_sources_the_cluster_file(tmp_path):
    clusters = tmp_path / "clusters"
    clusters.mkdir()
    (clusters / "mycluster.sh").write_text("export FEDTUNE_TEST_CLUSTER=sourced\n")
    command = [PYTHON, "-c", "import os; print('cluster', os.environ['FEDTUNE_TEST_CLUSTER'])"]
    result = subprocess.run(
        ["bash", str(LAUNCH), "--cluster", "mycluster", "--procs-per-node", "1", "--", *command],
        capture_output=True,
        text=True,
        env=env(FEDTUNE_CLUSTERS_DIR=str(clusters)),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "cluster sourced" in result.stdout


def test_train_rule_resources_follow_the_launcher(tmp_path):
    """Dry run: a Slurm site gets nodes/tasks/gres and mpi=srun; a local site gets no mpi resource."""
    config = demo_config(results=str(tmp_path / "results"))
    config["train"]["processes_per_node"] = 2  # gamma's, from the train section
    config["sites"]["alpha"]["train"] = {
        "launcher": "srun",
        "nodes": 2,
        "processes_per_node": 4,
        "gpus_per_node": 4,
        "cpus_per_process": 8,
        "global_batch": 64,
    }
    config["sites"]["beta"]["train"] = {
        "launcher": "torchrun",
        "nodes": 2,
        "processes_per_node": 2,
        "micro_batch": 4,
    }
    config["sites"]["gamma"] = {**config["sites"]["beta"], "train": {}}
    write_config(tmp_path, config)
    targets = [
        str(tmp_path / "results" / "demo" / "round-1" / site / "model") for site in ("alpha", "beta", "gamma")
    ]
    jobs = {job.wildcards["site"]: job for job in dry_run(tmp_path, *targets) if job.name == "train"}
    alpha, beta, gamma = jobs["alpha"], jobs["beta"], jobs["gamma"]
    # srun, 4 per node: tasks per node, and no tasks per GPU (0: the plugin sends no --ntasks-per-gpu).
    assert "tasks" not in alpha.resources
    assert (
        alpha.resources["nodes"],
        alpha.resources["tasks_per_node"],
        alpha.resources["tasks_per_gpu"],
    ) == (
        2,
        4,
        0,
    )
    assert (alpha.resources["cpus_per_task"], alpha.resources["gres"], alpha.resources["mpi"]) == (
        8,
        "gpu:4",
        "srun",
    )
    assert "--launcher srun --nodes 2 --procs-per-node 4" in alpha.shell
    assert (beta.resources["nodes"], beta.resources["tasks"], beta.resources["cpus_per_task"]) == (2, 2, 2)
    assert (
        "gres" not in beta.resources
        and beta.resources["mpi"] == "srun"
        and "--launcher torchrun" in beta.shell
    )
    assert "mpi" not in gamma.resources and "--launcher local --nodes 1 --procs-per-node 2" in gamma.shell
    assert "round-1/alpha/checkpoints" in alpha.shell.split("--checkpoints ")[1]
