"""fedtune.downstream: the project's lm-eval task on local files, offline, scored on a tiny model;
the scores equal what the lm_eval CLI prints for the same model, task and settings."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from .workflow_harness import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval missing: pip install -e '.[downstream]'"
)
LIMIT = "12"


def offline_env(tmp_path) -> dict:
    return dict(
        os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"), TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip


@pytest.mark.slow
def test_project_task_scores_equal_the_lm_eval_cli(tiny_model_dir, tmp_path):
    env = offline_env(tmp_path)
    common = ["--include_path", "workflow/tasks", "--tasks", "fedtune_demo_alpha", "--device", "cpu"]
    cli = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={tiny_model_dir}",
         *common, "--batch_size", "4", "--limit", LIMIT, "--output_path", str(tmp_path / "cli")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    (results_file,) = (tmp_path / "cli").rglob("results_*.json")
    expected = json.loads(results_file.read_text())["results"]["fedtune_demo_alpha"]

    out = tmp_path / "scores.json"
    ours = subprocess.run(
        [sys.executable, "-m", "fedtune.downstream", "--model", str(tiny_model_dir), "--include-path",
         "workflow/tasks", "--tasks", "fedtune_demo_alpha", "--device", "cpu", "--batch-size", "4",
         "--limit", LIMIT, "--label", "base", "--round", "0", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["model"], result["round"]) == ("base", 0)
    scores = result["tasks"]["fedtune_demo_alpha"]
    assert set(scores) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    for metric, value in scores.items():
        assert value == expected[f"{metric},none"], metric
    # A tiny random model is far from perfect on real text: the score is a real measurement.
    assert scores["bits_per_byte"] > 1


def test_unknown_task_and_missing_folder_are_named(tiny_model_dir, tmp_path):
    from fedtune.downstream import DownstreamError, run_tasks

    with pytest.raises(DownstreamError, match="--tasks: unknown .*no_such_task"):
        run_tasks(tiny_model_dir, ["no_such_task"], include_path=[ROOT / "workflow" / "tasks"])
    with pytest.raises(DownstreamError, match="--include-path: .*nowhere"):
        run_tasks(tiny_model_dir, ["fedtune_demo_alpha"], include_path=[tmp_path / "nowhere"])
    with pytest.raises(DownstreamError, match="--model: .*holds no config.json"):
        run_tasks(tmp_path, ["fedtune_demo_alpha"])
