"""Retries of the training rules: by the main Snakemake, in a new Slurm job, never by the job's own
Snakemake, which would restart training inside the allocation whose time limit just stopped it.

Read from Snakemake's own workflow objects, parsed once as the main Snakemake (ExecMode.DEFAULT) and once
as the job's Snakemake (ExecMode.REMOTE), with a config that has every optional training rule (the pooled
baseline, a sweep). A rule counts as training when its shell starts scripts/launch or runs
fedtune.train, so a training rule added later is checked without naming it here."""

from __future__ import annotations

import pytest
import yaml

from .workflow_harness import ROOT, demo_config, write_config


def workflow_rules(workdir, exec_mode) -> dict:
    """{rule name: rule} of the workflow parsed in exec_mode."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (
        ConfigSettings,
        OutputSettings,
        ResourceSettings,
        StorageSettings,
        WorkflowSettings,
    )
    from snakemake_interface_executor_plugins.settings import ExecMode

    with SnakemakeApi(OutputSettings(quiet=True)) as api:
        workflow = api.workflow(
            resource_settings=ResourceSettings(),
            config_settings=ConfigSettings(configfiles=[workdir / "config.yaml"]),
            storage_settings=StorageSettings(),
            workflow_settings=WorkflowSettings(exec_mode=getattr(ExecMode, exec_mode)),
            snakefile=ROOT / "Snakefile",
            workdir=workdir,
        )
        workflow.dag()
        # The rule's own `retries:` (the property falls back to --retries, which the job gets as 0,
        # only when the rule sets none; a rule's own value wins, and that is the danger).
        return {rule.name: rule for rule in workflow._workflow.rules}


def launches_training(rule) -> bool:
    shell = rule.shellcmd or ""
    return "FEDTUNE_LAUNCH" in shell or "-m fedtune.train" in shell


@pytest.fixture(scope="module")
def every_training_rule(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("train-retries")
    config = demo_config()
    config["train"]["processes_per_node"] = 2
    config["train"]["retries"] = 4
    config["federation"] = {**config.get("federation", {}), "pooled_baseline": True}
    config["sweep"] = {"site": "beta", "axis": "micro_batch", "values": [4, 8]}
    write_config(workdir, config)
    return workdir


def test_training_rules_are_retried_only_by_the_main_snakemake(every_training_rule):
    main = workflow_rules(every_training_rule, "DEFAULT")
    job = workflow_rules(every_training_rule, "REMOTE")
    training = sorted(name for name, rule in main.items() if launches_training(rule))
    # Not vacuous: the rules known today are found by the shell they run.
    assert {"train", "train_pooled", "train_sweep"} <= set(training), training
    for name in training:
        assert main[name]._restart_times == 4, (name, main[name]._restart_times)
        assert job[name]._restart_times == 0, (
            f"rule {name}: retries {job[name]._restart_times} in the job's own Snakemake would restart "
            "training inside its dying allocation; write `retries: 0 if workflow.remote_exec else ...`"
        )


def test_iris_jobs_get_the_conda_env_with_the_cuda_12_6_torch(every_training_rule, tmp_path):
    config = yaml.safe_load((every_training_rule / "config.yaml").read_text())
    config["cluster"] = "iris"
    for site in config["sites"].values():
        site["cluster"] = "iris"
    write_config(tmp_path, config)
    for workdir, env in ((every_training_rule, "envs/fedtune.yaml"), (tmp_path, "envs/fedtune-cu126.yaml")):
        rules = workflow_rules(workdir, "DEFAULT")
        assert str(rules["train"].conda_env).endswith(env), rules["train"].conda_env
        assert str(rules["tokenize"].conda_env).endswith(env), rules["tokenize"].conda_env
