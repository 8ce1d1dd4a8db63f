"""The software environments for the clusters (envs/) install exactly pyproject's pins."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def conda_env() -> dict:
    return yaml.safe_load((ROOT / "envs" / "fedtune.yaml").read_text())


def test_conda_env_pins_equal_pyproject_pins():
    pins = pyproject()["dependencies"]
    (pip_section,) = [item for item in conda_env()["dependencies"] if isinstance(item, dict)]
    assert sorted(pip_section["pip"]) == sorted(pins)
    assert len(set(pip_section["pip"])) == len(pip_section["pip"])
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", pin) for pin in pins), pins


def test_conda_env_python_matches_requires_python():
    conda_packages = [item for item in conda_env()["dependencies"] if isinstance(item, str)]
    assert "pip" in conda_packages
    (python,) = [item for item in conda_packages if item.startswith("python")]
    assert python == "python=3.11"
    assert pyproject()["requires-python"] == ">=3.11,<3.12"


def test_apptainer_definition_installs_pyprojects_pins_on_an_nvidia_pytorch_image():
    definition = (ROOT / "envs" / "fedtune.def").read_text()
    assert re.search(r"^Bootstrap: docker$", definition, re.M)
    assert re.search(r"^From: nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3$", definition, re.M)
    # The pins come from the copied pyproject.toml, never from a second list that could drift.
    assert re.search(r"^\s+pyproject\.toml /opt/fedtune/src/pyproject\.toml$", definition, re.M)
    assert 'pip" install --quiet /opt/fedtune/src' in definition
    assert not re.findall(r"[A-Za-z0-9_-]+==\d", definition)
    assert "uv venv --python 3.11" in definition and "uv python install 3.11" in definition


def test_apptainer_definition_takes_the_torch_build_as_a_build_argument():
    """Iris's V100s need a CUDA 12.6 torch build (the default wheel has no sm_70): the image takes the
    index as a build argument, used only for torch, and envs/README.md names each cluster's build."""
    definition = (ROOT / "envs" / "fedtune.def").read_text()
    assert re.search(r"^%arguments\n(\s+#.*\n)*\s+TORCH_INDEX_URL=$", definition, re.M), definition
    assert 'torch_index="{{ TORCH_INDEX_URL }}"' in definition
    assert '${torch_index:+--index-url "$torch_index"} "$torch_pin"' in definition
    readme = (ROOT / "envs" / "README.md").read_text()
    for cluster in ("Leonardo", "Karolina", "MeluXina", "Iris"):
        assert re.search(rf"^\| {cluster} \|", readme, re.M), cluster
    assert "whl/cu126" in readme and "sm_70" in readme


def test_iris_conda_env_is_the_same_but_for_the_cuda_12_6_torch():
    """envs/fedtune-cu126.yaml: the same pins, torch from PyTorch's CUDA 12.6 index (V100 kernels)."""
    iris = yaml.safe_load((ROOT / "envs" / "fedtune-cu126.yaml").read_text())
    (default_pip,) = [item["pip"] for item in conda_env()["dependencies"] if isinstance(item, dict)]
    (iris_pip,) = [item["pip"] for item in iris["dependencies"] if isinstance(item, dict)]
    assert "--extra-index-url https://download.pytorch.org/whl/cu126" in iris_pip
    expected = [
        pin.replace("torch==2.13.0", "torch==2.13.0+cu126") if pin.startswith("torch==") else pin
        for pin in default_pip
    ]
    assert sorted(p for p in iris_pip if not p.startswith("--")) == sorted(expected)
    assert [d for d in iris["dependencies"] if not isinstance(d, dict)] == [
        d for d in conda_env()["dependencies"] if not isinstance(d, dict)
    ]
