"""Where each site's text is read (data residency): on its own cluster, where the models meet
(evaluate.cross_site text_to_models) and, with model.source init, on every cluster; and the settings that
a site whose text may not leave it (dataset.shareable false) refuses. From a validated config dict, so
that the report reads a finished run's settings.json the same way."""

from __future__ import annotations

from collections.abc import Mapping

from fedtune.core.options import ConfigError

# evaluate.cross_site: how the cross-site scores (site A's model on site B's text) are made, by what moves.
TEXT_TO_MODELS = "text_to_models"  # every site's test text is read where the models meet
NO_CROSS_SITE = "none"  # each site's text is read on its own cluster only


def data_read_on(config: Mapping) -> dict[str, tuple[str, ...]]:
    """The clusters where each site's text is read, its own cluster first, from a validated config (defaults
    filled in; the run's settings.json is one): its own (download, tokenize, train); federation.aggregate_on's,
    whose evaluation jobs read every site's test text; with model.source init every cluster, each of which
    trains the base model's tokenizer on every site's training text."""
    sites = config["sites"]
    clusters = sorted({site["cluster"] for site in sites.values()})
    aggregate_on = config["federation"]["aggregate_on"] or next(iter(sites.values()))["cluster"]
    tokenizer = clusters if config["model"]["source"] == "init" else []
    # A settings.json of a run from before evaluate.cross_site read every site's text where the models met.
    evaluators = (
        [aggregate_on] if config["evaluate"].get("cross_site", TEXT_TO_MODELS) == TEXT_TO_MODELS else []
    )
    return {
        name: tuple(dict.fromkeys([site["cluster"], *evaluators, *tokenizer])) for name, site in sites.items()
    }


def resolve_cross_site(config: Mapping) -> str:
    """evaluate.cross_site as set, else its default: text_to_models where every site trains on the cluster
    where the models meet (nothing moves for it), none where sites train on several clusters (each site's
    text then stays on its own cluster, and only scores cross)."""
    chosen = config["evaluate"].get("cross_site")
    if chosen is not None:
        return chosen
    sites = config["sites"]
    aggregate_on = config["federation"]["aggregate_on"] or next(iter(sites.values()))["cluster"]
    return (
        TEXT_TO_MODELS if all(site["cluster"] == aggregate_on for site in sites.values()) else NO_CROSS_SITE
    )


def data_lines(config: Mapping) -> list[str]:
    """One line per site for the report: "site cs: data read only on karolina"."""
    lines = []
    for site, clusters in data_read_on(config).items():
        where = f"only on {clusters[0]}" if len(clusters) == 1 else f"on {', '.join(clusters)}"
        lines.append(f"site {site}: data read {where}")
    return lines


def check_data_stays(config: Mapping, private: Mapping[str, str], source: str) -> None:
    """A site whose text may not leave it (dataset.shareable false; `private`: each such site's cluster) is
    read only on its own cluster and never pooled: refuse, before any job runs, each setting that would
    move it."""
    if not private:
        return
    name = next(iter(private))
    key = f"sites.{name}.dataset.shareable"
    if config["federation"]["pooled_baseline"]:
        raise ConfigError(
            f"{source}: federation.pooled_baseline: trains one model on every site's text, but site {name}'s "
            f"text may not leave it ({key}: false); set federation.pooled_baseline: false, or {key}: true "
            "if its text may be pooled"
        )
    if config["aggregate"]["vocab_rows"] == "counts":
        raise ConfigError(
            f"{source}: aggregate.vocab_rows: counts sends each site's token histogram (token_counts.json: "
            f"how often each token id occurs in the text it trained on) to the merge, but site {name}'s text "
            f"may not leave it ({key}: false); set aggregate.vocab_rows: weights, or {key}: true if its "
            "text may be shared"
        )
    read_on = data_read_on(config)
    for name, cluster in private.items():
        key = f"sites.{name}.dataset.shareable"
        elsewhere = [c for c in read_on[name] if c != cluster]
        if not elsewhere:
            continue
        if config["model"]["source"] == "init":
            raise ConfigError(
                f"{source}: {key}: false, but model.source init trains the tokenizer on every site's text on "
                f"every cluster, so site {name}'s text would be read on {', '.join(elsewhere)} too; start from "
                f"a trained model (model.source hf, local or gguf), or set {key}: true"
            )
        aggregate_on = elsewhere[0]
        raise ConfigError(
            f"{source}: evaluate.cross_site: {TEXT_TO_MODELS} reads every site's test text where the models "
            f"meet ({aggregate_on}, federation.aggregate_on), but site {name} trains on {cluster} and {key} "
            f"is false; set evaluate.cross_site: {NO_CROSS_SITE} (each site's text is then scored on its own "
            f"cluster, and only the scores cross), or {key}: true if its text may be read on {aggregate_on}"
        )
