"""The speed options of the train stage (fedtune.train.speed, wired in by fedtune.train.backends and fedtune.train.loop) on
CPU: per-layer torch.compile and selective activation checkpointing train to the losses of the plain
FSDP reference run, the optimizer is foreach AdamW on CPU, and the optimizer step hands the gradient norm
back as a device tensor, for the one host sync of the step."""

from __future__ import annotations

import json

import pytest
import torch

from tests.train_runs import REFERENCE_OPTIONS, losses, run_training

pytest_plugins = ["tests.train_fixtures"]


def grad_norms(model_out) -> list[float]:
    import csv

    with open(model_out / "loss.csv") as stream:
        return [float(row["grad_norm"]) for row in csv.DictReader(stream)]


def test_compiled_layers_train_like_eager(tiny_model_dir, site_manifest, reference_run, tmp_path):
    # Inductor itself (the default backend), as on a GPU: compiling the tiny model takes ~30 s here.
    # FSDP2, the mode the GPU goal names; DDP wraps the same compiled layers (not run here: suite time).
    options = {**REFERENCE_OPTIONS, "compile": True}
    run = run_training(tiny_model_dir, site_manifest, tmp_path, options)
    assert "layers: activation checkpointing of [], 2 compiled" in run.stdout
    summary = json.loads((tmp_path / "model" / "training.json").read_text())
    assert summary["options"]["compile"] is True
    # Inductor fuses the layer's operations and accumulates its reductions in another order: fp32
    # rounding differs by ~1e-7 relative per operation and grows a little over 8 Adam steps (measured:
    # at most 1e-6, the last digit loss.csv prints, on losses near 5). 1e-4 leaves room for another
    # machine's kernels and is still far below what a wrong gradient moves (each step lowers the loss by
    # 0.1-0.25).
    assert losses(tmp_path / "model") == pytest.approx(losses(reference_run / "model"), abs=1e-4)
    assert grad_norms(tmp_path / "model") == pytest.approx(grad_norms(reference_run / "model"), rel=1e-4)


def test_selective_checkpointing_trains_like_none(tiny_model_dir, site_manifest, reference_run, tmp_path):
    # Every second layer of two: layer 0 is recomputed in backward, layer 1 keeps its activations.
    options = {**REFERENCE_OPTIONS, "gradient_checkpointing": 2}
    run = run_training(tiny_model_dir, site_manifest, tmp_path, options)
    assert "layers: activation checkpointing of [0], 0 compiled" in run.stdout
    # Recomputation repeats the same operations in the same order: the same numbers.
    assert losses(tmp_path / "model") == pytest.approx(losses(reference_run / "model"), abs=1e-6)
    assert grad_norms(tmp_path / "model") == pytest.approx(grad_norms(reference_run / "model"), abs=1e-6)


def test_options_reach_the_backend(monkeypatch, tiny_model_dir):
    """In one process: foreach AdamW on CPU, the layers checkpointed as asked, and a step that returns
    the norm as a tensor (reading it as a float would wait for the device a second time per step)."""
    from fedtune.core.models import load_model
    from fedtune.train import backends, distributed, speed
    from fedtune.train.options import TrainOptions
    from tests.train_runs import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    options = TrainOptions.from_mapping(
        {"processes_per_node": 1, "micro_batch": 2, "global_batch": 2, "gradient_checkpointing": 1}
    )
    job = distributed.start("cpu")
    try:
        model = load_model(tiny_model_dir, dtype="float32")
        backend = backends.build(model, options, job, accumulation=1)
        assert backend.optimizer.defaults["foreach"] is True
        assert backend.optimizer.defaults["fused"] in (None, False)
        assert [layer.gradient_checkpointing for layer in speed.decoder_layers(backend.model)] == [True, True]
        ids = torch.randint(100, (2, 16), generator=torch.Generator().manual_seed(0))
        backend.forward_backward(ids, ids, 1.0, last=True)
        norm = backend.step(1e-3)
        assert isinstance(norm, torch.Tensor) and norm.ndim == 0 and float(norm) > 0
    finally:
        distributed.stop()


def test_adamw_is_fused_on_cuda():
    from fedtune.train import backends
    from fedtune.train.options import TrainOptions

    model = torch.nn.Linear(4, 4)
    cuda = backends.adamw(model, TrainOptions.from_mapping({}), torch.device("cuda", 0))
    assert cuda.defaults["fused"] is True and not cuda.defaults["foreach"]


def test_compile_is_refused_with_deepspeed():
    from fedtune.core.options import ConfigError
    from fedtune.train.options import TrainOptions

    with pytest.raises(ConfigError, match="compile: needs backend fsdp"):
        TrainOptions.from_mapping({"backend": "deepspeed", "compile": True})


@pytest.mark.parametrize(("value", "every"), [(False, 0), (True, 1), (1, 1), (3, 3)])
def test_gradient_checkpointing_takes_a_flag_or_a_layer_interval(value, every):
    from fedtune.train.options import TrainOptions

    assert TrainOptions.from_mapping({"gradient_checkpointing": value}).checkpoint_layers_every == every


def test_gradient_checkpointing_refuses_zero_layers():
    from fedtune.core.options import ConfigError
    from fedtune.train.options import TrainOptions

    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        TrainOptions.from_mapping({"gradient_checkpointing": 0})
