"""Faults and unsafe input around the data stages: a killed Snakemake, a full disk, a hostile prompt
template, secrets in the environment. Nothing half-written is ever taken as complete."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from fedtune.core.atomic import atomic_dir
from fedtune.core.secrets import redact

from .workflow_harness import ROOT, VENV_BIN, demo_config, job_counts, snakemake, write_config

SHARDS = [f"results/demo/data/{site}/{split}/shard-{k}" for site in ("alpha", "beta") for split in ("train", "test") for k in (0, 1)]  # fmt: skip


def test_atomic_dir_failure_keeps_the_previous_result_and_cleans_up(tmp_path):
    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("first")
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "a").write_text("second, half")
        raise RuntimeError("writer died")
    assert (target / "a").read_text() == "first"
    # What SIGKILL leaves behind is removed by the next writer of the same path.
    (tmp_path / ".out.tmp-killed").mkdir()
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("third")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (target / "a").read_text() == "third"


def test_full_disk_during_tokenize_fails_cleanly(tiny_model_dir, tmp_path):
    from datasets import Dataset, DatasetDict

    raw = tmp_path / "raw"
    DatasetDict({"train": Dataset.from_dict({"text": ["some words here"] * 3000})}).save_to_disk(str(raw))
    out = tmp_path / "shard-0"
    out.mkdir()
    (out / "previous.txt").write_text("an earlier result")

    def small_disk():
        # Writes past 64 KiB fail with EFBIG, as a full disk fails with ENOSPC.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    result = subprocess.run(
        [sys.executable, "-m", "fedtune.tokenize", "shard", "--raw", str(raw), "--split", "train",
         "--shard", "0", "--num-shards", "1", "--tokenizer", str(tiny_model_dir), "--block-size", "32",
         "--out", str(out)],
        preexec_fn=small_disk, capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and "File too large" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "shard-0"]
    assert (out / "previous.txt").read_text() == "an earlier result"


def test_redact_masks_tokens_from_the_environment_and_by_shape(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-value-1234")
    text = "fetch failed with secret-value-1234 and hf_abcdefghijklmnopqrstuvwxyz123"
    assert redact(text) == "fetch failed with hf_*** and hf_***"


def test_models_load_without_remote_code_by_default(tiny_model_dir, monkeypatch):
    import transformers

    from fedtune.core.models import load_causal_lm

    seen = {}
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_causal_lm(tiny_model_dir)
    assert seen["trust_remote_code"] is False and seen["use_safetensors"] is True


@pytest.fixture
def hostile_workdir(tmp_path):
    config = demo_config()
    del config["sites"]["beta"]
    config["sites"]["alpha"]["dataset"]["max_documents"] = 40
    config["tokenize"]["shards"] = 1
    config["sites"]["alpha"]["prompt_template"] = "$(touch PWNED) `touch PWNED2`; echo 'x' \" {text}"
    write_config(tmp_path, config)
    return tmp_path


def test_hostile_template_and_a_token_in_the_environment(hostile_workdir, monkeypatch):
    token = "hf_" + "Q" * 34
    monkeypatch.setenv("HF_TOKEN", token)
    snakemake(hostile_workdir, "results/demo/data/alpha/train/shard-0")
    assert not list(hostile_workdir.rglob("PWNED*")), "a config value reached the shell unquoted"
    from datasets import load_from_disk

    from fedtune.core.models import load_tokenizer

    tokenizer = load_tokenizer(hostile_workdir / "results/demo/model/base")
    first = load_from_disk(str(hostile_workdir / "results/demo/data/alpha/train/shard-0"))[0]["input_ids"]
    assert tokenizer.decode(first, skip_special_tokens=True).startswith("$(touch PWNED) `touch PWNED2`; echo")
    for path in hostile_workdir.rglob("*"):
        if path.is_file() and path.stat().st_size < 50_000_000:
            assert token.encode() not in path.read_bytes(), f"the token leaked into {path}"


def registered(workdir):
    """Shards that are complete and that Snakemake has recorded as finished (metadata written, no
    incomplete marker): a job killed between the two is rightly redone by --rerun-incomplete."""
    from base64 import urlsafe_b64encode

    def record(kind, shard):
        return workdir / ".snakemake" / kind / urlsafe_b64encode(shard.encode()).decode()

    return [
        s
        for s in SHARDS
        if (workdir / s / "counts.json").exists()
        and record("metadata", s).exists()
        and not record("incomplete", s).exists()
    ]


def test_killed_snakemake_reruns_only_what_was_not_finished(tmp_path):
    config = demo_config()
    for site in config["sites"].values():
        site["dataset"]["max_documents"] = 200
    write_config(tmp_path, config)
    snakemake(tmp_path, "results/demo/model/base")  # downloads done; what follows is tokenize only

    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    command = [f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
               "--configfile", str(tmp_path / "config.yaml"), "--profile", str(ROOT / "profiles" / "local"),
               "--cores", "2", *SHARDS]  # fmt: skip
    run = subprocess.Popen(command, cwd=tmp_path, env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 600
    while time.time() < deadline and run.poll() is None and not registered(tmp_path):
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    finished = registered(tmp_path)
    assert finished, "no shard finished before the deadline"
    # A shard folder is either complete or absent: never half-written under its real name.
    for shard in SHARDS:
        if (tmp_path / shard).exists():
            assert (tmp_path / shard / "counts.json").exists(), shard
    stamps = {s: (tmp_path / s / "counts.json").stat().st_mtime_ns for s in finished}

    plan = job_counts(snakemake(tmp_path, "-n", "--rerun-incomplete", *SHARDS).stdout)
    assert plan.get("tokenize", 0) == len(SHARDS) - len(finished)
    # SIGKILL leaves Snakemake's lock behind; --unlock is the documented first step after one.
    snakemake(tmp_path, "--unlock")
    snakemake(tmp_path, "--rerun-incomplete", *SHARDS)
    for shard in SHARDS:
        assert (tmp_path / shard / "counts.json").exists()
    assert {s: (tmp_path / s / "counts.json").stat().st_mtime_ns for s in finished} == stamps
    assert not list(tmp_path.rglob(".shard-*.tmp-*"))
