"""The run's config as one object: the config validated against the JSON schemas in fedtune/schemas (the
single source of truth for keys, types and defaults), with every rule a schema cannot express, composed
from the stages' options:

    RunConfig        the whole validated config: run folder, task, model, sites, federation, sweep
    Site             one site: its DatasetOptions, template, cluster, TrainOptions (overrides merged) and
                     TokenizeOptions (the tokenize section with its template and columns)

It sits above the stages, whose options modules it composes (fedtune.download.options,
fedtune.tokenize.options, fedtune.train.options, fedtune.aggregate.options, fedtune.evaluate.options);
the settings that are no stage's sit below them in fedtune.core (options, exchange_options,
tracking_options, residency, remotes, participation, durations, smoke, lm_eval_tasks), the sweep's and
the pooled baseline's trainings beside it (fedtune.run.sweep, fedtune.run.pooled). Each options object has one JSON form (`to_json()` /
`from_json()`), the rule -> CLI boundary: a rule passes `--options '<json>'`, the CLI turns it back into
the same object through the same checks. Nothing here imports torch, so Snakemake's start-up stays fast."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedtune.aggregate.options import MERGE_METHODS, AggregateOptions
from fedtune.core.config_files import read_config_file
from fedtune.core.durations import parse_duration
from fedtune.core.exchange_options import ExchangeOptions
from fedtune.core.lm_eval_tasks import DownstreamTask, downstream_tasks
from fedtune.core.options import (
    CLASSIFICATION,
    MAIN_SCHEMA,
    ConfigError,
    check_fits,
    check_template,
    check_weights,
    validate_section,
)
from fedtune.core.participation import participating_sites, site_step_counts
from fedtune.core.remotes import Remote, check_cluster, parse_remotes
from fedtune.core.residency import check_data_stays, data_read_on, resolve_cross_site
from fedtune.core.smoke import apply_smoke
from fedtune.core.tracking_options import TrackingOptions
from fedtune.download.options import DatasetOptions, ModelOptions
from fedtune.evaluate.options import EvaluateOptions
from fedtune.run.pooled import PooledPoint, pooled_options, pooled_sweep
from fedtune.run.sweep import SweepPoint, sweep_points
from fedtune.tokenize.options import TokenizeOptions
from fedtune.train.options import TrainOptions, site_train_options, train_run_keys


@dataclass(frozen=True)
class Site:
    name: str
    cluster: str
    dataset: DatasetOptions
    prompt_template: str
    train: TrainOptions
    tokenize: TokenizeOptions


@dataclass(frozen=True)
class RunConfig:
    """A whole validated config. `raw` is the dict with every default filled in (the report keeps it as
    the run's settings.json)."""

    raw: dict
    run: str
    results: str
    cluster: str | None
    task: str
    model: ModelOptions
    sites: dict[str, Site]
    tokenize: TokenizeOptions
    aggregate: AggregateOptions
    evaluate: EvaluateOptions
    downstream: tuple[DownstreamTask, ...]
    rounds: int
    lr_schedule: str
    site_optimizer: str
    pooled: TrainOptions | None
    aggregate_on: str
    remotes: dict[str, Remote]
    wait_s: float
    connect_timeout_s: int
    io_timeout_s: int
    transfer_timeout_s: float
    sweep_site: str | None
    sweep_axis: str | None
    sweep: tuple[SweepPoint, ...]
    tracking: TrackingOptions
    smoke: bool = False
    exchange: ExchangeOptions = ExchangeOptions()
    scratch_results: str | None = None
    scratch_purge: str | None = None
    scratch_keep: str | None = None
    # federation.pooled_lr_factors / pooled_embedding_lr_factors: the pooled models beside `pooled`.
    pooled_points: tuple[PooledPoint, ...] = ()
    # federation.participation: the sites of each round (index round - 1); empty: every site, every round.
    participants: tuple[tuple[str, ...], ...] = ()
    # federation.site_steps: equal, or tokens (each site's steps by its share of the tokens: token_steps).
    site_steps: str = "equal"

    def token_steps(self, tokens: Mapping[str, int]) -> dict[str, TrainOptions]:
        """Each site's train options with its steps a round in proportion to its training tokens
        (federation.site_steps tokens; `tokens`: site -> tokens_kept of its manifest): the round's
        steps stay those of equal steps (site_step_counts). With site_steps equal, the sites' own."""
        if self.site_steps != "tokens":
            return {name: site.train for name, site in self.sites.items()}
        steps = next(iter(self.sites.values())).train.max_steps
        counts = site_step_counts(steps, {name: tokens[name] for name in self.sites})
        return {
            name: dataclasses.replace(site.train, max_steps=counts[name]) for name, site in self.sites.items()
        }

    def round_sites(self, round: int) -> tuple[str, ...]:
        """The sites that train in round `round` and whose models its aggregate merges."""
        return self.participants[int(round) - 1] if self.participants else tuple(self.sites)

    @property
    def run_dir(self) -> Path:
        return Path(self.results) / self.run

    @property
    def classification(self) -> bool:
        return self.task == CLASSIFICATION

    @property
    def data_read_on(self) -> dict[str, tuple[str, ...]]:
        """The clusters where each site's text is read, its own first (`data_read_on`)."""
        return data_read_on(self.raw)


def build_run_config(config: dict, *, source: str = "config", base_dir: Path | None = None) -> RunConfig:
    """Validate `config` (defaults filled in place) with every rule, and return it as a RunConfig."""
    # A cluster profile's scratch folder (scratch_results) holds the runs of a config that names no
    # `results` folder of its own: the choice is made before the schema fills in its default.
    if "results" not in config and config.get("scratch_results"):
        config["results"] = config["scratch_results"]
    validate_section(config, MAIN_SCHEMA, source=source)
    if config["smoke"] and not config["run"].endswith("-smoke"):  # (not twice on the same dict)
        apply_smoke(config)
        validate_section(config, MAIN_SCHEMA, source=source)
    base_dir = Path(base_dir or ".")
    model = ModelOptions.from_mapping(config["model"], source=source)
    model.check(f"{source}: model.", task=config["task"], base_dir=base_dir)
    tokenize = TokenizeOptions.from_mapping(
        {**config["tokenize"], "task": config["task"]}, source=source, prefix="tokenize"
    )
    sites = {}
    for name, site in config["sites"].items():
        check_template(site["prompt_template"], f"{source}: sites.{name}.prompt_template")
        prefix = f"sites.{name}.dataset"
        dataset = DatasetOptions.from_mapping(site["dataset"], source=source, prefix=prefix)
        dataset.check(f"{source}: {prefix}.", base_dir=base_dir)
        # The default decided, so that the run's settings.json says it.
        site["dataset"]["shareable"] = dataset.shareable
        sites[name] = Site(
            name=name,
            cluster=site["cluster"],
            dataset=dataset,
            prompt_template=site["prompt_template"],
            train=dataclasses.replace(
                site_train_options(config, name, source=source), **train_run_keys(config, federated=True)
            ),
            tokenize=tokenize.for_site(site["prompt_template"], dataset),
        )
    check_fits(
        tokenize.block_size,
        model.architecture,
        f"{source}: tokenize.block_size",
        "model.architecture",
    )
    sweep = config["sweep"]
    sweep_site = None
    points: tuple[SweepPoint, ...] = ()
    if sweep:
        sweep_site = sweep["site"] or next(iter(sites))
        if sweep_site not in sites:
            raise ConfigError(
                f"{source}: sweep.site: {sweep_site!r} is not a site of this config ({', '.join(sites)})"
            )
        points = sweep_points(config, sweep_site, sites[sweep_site].train, source)
    federation = config["federation"]
    if federation["site_optimizer"] == "keep":
        for site in sites.values():
            if not site.train.fsdp:
                raise ConfigError(
                    f"{source}: federation.site_optimizer: keep needs backend fsdp, but site {site.name} "
                    "trains with deepspeed (whose optimizer also holds the weights)"
                )
    aggregate = _aggregate_options(config, model, sites, source)
    for name in sites:
        if name in aggregate.compare:
            raise ConfigError(
                f"{source}: sites: {name!r} is also a merge method of aggregate.compare, whose models are "
                f"scored in round-<r>/eval/{name}/ beside the sites' (and named so in the report); name the "
                "site otherwise"
            )
    # The default decided, so that the run's settings.json (and data_read_on) say it.
    config["evaluate"]["cross_site"] = resolve_cross_site(config)
    # With the run's task and BOS choice: a scoring job's --options then holds every setting it reads.
    evaluate = EvaluateOptions.from_mapping(config["evaluate"], source=source).for_run(
        config["task"], tokenize.add_bos, tokenize.block_size
    )
    aggregate_on = federation["aggregate_on"] or next(iter(sites.values())).cluster
    remotes = parse_remotes(federation)
    clusters = {name: site.cluster for name, site in sites.items()}
    check_cluster(config, clusters, aggregate_on, remotes, source)
    private = {name: site.cluster for name, site in sites.items() if not site.dataset.shareable}
    check_data_stays(config, private, source)
    participants = participating_sites(
        list(sites),
        federation,
        config["train"]["seed"],
        source,
        adapters=config["train"]["adapter"] is not None,
    )
    exchange = _exchange_options(config, sites, source)
    if participants and exchange.keeps_residual:
        raise ConfigError(
            f"{source}: federation.participation: {federation['participation']!r} leaves sites out of rounds, "
            "but federation.exchange.error_feedback carries each site's residual from its round before; set "
            "error_feedback: false or leave participation null"
        )
    pooled = None
    pooled_points: tuple[PooledPoint, ...] = ()
    if federation["pooled_baseline"]:
        clusters = sorted({site.cluster for site in sites.values()})
        if len(clusters) > 1:
            raise ConfigError(
                f"{source}: federation.pooled_baseline: needs every site's training data on one cluster, "
                f"but the sites train on {', '.join(clusters)}"
            )
        trains = {name: site.train for name, site in sites.items()}
        pooled = pooled_options(config, trains, source, participants)
        pooled_points = pooled_sweep(federation, pooled, source)
        if federation["pooled_sync"]:
            sync = pooled_options(config, trains, source, participants, sync=True)
            pooled_points += pooled_sweep(federation, sync, source, sync=True)
    elif federation["pooled_sync"]:
        raise ConfigError(f"{source}: federation.pooled_sync: true needs federation.pooled_baseline: true")
    _check_site_steps(federation, sites, participants, source)
    return RunConfig(
        raw=config,
        run=config["run"],
        results=config["results"],
        cluster=config["cluster"],
        task=config["task"],
        model=model,
        sites=sites,
        tokenize=tokenize,
        aggregate=aggregate,
        evaluate=evaluate,
        downstream=downstream_tasks(evaluate, config["task"], base_dir=base_dir, source=source),
        rounds=federation["rounds"],
        lr_schedule=federation["lr_schedule"],
        site_optimizer=federation["site_optimizer"],
        site_steps=federation["site_steps"],
        pooled=pooled,
        aggregate_on=aggregate_on,
        remotes=remotes,
        wait_s=parse_duration(federation["wait"], f"{source}: federation.wait"),
        connect_timeout_s=federation["connect_timeout"],
        io_timeout_s=federation["io_timeout"],
        transfer_timeout_s=parse_duration(
            federation["transfer_timeout"], f"{source}: federation.transfer_timeout"
        ),
        sweep_site=sweep_site,
        sweep_axis=sweep["axis"] if sweep else None,
        sweep=points,
        tracking=TrackingOptions.from_mapping(config["tracking"], source=source),
        smoke=config["smoke"],
        scratch_results=config["scratch_results"],
        scratch_purge=config["scratch_purge"],
        scratch_keep=config["scratch_keep"],
        exchange=exchange,
        pooled_points=pooled_points,
        participants=participants,
    )


def check_config(config: dict, *, source: str = "config", base_dir: Path | None = None) -> dict:
    """Every rule of build_run_config; returns the config dict with its defaults filled in."""
    build_run_config(config, source=source, base_dir=base_dir)
    return config


def load_config(path: str | Path, *, base_dir: Path | None = None) -> dict:
    """A config file, validated, as a dict with its defaults (see load_run_config for the object)."""
    return check_config(read_config_file(path), source=str(path), base_dir=base_dir)


def load_run_config(path: str | Path, *, base_dir: Path | None = None) -> RunConfig:
    return build_run_config(read_config_file(path), source=str(path), base_dir=base_dir)


def _exchange_options(config: Mapping, sites: Mapping[str, Site], source: str) -> ExchangeOptions:
    """federation.exchange, and what it cannot combine with: adapters already send megabytes."""
    options = ExchangeOptions.from_mapping(config["federation"]["exchange"], source=source)
    if options.compressed and any(site.train.adapter for site in sites.values()):
        raise ConfigError(
            f"{source}: federation.exchange.dtype: {options.dtype} compresses whole-model updates, but the "
            "sites train adapters (train.adapter), which are sent as they are; set dtype: full"
        )
    return options


def _aggregate_options(
    config: Mapping, model: ModelOptions, sites: Mapping[str, Site], source: str
) -> AggregateOptions:
    """The aggregate section as options, with the rules that need the sites: explicit weights name each
    site once, and adapters federate only through the aggregation that combines them."""
    aggregate = AggregateOptions.from_mapping({**config["aggregate"], "dtype": model.dtype}, source=source)
    if isinstance(aggregate.weights, dict):
        check_weights(aggregate.weights, list(sites), f"{source}: aggregate.weights")
    _check_adapters(aggregate, config["federation"], sites, source)
    return aggregate


def _check_adapters(
    aggregate: AggregateOptions, federation: Mapping, sites: Mapping[str, Site], source: str
) -> None:
    """Adapters federate only through the aggregation that combines them (aggregate.adapter_merge)."""
    adapted = [name for name, site in sites.items() if site.train.adapter]
    if not adapted:
        return
    if len(adapted) != len(sites):
        plain = sorted(set(sites) - set(adapted))
        raise ConfigError(
            f"{source}: train.adapter: set for {', '.join(adapted)} but not for {', '.join(plain)}; "
            "every site trains an adapter or none does"
        )
    if not aggregate.entry.adapters:
        takes = [name for name, entry in MERGE_METHODS.items() if entry.adapters]
        raise ConfigError(
            f"{source}: aggregate.method: {aggregate.method} merges whole task vectors; with "
            f"train.adapter use {' or '.join(takes)} (aggregate.adapter_merge says how the adapters combine)"
        )
    problem = aggregate.server_optimizer.adapter_problem(aggregate.adapter_merge)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    if aggregate.compare:
        raise ConfigError(f"{source}: aggregate.compare: not available with train.adapter")
    if federation["site_optimizer"] == "keep":
        raise ConfigError(
            f"{source}: federation.site_optimizer: keep; with train.adapter every round starts fresh "
            "adapters, which have no optimizer state to keep (the round's adapter is merged into the "
            "start model and the next round trains a new one, so last round's moments belong to factors "
            "that no longer train); use reset (the outer step, server_optimizer nesterov, works with "
            "adapters)"
        )
    if aggregate.adapter_merge == "average_factors":
        shapes = {name: (site.train.adapter.r, json.dumps(site.train.adapter.target_modules))
                  for name, site in sites.items()}  # fmt: skip
        if len(set(shapes.values())) > 1:
            listed = ", ".join(f"{n} r={r} targets={t}" for n, (r, t) in shapes.items())
            raise ConfigError(
                f"{source}: aggregate.adapter_merge: average_factors needs the same rank and target "
                f"modules at every site ({listed}); use exact, which takes any ranks"
            )


def _check_site_steps(
    federation: Mapping, sites: Mapping[str, Site], participants: Sequence, source: str
) -> None:
    """federation.site_steps tokens shares one round's steps: every site trains every round, each with
    the same max_steps and global_batch (the steps it shares out)."""
    if federation["site_steps"] != "tokens":
        return
    where = f"{source}: federation.site_steps: tokens"
    if participants:
        raise ConfigError(f"{where} shares each round's steps among every site; leave participation null")
    clusters = sorted({s.cluster for s in sites.values()})
    if len(clusters) > 1:
        # Each train job reads every site's manifest (--token-steps); manifests cross only to
        # federation.aggregate_on, so a site on another cluster could not count the others' tokens.
        raise ConfigError(
            f"{where} needs every site's manifest in each site's training job, and manifests cross only to "
            f"federation.aggregate_on; the sites train on {', '.join(clusters)}: set each site's "
            "train.max_steps in proportion to its tokens by hand, or use site_steps: equal"
        )
    plans = {(s.train.max_steps, s.train.global_batch) for s in sites.values()}
    if len(plans) > 1 or next(iter(plans))[0] is None:
        raise ConfigError(
            f"{where} needs train.max_steps (not epochs) and the same max_steps and global_batch at every "
            f"site, but they are {', '.join(f'{n} {s.train.max_steps}x{s.train.global_batch}' for n, s in sites.items())}"
        )
