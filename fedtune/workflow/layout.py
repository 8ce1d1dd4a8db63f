"""The run folder's layout, results/<run>/: where each stage writes, and which part of the run this cluster
holds. workflow/rules/common.smk binds each path function under its own name for the rules; a path's parts
may hold Snakemake {wildcards}, so rounds and sites are taken as strings or numbers alike."""

from __future__ import annotations

from dataclasses import dataclass

from fedtune.run import scoring
from fedtune.run.config import RunConfig
from fedtune.run.crossings import uses_adapters


def trains_here(run: RunConfig, site: str) -> bool:
    """Whether `site` trains on this cluster (always, without a cluster)."""
    return run.cluster is None or run.sites[site].cluster == run.cluster


def aggregates_here(run: RunConfig) -> bool:
    """Whether the models meet on this cluster (always, without a cluster)."""
    return run.cluster is None or run.cluster == run.aggregate_on


def local_sites(run: RunConfig) -> list[str]:
    return [site for site in run.sites if trains_here(run, site)]


def scored_here(run: RunConfig, site: str) -> bool:
    """Whether `site`'s test text is read here to score models on it (fedtune.run.scoring)."""
    return run.cluster is None or scoring.scoring_cluster(run, site) == run.cluster


def sites_scored_here(run: RunConfig, model: str) -> list[str]:
    """The sites on whose text `model` is scored here (each result one file of the job)."""
    return [site for site in scoring.scored_sites(run, model) if scored_here(run, site)]


# A crossing item's path inside the run folder (a wildcard constraint of the transfer rules): a manifest, a
# round's model, adapter or update, the scores made where a site's text is (evaluate.cross_site none, and
# by a site's training job before it trains: scoring.before_training_path), a cluster's job accounting
# (crossings.cost_part).
CROSSING_ITEM = (
    r"data/[A-Za-z][A-Za-z0-9_]*/manifest\.json|round-\d+/[A-Za-z][A-Za-z0-9_]*/(model|adapter|update)"
    r"|eval/base/[A-Za-z][A-Za-z0-9_]*\.json|round-\d+/eval/[A-Za-z][A-Za-z0-9_-]*/[A-Za-z][A-Za-z0-9_]*\.json"
    r"|round-\d+/[A-Za-z][A-Za-z0-9_]*/before/(aggregate|site)\.json"
    r"|report/cost_jobs-[A-Za-z][A-Za-z0-9_-]*\.csv"
)


