"""Rounds of a federation through the real workflow: Snakemake killed between rounds 2 and 3 (the server
optimizer's state already written, round 3 training) and started again ends with a round-3 model bit for
bit equal to an uninterrupted run's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from .workflow_harness import ROOT, VENV_BIN, demo_config, snakemake, write_config

ROUND3 = "results/demo/round-3/aggregate/model"


def small_federation() -> dict:
    config = demo_config()
    for site in config["sites"].values():
        site["dataset"]["max_documents"] = 300
    config["tokenize"]["shards"] = 1
    config["train"].update(max_steps=4, checkpoint_every=2, processes_per_node=1, micro_batch=8)
    config["federation"] = {"rounds": 3}
    config["aggregate"] = {"server_optimizer": {"name": "fedadam", "lr": 0.05}}
    return config


@pytest.mark.slow
def test_killed_between_rounds_two_and_three_ends_with_the_same_round_three_model(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    for workdir in (whole, killed):
        workdir.mkdir()
        write_config(workdir, small_federation())
    snakemake(whole, ROUND3)
    # The same data, base model and round 1 (copied with their times): rounds 2 and 3 run again.
    for part in ("data", "model", "round-1"):
        shutil.copytree(
            whole / "results/demo" / part, killed / "results/demo" / part, copy_function=shutil.copy2
        )

    command = [
        f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(killed),
        "--configfile", str(killed / "config.yaml"), "--profile", str(ROOT / "profiles" / "local"), ROUND3,
    ]  # fmt: skip
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    proc = subprocess.Popen(
        command,
        cwd=killed,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state = killed / "results/demo/round-2/aggregate/server_state"
    deadline = time.time() + 900
    while not state.is_dir():
        assert proc.poll() is None, "Snakemake ended before round 2's aggregate"
        assert time.time() < deadline, "round 2's aggregate never came"
        time.sleep(0.2)
    time.sleep(1.0)  # round 3's training jobs start
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / ROUND3).exists()

    # SIGKILL leaves Snakemake's lock behind: --unlock first, then the profile's --rerun-incomplete.
    snakemake(killed, "--unlock")
    snakemake(killed, ROUND3)
    for name in ("model.safetensors", "config.json"):
        assert (killed / ROUND3 / name).read_bytes() == (whole / ROUND3 / name).read_bytes(), name
    states = sorted((whole / "results/demo/round-3/aggregate/server_state").glob("*.safetensors"))
    assert states
    for path in states:
        again = killed / "results/demo/round-3/aggregate/server_state" / path.name
        assert again.read_bytes() == path.read_bytes(), path.name
