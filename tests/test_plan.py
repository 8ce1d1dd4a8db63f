"""The summary at the end of a dry run (fedtune.report.plan, workflow/rules/plan.smk): the published
llama2-it-cs example dry-run with each cluster's profile, its figures worked out here from the example's
YAML and Llama-2-7B's config.json (placed in a Hugging Face cache, as `hf download ... config.json` leaves
it); and the rules that run on the login node listed without the profile's Slurm partition and time."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from .workflow_harness import ROOT, planned_jobs, snakemake

EXAMPLE = ROOT / "config" / "examples" / "llama2-it-cs.yaml"
# meta-llama/Llama-2-7b-hf's config.json (the values that set its size).
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def llama_parameters(c: dict) -> int:
    """Embeddings and LM head, per layer 4 attention and 3 MLP matrices and two norms, the final norm."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    per_layer = 4 * h * h + 3 * h * c["intermediate_size"] + 2 * h
    return 2 * c["vocab_size"] * h + layers * per_layer + h


@pytest.fixture
def llama2(tmp_path, monkeypatch):
    """A working directory with the example (rounds as given) and the model's config.json in a cache."""
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-2-7b-hf" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA2_7B))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "proj123")

    def workdir(rounds: int):
        config = yaml.safe_load(EXAMPLE.read_text())
        config["federation"]["rounds"] = rounds
        folder = tmp_path / f"rounds-{rounds}"
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        return folder, config

    return workdir


def summary(stderr: str) -> dict[str, dict[str, str]]:
    """The summary's lines by cluster and by what they say (login node, Slurm jobs, ...)."""
    text = stderr[stderr.index("fedtune: what this run asks for") :]
    clusters: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines()[1:]:
        if match := re.match(r"^(\w+)( \(the models meet here\))?:$", line):
            current = clusters.setdefault(match.group(1), {})
        elif line.startswith("  ") and current is not None:
            key, _, value = line.strip().partition(": ")
            current[key] = value
    return clusters


def figures(config: dict, cluster: str) -> dict:
    """What the summary should say for `cluster`, from the config alone."""
    rounds = config["federation"]["rounds"]
    sites = config["sites"]
    here = [s for s in sites.values() if s["cluster"] == cluster]
    train = config["train"]
    gpu_hours = rounds * sum(
        s["train"]["nodes"] * s["train"]["gpus_per_node"] * s["train"]["runtime"] / 60 for s in here
    )
    params = llama_parameters(LLAMA2_7B)
    model = 2 * params  # model.dtype bfloat16
    aggregates_here = cluster == config["federation"]["aggregate_on"]
    keep = train.get("keep_checkpoints", 2)  # the schema's default
    scratch = model  # the base
    scratch += rounds * (len(sites) if aggregates_here else len(here)) * model  # site models
    # Aggregates made, or received: with evaluate.cross_site none (the example's) the last round's too.
    home = config["evaluate"].get("cross_site") == "none"
    scratch += (rounds if aggregates_here or home else rounds - 1) * model
    server = config.get("aggregate", {}).get("server_optimizer", {}).get("name", "sgd")  # the default
    if aggregates_here and server != "sgd":
        scratch += rounds * 4 * params  # fedavgm's momentum, fp32; plain sgd keeps no state
    scratch += len(here) * keep * 12 * params  # checkpoints: fp32 weights and AdamW's two moments
    return {"here": here, "rounds": rounds, "gpu_hours": gpu_hours, "scratch_gb": scratch / 1e9}