@dataclass(frozen=True)
class Layout:
    """The paths of one run; common.smk binds each method named in PATHS under its name."""

    run: RunConfig

    def run_path(self, *parts) -> str:
        """A path under results/<run>/; parts may hold {wildcards}."""
        return str(self.run.run_dir.joinpath(*parts))

    def log_path(self, rule_name, *parts) -> str:
        return self.run_path("logs", rule_name, *parts) + ".log"

    def base_model_dir(self) -> str:
        return self.run_path("model", "base")

    def raw_data_dir(self, site) -> str:
        return self.run_path("data", site, "raw")

    def shard_dirs(self, site, split) -> list[str]:
        return [self.run_path("data", site, split, f"shard-{k}") for k in range(self.run.tokenize.shards)]

    def manifest_path(self, site) -> str:
        return self.run_path("data", site, "manifest.json")

    def site_model_dir(self, round, site) -> str:
        return self.run_path(f"round-{round}", site, "model")

    def site_optimizer_dir(self, round, site) -> str:
        return self.run_path(f"round-{round}", site, "optimizer")

    def site_start_dir(self, round, site) -> str:
        """train_merging's copy of round `round`'s start model at `site` (the previous round's start with its
        aggregate adapter merged in; bit for bit the aggregating cluster's merge_adapter output)."""
        return self.run_path(f"round-{round}", site, "start")

    def site_update_dir(self, round, site) -> str:
        return self.run_path(f"round-{round}", site, "update")

    def site_residual_dir(self, round, site) -> str:
        return self.run_path(f"round-{round}", site, "residual")

    def pooled_model_dir(self) -> str:
        return self.run_path("pooled", "model")

    def pooled_point_dir(self, label, *parts) -> str:
        """The pooled model's lr sweep (federation.pooled_lr_factors): the pooled models beside pooled/model."""
        return self.run_path("pooled", "sweep", label, *parts)

    def pooled_eval(self, site) -> str:
        return self.run_path("pooled", "eval", f"{site}.json")

    def pooled_point_evals(self) -> list[str]:
        return [
            self.pooled_point_dir(p.label, "eval", f"{site}.json")
            for p in self.run.pooled_points
            for site in self.run.sites
        ]

    def aggregate_model_dir(self, round) -> str:
        return self.run_path(f"round-{round}", "aggregate", "model")

    def aggregate_adapter_dir(self, round) -> str:
        return self.run_path(f"round-{round}", "aggregate", "adapter")

    def aggregate_update_dir(self, round) -> str:
        return self.run_path(f"round-{round}", "aggregate", "update")

    def aggregate_residual_dir(self, round) -> str:
        return self.run_path(f"round-{round}", "aggregate", "residual")

    def server_state_dir(self, round) -> str:
        """The server optimizer's state after round `round` (read by the next round's aggregate)."""
        return self.run_path(f"round-{round}", "aggregate", "server_state")

    def compare_model_dir(self, round, method) -> str:
        """Round `round`'s site models merged by `method` (aggregate.compare), beside the aggregate."""
        return self.run_path(f"round-{round}", "compare", method, "model")

    def init_model_dir(self, round) -> str:
        """Where round `round` starts: the base model, then the previous round's aggregate."""
        round = int(round)
        return self.base_model_dir() if round == 1 else self.aggregate_model_dir(round - 1)

    def adapter_base(self, model=None, round=None) -> list[str]:
        """The base an evaluated adapter sits on (train.adapter): the start model of its round, or the base
        model under the pooled baseline (no model); none where the model is a full model or a merged one
        (the aggregate, merged on every cluster that scores it by merge_adapter, or a compared method)."""
        if not uses_adapters(self.run):
            return []
        if model is None:
            return [self.base_model_dir()]
        if model not in self.run.sites:
            return []
        if not aggregates_here(self.run):  # round r's start is train_merging's copy at the site
            return [self.base_model_dir() if int(round) == 1 else self.site_start_dir(round, model)]
        return [self.init_model_dir(round)]

    def previous_residual(self, round, site=None) -> list[str]:
        """The residual a compression continues (federation.exchange error feedback): the site's, or with no
        site the aggregate's, of the round before; none in round 1."""
        if not self.run.exchange.keeps_residual or int(round) == 1:
            return []
        before = int(round) - 1
        return [self.aggregate_residual_dir(before) if site is None else self.site_residual_dir(before, site)]

    def merge_input_dir(self, round, site) -> str:
        """What the merge reads of a site: its compressed update (federation.exchange), or its model."""
        if self.run.exchange.compressed:
            return self.site_update_dir(round, site)
        return self.site_model_dir(round, site)

    def merge_output_dir(self, round) -> str:
        """Where the merge writes the round's aggregate: as it is (dtype full), or to be compressed (the
        aggregate goes back as an update against the previous one, which decode_aggregate rebuilds)."""
        if self.run.exchange.compressed:
            return self.run_path(f"round-{round}", "aggregate", "merged")
        return self.aggregate_model_dir(round)

    def round_model_dir(self, round, model) -> str:
        """A model of round `round` by its name in the report: a site, aggregate or a compared method."""
        if model == "aggregate":
            # With adapters, merged where it is scored (merge_adapter, on every cluster that scores it).
            return self.aggregate_model_dir(round)
        if model in self.run.sites:
            return self.site_model_dir(round, model)
        return self.compare_model_dir(round, model)

    def tasks_dir(self) -> str:
        return self.run_path("tasks")

    def task_scores(self, model, round=None) -> str:
        if model == "base":
            return self.run_path("eval", "tasks", "base.csv")
        return self.run_path(f"round-{round}", "eval", "tasks", f"{model}.csv")

    def task_results(self) -> list[str]:
        """The downstream tasks' score CSVs (evaluate.tasks): the base model's and the last round's models'."""
        if not self.run.downstream:
            return []
        models = [*self.run.sites, "aggregate"]
        return [self.task_scores("base")] + [self.task_scores(model, self.run.rounds) for model in models]

    def task_table(self, name, ext) -> str:
        """The report's table of one downstream task."""
        return self.run_path("report", "tasks", f"{name}.{ext}")

    def outbox_path(self, item) -> str:
        """Where this cluster publishes `item` for the others to pull: all they read is under exchange/."""
        return self.run_path("exchange", "outbox", item)


