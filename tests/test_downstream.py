"""Downstream tasks (evaluate.tasks, fedtune.evaluate.downstream, lm-eval): the config's checks, the DAG's wiring,
and the download stage's copy of a task read offline, whose scores equal what the lm_eval CLI prints for
the same model, task and settings. The workflow run that scores the demo's models and tables them in the
report is tests/test_demo.py's."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

import pytest

from fedtune.core.lm_eval_tasks import downstream_tasks
from fedtune.core.options import ConfigError
from fedtune.evaluate.options import EvaluateOptions
from fedtune.run.config import build_run_config

from .workflow_harness import ROOT, demo_config, dry_run, snakemake, write_config

needs_lm_eval = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval missing: pip install -e '.[downstream]'"
)
LIMIT = "12"
PROJECT_TASK = "workflow/tasks/fedtune_demo_alpha.yaml"


def offline_env(tmp_path) -> dict:
    return dict(
        os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"), TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip


def lm_eval_cli(model, tmp_path, *args) -> dict:
    """The lm_eval CLI's results of the model, offline, as {task: {"metric,filter": value}}."""
    cli = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model}",
         "--device", "cpu", "--output_path", str(tmp_path / "cli"), *args],
        cwd=ROOT, env=offline_env(tmp_path), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    (results_file,) = (tmp_path / "cli").rglob("results_*.json")
    return json.loads(results_file.read_text())["results"]


def with_tasks(tasks, **evaluate) -> dict:
    config = demo_config()
    config["evaluate"].update(tasks=tasks, **evaluate)
    return config


