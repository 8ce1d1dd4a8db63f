"""LoRA adapters in the train stage (train.adapter): only the adapter trains, checkpoints and resumes, on
FSDP2, DDP and DeepSpeed ZeRO; the export is a PEFT folder that peft loads."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from tests.train_runs import (
    BASE_OPTIONS,
    REFERENCE_OPTIONS,
    RUN_TIMEOUT,
    free_port,
    kill_tree,
    launch,
    losses,
    run_training,
    train_args,
    wait_for,
)

pytest_plugins = ["tests.train_fixtures"]

ADAPTER = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
ADAPTER_OPTIONS = REFERENCE_OPTIONS | {"adapter": ADAPTER, "lr": 0.01}
LAYERS = 2  # tests/conftest.py's tiny model


def adapter_tensors(model_out):
    from safetensors.torch import load_file

    return load_file(model_out / "adapter_model.safetensors")


def assert_same_adapter(run, reference, tolerance):
    assert losses(run) == pytest.approx(losses(reference), abs=tolerance)
    mine, theirs = adapter_tensors(run), adapter_tensors(reference)
    assert sorted(mine) == sorted(theirs)
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], atol=tolerance, rtol=0, msg=name)


@pytest.fixture(scope="module")
def adapter_run(tiny_model_dir, site_manifest, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run-adapter-fsdp")
    run_training(tiny_model_dir, site_manifest, run_dir, ADAPTER_OPTIONS)
    return run_dir


def test_fsdp_adapter_exports_a_peft_folder_that_peft_loads(adapter_run, reference_run, tiny_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = adapter_run / "model"
    assert {p.name for p in out.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "training.json", "loss.csv",
    }  # fmt: skip
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).stat().st_mode & 0o044 == 0o044, name  # readable by the group and others
    tensors = adapter_tensors(out)
    # One A and one B per adapted projection and layer, and nothing of the frozen base.
    assert len(tensors) == 2 * 2 * LAYERS
    assert all(".lora_A." in name or ".lora_B." in name for name in tensors)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (
        config["r"] == 4
        and config["lora_alpha"] == 8
        and set(config["target_modules"]) == {"q_proj", "v_proj"}
    )

    # The adapter starts as a no-op (B = 0): its first loss is the base model's, which the full
    # fine-tuning reference also starts from on the same blocks.
    assert losses(out)[0] == pytest.approx(losses(reference_run / "model")[0], abs=1e-6)
    assert losses(out)[-1] < losses(out)[0]

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, str(out)).merge_and_unload().state_dict()
    changed = {name for name in base_state if not torch.equal(merged[name], base_state[name])}
    assert changed == {
        f"model.layers.{i}.self_attn.{proj}.weight" for i in range(LAYERS) for proj in ("q_proj", "v_proj")
    }
    assert load_file(tiny_model_dir / "model.safetensors").keys() == base_state.keys()

    summary = json.loads((out / "training.json").read_text())
    assert summary["steps"] == BASE_OPTIONS["max_steps"] and summary["options"]["adapter"]["r"] == 4


def test_adapter_checkpoints_hold_the_adapter_only(adapter_run):
    from torch.distributed.checkpoint import FileSystemReader

    step = adapter_run / "checkpoints" / "step-00000003" / "fsdp"
    keys = list(FileSystemReader(str(step)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert not any("embed_tokens" in k or "mlp" in k for k in keys)


# The same steps on the other backends: DDP (sharding none) and ZeRO-2 hold the frozen base whole beside
# the adapter; only the reduction order differs. ZeRO-3's partitions: the resume test below.
@pytest.mark.parametrize(
    "options", [{"sharding": "none"}, {"backend": "deepspeed", "zero_stage": 2}], ids=["ddp", "zero2"]
)
def test_every_backend_trains_the_same_adapter(tiny_model_dir, site_manifest, adapter_run, tmp_path, options):
    run_training(tiny_model_dir, site_manifest, tmp_path, ADAPTER_OPTIONS | options)
    assert_same_adapter(tmp_path / "model", adapter_run / "model", tolerance=1e-5)


def test_bf16_adapter_trains(tiny_model_dir, site_manifest, tmp_path):
    run_training(
        tiny_model_dir, site_manifest, tmp_path, ADAPTER_OPTIONS | {"precision": "bf16", "sharding": "hybrid"}
    )
    values = losses(tmp_path / "model")
    assert all(v == v for v in values) and values[-1] < values[0]
    assert all(t.dtype == torch.float32 for t in adapter_tensors(tmp_path / "model").values())


# ZeRO-3 resumed is compared with the FSDP run: it trains the same adapter, across a restart.
@pytest.mark.parametrize("options", [{}, {"backend": "deepspeed", "zero_stage": 3}], ids=["fsdp", "zero3"])
def test_killed_adapter_training_resumes_to_the_same_adapter(
    tiny_model_dir, site_manifest, adapter_run, tmp_path, options
):
    run_options = ADAPTER_OPTIONS | options
    proc = launch(train_args(tiny_model_dir, site_manifest, tmp_path, run_options), wait=False)
    try:
        wait_for((tmp_path / "checkpoints" / "step-00000003").is_dir, proc, timeout=RUN_TIMEOUT)
    finally:
        kill_tree(proc, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "model").exists()
    result = run_training(tiny_model_dir, site_manifest, tmp_path, run_options)
    assert "resumed from" in result.stdout
    tolerance = 1e-6 if not options else 1e-5  # ZeRO-3 against the FSDP run: another reduction order
    assert_same_adapter(tmp_path / "model", adapter_run / "model", tolerance=tolerance)


def test_quantized_adapter_is_refused_on_cpu(tiny_model_dir, site_manifest, tmp_path):
    import subprocess

    from tests.train_runs import env

    adapter = ADAPTER | {"quantize": "4bit"}
    # device auto: the job finds no CUDA device at start, before it loads the model.
    options = ADAPTER_OPTIONS | {"adapter": adapter, "processes_per_node": 1, "sharding": "none"}
    result = subprocess.run(
        train_args(tiny_model_dir, site_manifest, tmp_path, options), capture_output=True, text=True,
        env=env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())), timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "train.adapter.quantize: 4bit (QLoRA) needs a CUDA device" in result.stderr
    assert not (tmp_path / "model").exists()
