"""The workflow's policy in Python, without Snakemake: the Slurm jobs a round submits (fedtune.run.round_jobs,
which the workflow prints and fedtune.report.plan counts with), the evaluation jobs' memory
(fedtune.workflow.resources), the command lines and arguments of the rules (fedtune.workflow.commands), the
run folder's layout (fedtune.workflow.layout) and the one registry of metrics (fedtune.core.metrics)."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from fedtune.aggregate import adapter_size
from fedtune.core.metrics import LOWER_IS_BETTER, MAIN_METRICS, TASK_METRICS
from fedtune.core.options import CAUSAL_LM, CLASSIFICATION
from fedtune.report import plan
from fedtune.run import round_jobs
from fedtune.run.config import build_run_config
from fedtune.run.crossings import cost_part, crossing_items
from fedtune.workflow import commands, layout, resources

from .workflow_harness import ROOT, demo_config

LLAMA2 = ROOT / "config" / "examples" / "llama2-it-cs.yaml"
GROUPED = {round_jobs.ROUND_GROUP: 8}  # the Slurm profiles join a round's group into one job


def llama2(cluster: str, rounds: int = 2):
    config = yaml.safe_load(LLAMA2.read_text())
    config["cluster"], config["federation"]["rounds"] = cluster, rounds
    return build_run_config(config)


@pytest.fixture(scope="module")
def demo():
    return build_run_config(demo_config())


def test_a_one_cluster_round_is_its_trainings_and_one_group_job(demo):
    # Two trainings; the merge and the evaluations (the aggregate before the last round, evaluate.intermediate
    # aggregate; every model after it) one job when the profile joins them, else one job each.
    assert [round_jobs.slurm_jobs_per_round(demo, None, r, GROUPED) for r in range(1, 7)] == [3] * 6
    assert [round_jobs.slurm_jobs_per_round(demo, None, r, {}) for r in range(1, 7)] == [4] * 5 + [6]
    assert round_jobs.round_job_parts(demo, None, 6) == ["aggregate", "alpha", "beta", "aggregate"]
    # Too few group components to join the round's parts: each is a job of its own.
    assert round_jobs.slurm_jobs_per_round(demo, None, 6, {round_jobs.ROUND_GROUP: 3}) == 2 + 4
    assert round_jobs.slurm_jobs_lines(demo, GROUPED) == [
        "fedtune: Slurm jobs per round: 3, 3, 3, 3, 3, 3 (rounds 1-6: 2 trainings, the rest merge-and-evaluate)"
    ]


def test_where_the_models_do_not_meet_only_the_last_rounds_scores_add_a_job():
    # evaluate.cross_site none: Karolina's training of round 2 scores round 1's models first; its last
    # round's aggregate and cs's model are scored by one group job after it.
    karolina = llama2("karolina")
    assert [round_jobs.round_job_parts(karolina, "karolina", r) for r in (1, 2)] == [[], ["cs", "aggregate"]]
    assert round_jobs.slurm_jobs_lines(karolina, GROUPED) == [
        "fedtune: Slurm jobs per round on karolina: 1, 2 (rounds 1-2: 1 training, the rest evaluate)",
        "fedtune: Slurm jobs per round on leonardo: 2, 2 (rounds 1-2: 1 training, the rest merge-and-evaluate)",
    ]
    assert round_jobs.slurm_jobs_per_round(karolina, "karolina", 2, {}) == 1 + 2


def test_the_plan_counts_another_clusters_trainings_as_the_workflow_does(demo):
    """Partial participation: a site that sits a round out submits no training, in the workflow's count and
    in the dry run's GPU-hours of a cluster it does not plan."""
    config = demo_config()
    config["federation"]["participation"] = 1
    run = build_run_config(config)
    trainings = [round_jobs.round_trainings(run, "local", r) for r in range(1, run.rounds + 1)]
    assert [len(t) for t in trainings] == [1] * run.rounds
    assert [round_jobs.slurm_jobs_per_round(run, "local", r, GROUPED) for r in range(1, 7)] == [2] * 6
    line = next(x for x in plan.config_job_lines(run, "local") if "GPU-hours" in x)
    assert f"({run.rounds} jobs of " in line, line


def test_evaluation_memory_is_sized_from_the_model_once_per_state_of_the_download(
    demo, tmp_path, monkeypatch
):
    calls = []
    sized = resources._evaluation_size
    monkeypatch.setattr(resources, "_evaluation_size", lambda *a: calls.append(a) or sized(*a))
    model_config, _ = adapter_size.known_model_config(demo, tmp_path)
    expect = adapter_size.evaluation_mem_mb(model_config, demo.evaluate.dtype or demo.model.dtype)
    assert resources.evaluation_mem_mb(demo, tmp_path) == expect
    assert resources.evaluation_mem_mb(demo, tmp_path) == expect and len(calls) == 1
    (tmp_path / "config.json").write_text("{}")  # the download arrives: sized again
    resources.evaluation_mem_mb(demo, tmp_path)
    assert len(calls) == 2
    # A hub model whose config.json is nowhere on this machine: the stand-in figure.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert (
        resources.evaluation_mem_mb(llama2("leonardo"), tmp_path / "absent") == resources.EVAL_MEM_MB_UNKNOWN
    )