# The path functions the rules call by name.
PATHS = tuple(name for name, value in vars(Layout).items() if callable(value) and not name.startswith("_"))


def stage_outputs(
    run: RunConfig, layout: Layout, report_outputs: list[str], eval_results: list[str]
) -> list[str]:
    """Every stage's output in this cluster's part of the run, each a target of rule all in its own right.
    Snakemake reruns a job whose output is missing only when that output is a target: a missing
    intermediate output alone triggers nothing while what was made from it exists (that is how `temp()`
    works), so a deleted site model, aggregate or evaluation would otherwise never be redone (issue 37).
    As targets, each is redone when deleted, and everything made from it after it (docs/reliability.md).
    Not the optimizers' states (an aggregate's server_state, a site's optimizer): only the next round
    reads them, and docs/federation.md lets the older rounds' be deleted to save space. The list is the
    DAG's own files, no more: a target that no rule here makes would stop the run. `report_outputs`: the
    report rules' outputs (where the models meet); `eval_results`: every evaluation result."""
    here, local = run.cluster, local_sites(run)
    rounds = range(1, run.rounds + 1)
    if not aggregates_here(run) and not local:
        return []  # nothing of this run is made here
    compressed, adapters = run.exchange.compressed, uses_adapters(run)
    # The sites whose text is read here (config.data_read_on).
    raw_sites = [site for site in run.sites if here is None or here in run.data_read_on[site]]
    outputs = [layout.base_model_dir(), *(layout.raw_data_dir(site) for site in raw_sites)]
    outputs += [d for site in local for split in ("train", "test") for d in layout.shard_dirs(site, split)]
    outputs += [layout.manifest_path(site) for site in local]
    if not aggregates_here(run):
        trained = [(r, site) for r in rounds for site in local if site in run.round_sites(r)]
        outputs += [layout.site_model_dir(r, site) for r, site in trained]
        if compressed:
            outputs += [layout.site_update_dir(r, site) for r, site in trained]
        # What the models' cluster sends back for the next round (and with evaluate.cross_site none the
        # last round's, to score it here); with adapters, each local site's start model that its
        # training job merges from it.
        outputs += [
            layout.aggregate_adapter_dir(r) if adapters else layout.aggregate_model_dir(r)
            for r in (rounds if not scoring.cross_site(run) else rounds[:-1])
        ]
        # The scores made here on this cluster's sites' text, which go back to the report.
        outputs += [
            layout.run_path(scoring.made_at(run, model, site, r))
            for r, model, site in scoring.scores(run)
            if scored_here(run, site)
        ]
        if adapters:  # the training jobs merge their start models (train_merging)
            outputs += [layout.site_start_dir(r, site) for r in rounds[1:] for site in local]
    else:
        # Other clusters' manifests and models arrive here (fetch_manifest, fetch_site_model).
        outputs += [layout.manifest_path(site) for site in run.sites if not trains_here(run, site)]
        outputs += [layout.site_model_dir(r, site) for r in rounds for site in run.round_sites(r)]
        if compressed:
            outputs += [layout.site_update_dir(r, site) for r in rounds for site in run.round_sites(r)]
        for r in rounds:
            outputs.append(layout.aggregate_model_dir(r))
            if adapters:
                outputs.append(layout.aggregate_adapter_dir(r))
            outputs += [layout.round_model_dir(r, model) for model in scoring.round_models(run, r)]
        if run.pooled:
            outputs.append(layout.pooled_model_dir())
            outputs += [layout.pooled_point_dir(p.label, "model") for p in run.pooled_points]
        outputs += eval_results
        if run.downstream:
            outputs += [layout.tasks_dir(), *layout.task_results()]
        outputs += report_outputs
    return outputs
