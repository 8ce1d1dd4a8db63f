"""Each backend and sharding mode trains the tiny model on CPU with 2 gloo processes; fp32 runs with the
same seed agree with the FSDP full-shard reference; the export reloads with from_pretrained.

Where the other modes are covered: DeepSpeed ZeRO-2 in test_train_resume (interrupted, resumed and
still equal to the reference), ZeRO-0 and FSDP hybrid / none in test_train_launch."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train_runs import BASE_OPTIONS, losses, run_training, weights

pytest_plugins = ["tests.train_fixtures"]


def assert_loss_falls(model_out):
    curve = losses(model_out)
    assert len(curve) == BASE_OPTIONS["max_steps"]
    assert curve[-1] < curve[0] - 0.3, curve


def assert_same_training(run, reference, tolerance=1e-5):
    assert losses(run) == pytest.approx(losses(reference), abs=tolerance)
    mine, theirs = weights(run), weights(reference)
    assert sorted(mine) == sorted(theirs)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=tolerance, rtol=0, msg=name)


def test_fsdp_full_trains_and_exports(reference_run):
    model = reference_run / "model"
    assert_loss_falls(model)
    summary = json.loads((model / "training.json").read_text())
    assert summary["steps"] == BASE_OPTIONS["max_steps"] and summary["world_size"] == 2
    assert summary["backend"] == "fsdp" and summary["sharding"] == "full"
    assert summary["tokens_seen"] == BASE_OPTIONS["max_steps"] * BASE_OPTIONS["global_batch"] * 32
    assert 0 < summary["tokens_trained"] < summary["tokens_seen"]  # masked labels are not trained on
    assert summary["final_loss"] == pytest.approx(losses(model)[-1])
    header, *rows = (model / "loss.csv").read_text().strip().splitlines()
    assert header == "step,epoch,loss,lr,grad_norm,tokens_per_s,peak_mem_mb"
    assert [int(row.split(",")[0]) for row in rows] == list(range(1, BASE_OPTIONS["max_steps"] + 1))
    assert all(float(v) > 0 for row in rows for v in row.split(",")[3:])
    per_epoch = summary["steps_per_epoch"]
    assert [int(row.split(",")[1]) for row in rows] == [
        (step - 1) // per_epoch + 1 for step in range(1, BASE_OPTIONS["max_steps"] + 1)
    ]
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (model / name).stat().st_mode & 0o044 == 0o044, name  # readable by the group and others
    stdout = (reference_run / "stdout.txt").read_text()
    assert "rank 0/2 on host" in stdout and "rank 1/2 on host" in stdout
    assert f"step {BASE_OPTIONS['max_steps']}/{BASE_OPTIONS['max_steps']} | loss" in stdout


LAST_CHECKPOINT = f"step-{BASE_OPTIONS['max_steps']:08d}"


def assert_exported_as_trained(model_out, trained: dict):
    """The exported weights are the sharded trainer's last weights (its final checkpoint), bit for bit,
    and reload with from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = weights(model_out)
    assert sorted(exported) == sorted(trained)
    for name, tensor in trained.items():
        assert torch.equal(exported[name], tensor.float()), name
    model = AutoModelForCausalLM.from_pretrained(model_out)
    assert model.dtype == torch.float32
    reloaded = model.state_dict()
    assert all(torch.equal(reloaded[name], exported[name]) for name in exported)
    assert AutoTokenizer.from_pretrained(model_out).bos_token == "<s>"


def test_fsdp_export_holds_the_trained_weights(reference_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(reference_run / "checkpoints" / LAST_CHECKPOINT / "fsdp", tmp_path / "last.pt")
    trained = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    assert_exported_as_trained(reference_run / "model", trained)


def test_deepspeed_zero3_matches_fsdp(deepspeed3_run, reference_run):
    assert_same_training(deepspeed3_run / "model", reference_run / "model")
    summary = json.loads((deepspeed3_run / "model" / "training.json").read_text())
    assert summary["backend"] == "deepspeed" and summary["sharding"] == "zero3"
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint = deepspeed3_run / "checkpoints" / LAST_CHECKPOINT
    trained = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="deepspeed")
    assert_exported_as_trained(deepspeed3_run / "model", trained)


@pytest.mark.parametrize(
    ("options", "dtype"),
    [
        # Mixed precision, checked briefly: on this CPU bf16 and fp16 are several times slower than fp32.
        (
            {
                "backend": "fsdp",
                "sharding": "hybrid_zero2",
                "precision": "bf16",
                "gradient_checkpointing": True,
            },
            "bfloat16",
        ),
        ({"backend": "fsdp", "sharding": "full", "precision": "fp16", "max_shard_size": "100KB"}, "float16"),
        (
            {"backend": "deepspeed", "zero_stage": 1, "offload_optimizer": True, "precision": "bf16"},
            "bfloat16",
        ),
        ({"backend": "fsdp", "sharding": "none", "precision": "fp16"}, "float16"),
    ],
    ids=[
        "fsdp-hybrid_zero2-bf16-checkpointing",
        "fsdp-fp16-sharded-export",
        "deepspeed1-offload-bf16",
        "ddp-fp16-autocast",
    ],
)
def test_other_modes_train(tiny_model_dir, site_manifest, tmp_path, options, dtype):
    from safetensors import safe_open

    run_training(tiny_model_dir, site_manifest, tmp_path, {**options, "dtype": dtype})
    model = tmp_path / "model"
    assert_loss_falls(model)
    summary = json.loads((model / "training.json").read_text())
    assert summary["precision"] == options.get("precision", "fp32") and summary["dtype"] == dtype
    files = sorted(model.glob("*.safetensors"))
    with safe_open(files[0], "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == getattr(torch, dtype)
    if "max_shard_size" in options:
        assert len(files) > 1 and (model / "model.safetensors.index.json").is_file()
