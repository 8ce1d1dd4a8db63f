"""A GPU the torch build has no kernels for (a V100 under a CUDA 12.8/13.0 wheel) stops train and evaluate
at start with an error naming the GPU, its sm_XY, the build and what to install. No GPU here: the
torch.cuda queries are replaced by a V100's answers."""

from __future__ import annotations

import pytest
import torch

from fedtune.core import accelerators
from fedtune.core.accelerators import UnsupportedDeviceError, check_device
from fedtune.evaluate import scores as evaluate
from fedtune.train import distributed

# What the default torch 2.13 wheel (CUDA 13.0) reports: no sm_70.
NO_VOLTA = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


@pytest.fixture
def fake_gpu(monkeypatch):
    """One visible GPU with the given capability, name and build arch list."""

    def install(capability=(7, 0), name="Tesla V100-SXM2-16GB", arch_list=NO_VOLTA):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
        monkeypatch.setattr(torch.version, "cuda", "13.0")

    return install


def test_a_v100_under_a_build_without_sm70_is_refused_naming_gpu_build_and_fix(fake_gpu):
    fake_gpu()
    with pytest.raises(UnsupportedDeviceError) as error:
        check_device("cuda:0")
    message = str(error.value)
    assert "Tesla V100-SXM2-16GB" in message and "sm_70" in message, message
    assert f"torch {torch.__version__} (CUDA 13.0)" in message and "sm_80" in message, message
    assert "cu126" in message, message  # the build that still drives Volta


@pytest.mark.parametrize(
    "capability, arch_list",
    [
        ((8, 0), NO_VOLTA),  # A100: its own cubin
        ((8, 9), ["sm_80", "sm_86"]),  # a cubin of the same major, older minor runs (binary compatible)
        ((12, 1), ["sm_90", "compute_90"]),  # PTX of an older architecture is compiled by the driver
        ((7, 0), ["sm_50", "sm_60", "sm_70", "sm_80"]),  # a CUDA 12.6 build
    ],
)
def test_gpus_the_build_covers_pass(fake_gpu, capability, arch_list):
    fake_gpu(capability=capability, arch_list=arch_list)
    check_device("cuda")


def test_a_newer_gpu_than_the_build_without_ptx_is_refused(fake_gpu):
    fake_gpu(capability=(12, 0), name="NVIDIA B200", arch_list=["sm_80", "sm_90"])
    with pytest.raises(UnsupportedDeviceError, match=r"NVIDIA B200, sm_120"):
        check_device("cuda")


def test_cpu_is_never_checked(fake_gpu):
    fake_gpu()
    check_device("cpu")
    check_device(torch.device("cpu"))


def test_training_start_refuses_the_gpu_as_a_launch_error(fake_gpu):
    """train maps LaunchError to exit 2 with one line; the check runs where the device is chosen,
    before the process group (and before any model is loaded)."""
    fake_gpu()
    with pytest.raises(distributed.LaunchError, match=r"Tesla V100-SXM2-16GB, sm_70\) is not supported"):
        distributed.pick_device("auto", local_rank=0)


def test_evaluate_refuses_the_gpu_with_exit_2_before_loading_the_model(fake_gpu, tmp_path, capsys):
    fake_gpu()
    code = evaluate.main(
        [
            "--model",
            str(tmp_path / "no-model"),
            "--data",
            str(tmp_path / "no-data"),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 2
    assert "sm_70" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    ("built", "driver", "refused"),
    [("13.0", 12040, True), ("13.0", 13000, False), ("12.6", 12020, False), ("12.6", 11080, True)],
)
def test_a_driver_too_old_for_the_build_is_refused_naming_both(monkeypatch, built, driver, refused):
    """CUDA 13.0 wheels need a driver of CUDA 13 (>= 580.65.06), 12.6 wheels one of CUDA 12 (>= 525.60.13):
    checked at start on any device, since torch sees no GPU under a driver too old for it."""
    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(accelerators, "_driver_cuda_version", lambda: driver)
    if not refused:
        check_device("cpu")
        return
    with pytest.raises(UnsupportedDeviceError) as error:
        check_device("cpu")
    message = str(error.value)
    need = {"13.0": "580.65.06", "12.6": "525.60.13"}[built]
    assert f"supports CUDA {driver // 1000}.{driver % 1000 // 10}" in message, message
    assert f"built for CUDA {built}, which needs a driver >= {need}" in message, message
    assert "FEDTUNE_CLUSTER" in message, message


def test_a_cpu_build_or_a_node_without_driver_is_not_checked(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(accelerators, "_driver_cuda_version", lambda: 12040)
    check_device("cpu")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(accelerators, "_driver_cuda_version", lambda: 0)
    check_device("cpu")


def test_train_stops_at_start_under_a_driver_too_old_instead_of_training_on_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(accelerators, "_driver_cuda_version", lambda: 12040)
    with pytest.raises(distributed.LaunchError, match="needs a driver >= 580.65.06"):
        distributed.pick_device("auto", 0)


@pytest.mark.parametrize(
    ("cluster", "index"),
    [("iris", "https://download.pytorch.org/whl/cu126"), ("leonardo", "https://download.pytorch.org/whl/cu126"),
     ("karolina", "https://download.pytorch.org/whl/cu126"), ("", None), ("slurm-local", None)],
)  # fmt: skip
def test_setup_env_installs_the_torch_build_of_each_cluster(cluster, index):
    """The same torch version everywhere; the CUDA 12.6 build on the GPU clusters (sm_70 kernels for Iris,
    drivers >= 525.60.13 for all), the PyPI default elsewhere."""
    import os
    import subprocess

    from .workflow_harness import ROOT

    result = subprocess.run(
        [str(ROOT / "scripts" / "setup-env"), "--print-torch"],
        env={**os.environ, "FEDTUNE_CLUSTER": cluster}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["torch==2.13.0", *(["--index-url", index] if index else [])]