@needs_lm_eval
@pytest.mark.slow
def test_copied_task_read_offline_scores_as_the_lm_eval_cli(tiny_model_dir, tmp_path):
    """A user's task YAML on local files, prepared as the download stage does; with the original files
    gone, the offline scoring reads the run folder's copy and gives the lm_eval CLI's scores."""
    expected = lm_eval_cli(
        tiny_model_dir, tmp_path, "--include_path", "workflow/tasks", "--tasks", "fedtune_demo_alpha",
        "--batch_size", "4", "--limit", LIMIT,
    )["fedtune_demo_alpha"]  # fmt: skip

    user = tmp_path / "user"
    (user / "data").mkdir(parents=True)
    shutil.copy(ROOT / "data" / "demo" / "alpha" / "test.jsonl", user / "data" / "test.jsonl")
    task = (ROOT / PROJECT_TASK).read_text().replace("data/demo/alpha/test.jsonl", "data/test.jsonl")
    (user / "mytask.yaml").write_text(task)
    prepared = subprocess.run(
        [sys.executable, "-m", "fedtune.download", "tasks", "--tasks", "mytask.yaml", "--out", "run/tasks"],
        cwd=user, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    record = json.loads((user / "run" / "tasks" / "tasks.json").read_text())
    assert record["tasks"][0]["name"] == "fedtune_demo_alpha"
    assert record["tasks"][0]["documents"] == {"fedtune_demo_alpha": {"test": 200}}
    shutil.rmtree(user / "data")
    (user / "mytask.yaml").unlink()

    out = user / "run" / "base.csv"
    ours = subprocess.run(
        [sys.executable, "-m", "fedtune.evaluate.downstream", "--model", str(tiny_model_dir), "--tasks-dir", "run/tasks",
         "--device", "cpu", "--options", json.dumps({"batch_size": 4, "task_limit": int(LIMIT)}), "--label", "base", "--round", "0",
         "--out", str(out)],
        cwd=user, env=offline_env(tmp_path), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    import pandas as pd

    scores = pd.read_csv(out)
    assert set(scores["model"]) == {"base"} and set(scores["round"]) == {0}
    assert set(scores["entry"]) == set(scores["task"]) == {"fedtune_demo_alpha"}
    assert set(scores["metric"]) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    for metric, value in zip(scores["metric"], scores["value"], strict=True):
        assert value == expected[f"{metric},none"], metric
    # A tiny random model is far from perfect on real text: the score is a real measurement.
    assert scores.set_index("metric").loc["bits_per_byte", "value"] > 1


@needs_lm_eval
def test_a_task_yamls_includes_functions_and_data_are_copied(tmp_path, monkeypatch):
    """A task that includes a base YAML and names a `!function` of the module beside it: the copy holds
    all three and its data, and lm-eval loads it from there (prepare loads every task it copies)."""
    from fedtune.download.tasks import DATASETS_CACHE, prepare

    user = tmp_path / "user"
    (user / "tasks").mkdir(parents=True)
    (user / "rows.jsonl").write_text('{"text": "one two"}\n{"text": "three four five"}\n')
    (user / "tasks" / "base.yaml").write_text(
        "dataset_path: json\ndataset_kwargs:\n  data_files: {test: rows.jsonl}\ntest_split: test\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n"
    )
    (user / "tasks" / "utils.py").write_text("def keep(dataset):\n    return dataset.select([1])\n")
    (user / "tasks" / "mine.yaml").write_text(
        "include: base.yaml\ntask: mine\nprocess_docs: !function utils.keep\n"
    )
    monkeypatch.chdir(user)
    cache_before = os.environ.get("HF_DATASETS_CACHE")
    record = prepare(["tasks/mine.yaml"], "run/tasks")
    # The caller's data set cache is given back: later loads in this process do not write into the run.
    assert os.environ.get("HF_DATASETS_CACHE") == cache_before
    assert record["tasks"][0]["name"] == "mine" and record["tasks"][0]["subtasks"] == ["mine"]
    copy = user / "run" / "tasks" / "include" / "mine"
    assert sorted(p.name for p in copy.iterdir()) == ["base.yaml", "mine.yaml", "utils.py"]
    assert re.search(r"process_docs: !function '?utils.keep", (copy / "mine.yaml").read_text())
    assert "run/tasks/data/mine/base/test/0-rows.jsonl" in (copy / "base.yaml").read_text()
    assert (user / "run" / "tasks" / "data" / "mine" / "base" / "test" / "0-rows.jsonl").is_file()
    assert (user / "run" / "tasks" / DATASETS_CACHE).is_dir()


@needs_lm_eval
def test_a_task_lm_eval_cannot_load_fails_the_download_and_leaves_no_folder(tmp_path, monkeypatch):
    from fedtune.download.tasks import DownstreamError, prepare

    (tmp_path / "broken.yaml").write_text(
        (ROOT / PROJECT_TASK).read_text().replace("task: fedtune_demo_alpha", "task: broken")
        + "process_docs: !function nowhere.keep\n"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        DownstreamError, match="--tasks broken.yaml: lm-eval cannot load task broken: .*nowhere"
    ):
        prepare(["broken.yaml"], "run/tasks")
    assert not (tmp_path / "run" / "tasks").exists()


@needs_lm_eval
def test_unknown_task_and_missing_folder_are_named(tiny_model_dir, tmp_path):
    from fedtune.evaluate.downstream import DownstreamError, TaskJob, read_tasks_dir, run_tasks

    with pytest.raises(DownstreamError, match="--tasks: unknown .*no_such_task"):
        run_tasks(
            TaskJob(
                tiny_model_dir, ["no_such_task"], include_path=[ROOT / "workflow" / "tasks"], registry=False
            )
        )
    with pytest.raises(DownstreamError, match="--include-path: .*nowhere"):
        run_tasks(TaskJob(tiny_model_dir, ["fedtune_demo_alpha"], include_path=[tmp_path / "nowhere"]))
    with pytest.raises(DownstreamError, match="--model: .*holds no config.json"):
        run_tasks(TaskJob(tmp_path, ["fedtune_demo_alpha"]))
    with pytest.raises(DownstreamError, match="holds no tasks.json: the download stage"):
        read_tasks_dir(tmp_path)


@needs_lm_eval
def test_entries_resolve_to_task_yamls_shipped_tasks_and_registry_names():
    run = build_run_config(with_tasks([PROJECT_TASK, "arc_easy"]), base_dir=ROOT)
    assert [(t.name, t.yaml is None) for t in run.downstream] == [
        ("fedtune_demo_alpha", False),
        ("arc_easy", True),
    ]
    # The shipped task by name, from any working directory.
    (task,) = build_run_config(with_tasks(["fedtune_demo_alpha"]), base_dir=ROOT / "data").downstream
    assert task.yaml == ROOT / PROJECT_TASK
    assert build_run_config(demo_config(), base_dir=ROOT).downstream == ()


@needs_lm_eval
@pytest.mark.parametrize(
    ("tasks", "write", "message"),
    [
        (["nowhere/task.yaml"], {}, r"evaluate.tasks\[0\]: task YAML not found: nowhere/task.yaml"),
        (
            ["t.yaml"],
            {"t.yaml": "group: g\ntask: [a, b]\n"},
            r"evaluate.tasks\[0\]: .*t.yaml: not an lm-eval task YAML",
        ),
        (
            ["t.yaml"],
            {"t.yaml": "task: t\ndataset_path: json\ndataset_kwargs: {data_files: {test: gone.jsonl}}\n"},
            r"evaluate.tasks\[0\]: .*dataset_kwargs.data_files.test: file not found: gone.jsonl",
        ),
        (
            ["t.yaml", "fedtune_demo_alpha"],
            {"t.yaml": "task: fedtune_demo_alpha\ndataset_path: x\n"},
            r"evaluate.tasks\[1\]: fedtune_demo_alpha defines task fedtune_demo_alpha, as an earlier entry",
        ),
        (["a", "a"], {}, r"evaluate.tasks: .* non-unique"),
        ([""], {}, r"evaluate.tasks.0: '' should be non-empty"),
    ],
)
def test_bad_task_entries_are_named(tmp_path, tasks, write, message):
    for name, text in write.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        build_run_config(with_tasks(tasks), base_dir=tmp_path)


def test_tasks_need_lm_eval_and_a_language_model(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"evaluate.tasks: .*not installed: pip install -e '.\[downstream\]'"
    ):
        build_run_config(with_tasks(["arc_easy"]), base_dir=ROOT)
    options = EvaluateOptions.from_mapping({"tasks": ["arc_easy"]})
    with pytest.raises(ConfigError, match="evaluate.tasks: downstream tasks score language models"):
        downstream_tasks(options, "sequence-classification", base_dir=ROOT, source="config")
    build_run_config(demo_config(), base_dir=ROOT)  # no tasks, no lm-eval needed


@needs_lm_eval
def test_tasks_are_wired_into_the_dag_only_when_configured(tmp_path):
    """With tasks: one download, the base model and the last round's sites and aggregate scored, the report
    tables them. The perplexity jobs' commands do not change (adding a task reruns none of them)."""
    write_config(tmp_path, with_tasks([PROJECT_TASK], task_limit=5, num_fewshot=0))
    jobs = dry_run(tmp_path)
    counts = Counter(job.name for job in jobs)
    assert (counts["download_tasks"], counts["evaluate_tasks_base"], counts["evaluate_tasks_round"]) == (
        1,
        1,
        3,
    )
    rounds = demo_config()["federation"]["rounds"]
    scored = {job.wildcards["model"]: job for job in jobs if job.name == "evaluate_tasks_round"}
    assert set(scored) == {"alpha", "beta", "aggregate"}
    assert all(job.wildcards["round"] == str(rounds) for job in scored.values())
    command = " ".join(scored["aggregate"].shell.split())  # an adapter run adds --base here
    assert f"--model results/demo/round-{rounds}/aggregate/model --tasks-dir results/demo/tasks" in command
    assert """"task_limit":5,"num_fewshot":0}'""" in command and "--limit" not in command
    (report,) = [job for job in jobs if job.name == "report"]
    assert (
        "--task-names fedtune_demo_alpha" in report.shell
        and "results/demo/eval/tasks/base.csv" in report.shell
    )
    (download,) = [job for job in jobs if job.name == "download_tasks"]
    assert f"--tasks {PROJECT_TASK} --out results/demo/tasks" in download.shell
    with_perplexity = sorted(job.shell for job in jobs if job.name in ("evaluate_base", "evaluate_round"))

    write_config(tmp_path, demo_config())
    jobs = dry_run(tmp_path)
    assert not {job.name for job in jobs} & {"download_tasks", "evaluate_tasks_base", "evaluate_tasks_round"}
    assert (
        sorted(job.shell for job in jobs if job.name in ("evaluate_base", "evaluate_round"))
        == with_perplexity
    )


@needs_lm_eval
def test_a_missing_task_yaml_stops_the_workflow_before_any_job(tmp_path):
    write_config(tmp_path, with_tasks(["tasks/mine.yaml"]))
    result = snakemake(tmp_path, "-n", check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "config.yaml: evaluate.tasks[0]: task YAML not found: tasks/mine.yaml" in output, output[-2000:]


def test_an_adapter_is_scored_on_its_base_as_its_merged_model_scores(tiny_model_dir, tmp_path):
    """train.adapter: a site's adapter folder is scored on its round's start model (lm-eval's peft
    argument), the same scores as the full model with the adapter's update merged in."""
    import pandas as pd
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: a no-op adapter would prove nothing
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    wrapped.save_pretrained(tmp_path / "adapter")

    def fedtune(*args):
        result = subprocess.run(
            [sys.executable, "-m", *args], cwd=tmp_path, env=offline_env(tmp_path), capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]

    fedtune(
        "fedtune.aggregate.adapters",
        "--merge",
        "adapter",
        "--base",
        str(tiny_model_dir),
        "--out",
        "merged",
        "--options",
        "{}",
    )
    fedtune("fedtune.download.fetch", "tasks", "--tasks", str(ROOT / PROJECT_TASK), "--out", "tasks")
    score = [
        "--tasks-dir",
        "tasks",
        "--device",
        "cpu",
        "--options",
        json.dumps({"batch_size": 4, "task_limit": int(LIMIT)}),
    ]
    fedtune(
        "fedtune.evaluate.downstream",
        "--model",
        "adapter",
        "--base",
        str(tiny_model_dir),
        *score,
        "--out",
        "a.csv",
    )
    fedtune("fedtune.evaluate.downstream", "--model", "merged", *score, "--out", "m.csv")
    fedtune("fedtune.evaluate.downstream", "--model", str(tiny_model_dir), *score, "--out", "b.csv")
    adapter, merged, base = (pd.read_csv(tmp_path / f"{n}.csv").set_index("metric")["value"] for n in "amb")
    assert adapter.to_dict() == pytest.approx(merged.to_dict(), rel=1e-5)
    assert abs(adapter["bits_per_byte"] - base["bits_per_byte"]) > 1e-3  # the adapter changed the model