def test_leonardo_dry_run_of_the_llama2_example_ends_with_its_summary(llama2):
    workdir, config = llama2(rounds=1)
    result = snakemake(workdir, "-n", profile="leonardo", timeout=300)
    expect = figures(config, "leonardo")
    remote = [s for s in config["sites"].values() if s["cluster"] != "leonardo"]
    shards = config["tokenize"]["shards"]
    parts = summary(result.stderr)
    assert list(parts) == ["leonardo", "karolina"], result.stderr[-3000:]
    leonardo = parts["leonardo"]
    # The transfers, the manifest and the report run in the controller; the downloads are Slurm jobs on
    # Leonardo (its login nodes stop a process after 10 minutes of CPU time). cs's scores come from
    # Karolina (evaluate.cross_site none): the base model's, and the round's aggregate's and cs's own.
    login = {
        "fetch_manifest": len(remote),
        "fetch_site_model": len(remote) * expect["rounds"],
        "fetch_base_score": len(remote),
        "fetch_score": 2 * len(remote) * expect["rounds"],
        # Every round's aggregate into Karolina's inbox, the last one's too: Karolina scores it on cs's text.
        "push": expect["rounds"],
        "tokenize_manifest": len(expect["here"]),
        "report": 1,
        "report_settings": 1,
        "report_cost": 1,
        # Karolina's own job accounting (its sacct), for the cost table.
        "fetch_cost_part": 1,
    }
    assert leonardo["login node"].startswith(f"{sum(login.values())} jobs ("), leonardo
    for rule, n in login.items():
        assert f"{n} {rule}" in leonardo["login node"], (rule, leonardo)
    # + its own site's download only (not the Czech data set's), download_model, evaluate_base
    before = 2 * shards * len(expect["here"]) + len(expect["here"]) + 1 + 1
    per_round = len(expect["here"]) + 1  # the trainings and one group job of the merge and evaluations
    assert leonardo["Slurm jobs"].startswith(
        f"{before + per_round * expect['rounds']} in all; before the rounds {before} ("
    ), leonardo
    assert f"{2 * shards} tokenize" in leonardo["Slurm jobs"]
    assert leonardo["Slurm jobs per round"].startswith(f"{per_round} (round 1: 1 group round-1 ("), leonardo
    assert leonardo["GPU-hours requested by the trainings"].startswith(f"{expect['gpu_hours']:,.0f} ("), (
        leonardo
    )
    assert leonardo["scratch"].startswith(f"{expect['scratch_gb']:.1f} GB for models ("), leonardo
    karolina = parts["karolina"]
    other = figures(config, "karolina")
    assert karolina["GPU-hours requested by the trainings"].startswith(f"{other['gpu_hours']:,.0f} ("), (
        karolina
    )
    assert karolina["scratch"].startswith(f"{other['scratch_gb']:.1f} GB for models ("), karolina
    # 384 and 768 GPU-hours: the figures of the example's comment, worked out by hand once.
    assert (expect["gpu_hours"], other["gpu_hours"]) == (384, 768)

    # The job list: the login node's rules without a Slurm partition or time limit, the Slurm jobs with.
    planned = planned_jobs(result.stdout)
    jobs = {job.name: job for job in planned}
    assert [job.wildcards["site"] for job in planned if job.name == "download_data"] == ["it"]
    assert not [job for job in planned if "allenai/c4" in job.shell and job.name != "report_settings"]
    for rule in login:
        assert not {"slurm_partition", "runtime", "slurm_account"} & set(jobs[rule].resources), jobs[rule]
    assert jobs["train"].resources["slurm_partition"] == "boost_usr_prod", jobs["train"]
    assert jobs["tokenize"].resources["slurm_partition"] == "lrd_all_serial", jobs["tokenize"]


def test_karolina_dry_run_counts_its_tokenize_groups_once_and_fetches_in_the_controller(llama2, monkeypatch):
    """Two rounds on Karolina: 16 group jobs of 8 tokenize jobs each (profiles/karolina with qcpu), one training per
    round, and the aggregate of round 1 received by a job in the controller (fetch_aggregate, which the
    workflow has to mark local again: Snakemake's `use rule ... with:` drops localrule)."""
    workdir, config = llama2(rounds=2)
    # A project with CPU node-hours tokenizes on qcpu, eight jobs to a node job (the default, a qgpu
    # eighth per job, has no groups to count).
    monkeypatch.setenv("FEDTUNE_KAROLINA_CPU_PARTITION", "qcpu")
    result = snakemake(workdir, "-n", "--quiet", "rules", profile="karolina", timeout=300)
    expect = figures(config, "karolina")
    karolina = summary(result.stderr)["karolina"]
    shards = config["tokenize"]["shards"]
    # Its site's manifest and models, marked for Leonardo to fetch, and the scores on cs's text: the base
    # model's, and each round's aggregate's and cs's own (evaluate.intermediate all, the default).
    # And after its last job its own job accounting (its sacct) for the report's cost table.
    items = 1 + expect["rounds"] + 1 + 2 * expect["rounds"] + 1
    # Every round's aggregate, the last one's too: Karolina scores it on cs's text.
    login = {"mark_complete": items, "fetch_aggregate": expect["rounds"], "download_data": 1,
             "download_model": 1, "tokenize_manifest": 1, "report_cost_part": 1}  # fmt: skip
    assert karolina["login node"].startswith(f"{sum(login.values())} jobs ("), karolina
    for rule, n in login.items():
        assert f"{n} {rule}" in karolina["login node"], (rule, karolina)
    groups = 2 * shards // 8
    # Before the rounds the base model's score on cs's text; each round cs's training, which first scores
    # the previous round's aggregate and cs's previous model on cs's text; after the last round one job
    # that scores its aggregate and cs's model (group round-<r>).
    assert karolina["Slurm jobs"] == (
        f"{groups + 1 + expect['rounds'] + 1} in all; before the rounds {groups + 1} ({groups} group tokenize "
        "(8 tokenize), 1 evaluate_base)"
    ), karolina
    assert karolina["Slurm jobs per round"] == "1, 2 (round 1: 1 train)", karolina
    assert karolina["GPU-hours requested by the trainings"].startswith(f"{expect['gpu_hours']:,.0f} ("), (
        karolina
    )
    assert karolina["scratch"].startswith(f"{expect['scratch_gb']:.1f} GB for models ("), karolina
    # --quiet rules: the summary without the list of 100+ jobs.
    assert "rule tokenize:" not in result.stdout and len(result.stdout.splitlines()) < 100


def test_a_small_models_parameters_read_as_a_number():
    """The dry-run summary said "0.0M parameters" for a model of a few thousand (and "0.2M" for the demo's):
    below a million, thousands."""
    from fedtune.report.plan import _count

    assert [_count(n) for n in (6_738_415_616, 134_515_008, 999_999, 230_016, 160_000, 4_224, 950)] == [
        "6.74B", "134.5M", "1.0M", "230k", "160k", "4.22k", "950",
    ]  # fmt: skip