def test_the_evaluation_command_is_one_template_for_the_rules_and_the_training_jobs():
    assert commands.EVAL_SHELL == (
        "python -m fedtune.evaluate --model {input.model:q} {params.base} --split test"
        " --options {params.options:q} --sites {params.sites:q}"
        " --label {params.label} --round {params.round} {params.tracking} > {log:q} 2>&1"
    )
    run = llama2("karolina")
    paths = layout.Layout(run)
    script = commands.score_before_training(
        run, paths, ["aggregate", "site"], "cs", 2, "/start", ["/a", "/s"]
    )
    first, second, rest = script.split(" && ")
    assert rest == ""
    log = f">> {paths.log_path('train', 'round-2', 'cs')} 2>&1"
    assert first.startswith(
        "python -m fedtune.evaluate --model /start --split test --options "
    ) and first.endswith(f" --label aggregate --round 1  {log}")
    assert f"--model {paths.site_model_dir(1, 'cs')} --split test" in second and '"out":"/s"' in second
    assert second.endswith(f" --label cs --round 1  {log}")


def test_transfer_arguments():
    karolina, leonardo = llama2("karolina"), llama2("leonardo")
    limits = "--connect-timeout 30 --io-timeout 300 --transfer-timeout 21600"
    assert commands.link_args(karolina, "leonardo") == limits
    # Leonardo pushes to Karolina (its remotes entry says push): Karolina receives from its inbox.
    assert commands.push_to(leonardo) == ["karolina"] and commands.push_to(karolina) == []
    assert commands.receive_args(karolina, "round-1/aggregate/model", "/t").startswith(
        "receive --run results/llama2-it-cs --item round-1/aggregate/model --out /t --wait 259200 --round 1 "
        "--remote leonardo --what 'the aggregate' --check "
    )
    fetch = commands.receive_args(leonardo, "round-1/cs/model", "/t")
    assert fetch.startswith("fetch --source ") and f" {limits} --round 1 --remote karolina " in fetch
    push = commands.push_args(leonardo, layout.Layout(leonardo), "round-1/aggregate/model", "karolina")
    assert push.startswith("--run results/llama2-it-cs --item round-1/aggregate/model --to ")
    with pytest.raises(commands.WorkflowSetupError, match="no federation.remotes entry"):
        commands.remote_path(karolina, "nowhere", "x")
    # Every item that crosses matches the transfer rules' wildcard constraint, and nothing else does.
    items = [c.item for run in (karolina, leonardo) for c in crossing_items(run)] + [cost_part("karolina")]
    assert all(re.fullmatch(layout.CROSSING_ITEM, item) for item in items), items
    assert not re.fullmatch(layout.CROSSING_ITEM, "round-1/cs/model/../../secret")


def test_training_and_report_arguments(demo):
    options = demo.sites["alpha"].train
    assert commands.train_launch_args(options, "local", None) == (
        f"--cluster local --launcher {options.job_launcher} --nodes {options.nodes} "
        f"--procs-per-node {options.processes_per_node} --cpus-per-task {options.cpus_per_task}"
    )
    assert commands.train_launch_args(options, "local", "my image.sif").endswith(
        " --container 'my image.sif'"
    )
    assert commands.tracking_args(demo, layout.Layout(demo)) == ""  # tracking off
    assert commands.pooled_point_args(demo) == f"--pooled-point pooled={demo.pooled.lr!r},1.0"
    assert commands.round_args(demo, layout.Layout(demo), 2, "alpha") == "--round 2"
    config = demo_config()
    config["federation"]["site_optimizer"] = "keep"
    keep = build_run_config(config)
    paths = layout.Layout(keep)
    assert commands.round_args(keep, paths, 2, "alpha") == (
        f"--round 2 --optimizer-out {paths.site_optimizer_dir(2, 'alpha')}"
        f" --optimizer-in {paths.site_optimizer_dir(1, 'alpha')}"
    )


def test_every_metric_of_the_registry_has_its_caption_and_no_rule_names_one():
    assert set(TASK_METRICS) == {CAUSAL_LM, CLASSIFICATION}
    for metrics in TASK_METRICS.values():
        for name in (*metrics.names, metrics.heatmap_caption.removesuffix(".rst")):
            assert (ROOT / "workflow" / "report" / f"{name}.rst").is_file(), name
    assert MAIN_METRICS == ("perplexity", "accuracy") and "perplexity" in LOWER_IS_BETTER
    for path in (ROOT / "workflow" / "rules").glob("*.smk"):
        names = {n for m in TASK_METRICS.values() for n in m.names}
        chosen = [n for n in names if re.search(rf"[\"']{n}[\"']", path.read_text())]
        assert not chosen, f"{path.name} chooses metric names {chosen}: read them from fedtune.core.metrics"


def test_the_layout_binds_every_path_the_rules_call(demo):
    paths = layout.Layout(demo)
    assert {"run_path", "site_model_dir", "merge_input_dir", "task_table", "outbox_path"} <= set(layout.PATHS)
    assert paths.init_model_dir(1) == paths.base_model_dir()
    assert paths.init_model_dir("3") == paths.aggregate_model_dir(2)
    assert paths.site_model_dir("{round}", "{site}").endswith("round-{round}/{site}/model")
    config = copy.deepcopy(demo_config())
    config["federation"]["exchange"] = {"dtype": "int8"}
    compressed = layout.Layout(build_run_config(config))
    assert compressed.merge_input_dir(1, "alpha").endswith("round-1/alpha/update")
    assert compressed.merge_output_dir(1).endswith("round-1/aggregate/merged")
    targets = layout.stage_outputs(demo, paths, ["report"], ["evals"])
    assert targets[-2:] == ["evals", "report"]
    assert {paths.site_model_dir(r, s) for r in range(1, 7) for s in demo.sites} <= set(targets)
    # Where the models do not meet: this cluster's part only, its site's models and what it sends back.
    karolina = llama2("karolina")
    remote = layout.stage_outputs(karolina, layout.Layout(karolina), ["report"], ["evals"])
    assert "report" not in remote and not [t for t in remote if "/it/" in t], remote
