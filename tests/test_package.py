"""An installed fedtune stands alone: the wheel carries its schemas, and a scratch venv with only the wheel
(its dependencies taken from the test environment) validates a config outside the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECK = """
import fedtune, json
from fedtune.core.options import ConfigError
from fedtune.run.config import build_run_config
config = {
    "run": "wheel", "model": {"source": "hf", "name": "org/model"},
    "sites": {"a": {"dataset": {"source": "hf", "name": "org/data"}}},
}
run = build_run_config(config)
try:
    build_run_config({**config, "federation": {"rounds": 0}})
except ConfigError as error:
    message = str(error)
print(json.dumps({"file": fedtune.__file__, "backend": run.sites["a"].train.backend, "error": message}))
"""


def test_the_wheel_ships_its_schemas_and_validates_a_config(tmp_path):
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "fedtune", source / "fedtune", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, source],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = wheels.glob("fedtune-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(name).name for name in names if name.startswith("fedtune/schemas/")}
    assert shipped == {path.name for path in (ROOT / "fedtune" / "schemas").glob("*.schema.yaml")}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel],
        check=True,
    )  # fmt: skip
    # Dependencies from the test environment, appended after the venv's own site-packages: a path line
    # in a .pth file adds the folder but runs none of its .pth files (so not the editable fedtune's).
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())  # fmt: skip
    (site / "test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    out = subprocess.run(
        [python, "-c", CHECK], capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}
    )
    assert out.returncode == 0, out.stderr
    result = __import__("json").loads(out.stdout)
    assert Path(result["file"]).is_relative_to(venv), result["file"]
    assert result["backend"] == "fsdp"  # a default filled in from the shipped train schema
    assert "federation.rounds" in result["error"]
