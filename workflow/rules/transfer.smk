# transfer: what crosses between clusters (crossing_items, common.smk) moves with rsync, unattended. Its
# maker marks it complete (mark_complete) or sends it (push); the receiving rules wait for it, up to
# federation.wait, and verify every file. These rules only match what this cluster does not make itself,
# so no output has two producers.
# The waiting jobs print their progress to the controller's console as well as to their log.
TRANSFER = "python -m fedtune.core.transfer"


# A fetched or received whole model of round 2 on must say it was made from the round's start model here
# (fedtune.run.crossings.checks_start): a stale copy is waited for, never taken.
from fedtune.run.crossings import aggregate_item, checks_start, site_item

# The aggregate that crosses (its adapter, compressed update or model), and what of a site's round crosses.
AGGREGATE_ITEM, SITE_ITEM = aggregate_item(RUN), site_item(RUN)


# The paths an item may have (a wildcard constraint), and the clusters this one pushes to (fedtune.workflow).
CROSSING_ITEM = layout.CROSSING_ITEM
PUSH_TO = commands.push_to(RUN)


# The transfer CLI's command and options that bring an item (made elsewhere) to its target here.
receive_args = functools.partial(commands.receive_args, RUN)


rule fetch_manifest:
    output:
        manifest_path("{site}"),
    log:
        log_path("fetch_manifest", "{site}"),
    wildcard_constraints:
        site=one_of(REMOTE_SITES),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    # No core held: a transfer mostly waits (for days, maybe), and must not keep the jobs that the other
    # cluster waits for in turn from starting. Its checksums take a core for a minute at the end.
    threads: 0
    params:
        args=lambda wc, output: receive_args(f"data/{wc.site}/manifest.json", output[0]),
        start="",
    # --here: this cluster, for the command that brings back a pushed item whose inbox copy is gone.
    shell:
        f"{TRANSFER} {{params.args}} {{params.start}} --here {HERE} 2>&1 | tee {{log:q}}"


# A waiting job starts only once what it waits for can exist, here once the round's start model is (a
# site's model of round r comes from round r-1's aggregate): no R jobs polling from the first minute.
# Snakemake's `use rule ... with:` resets localrule (9.27: the with block's default, False, replaces it),
# so each inheriting rule says it again (test_plan.py: the fetches run in the controller).
# With federation.exchange compressed, a site's update crosses instead (decode_site_model rebuilds the
# model where it is needed).
use rule fetch_manifest as fetch_site_model with:
    input:
        after=lambda wc: init_model_dir(wc.round),
    output:
        directory(
            (site_update_dir if COMPRESSED else site_model_dir)("{round}", "{site}")
        ),
    log:
        log_path("fetch_site_model", "{round}-{site}"),
    localrule: True
    params:
        args=lambda wc, output: receive_args(
            f"round-{wc.round}/{wc.site}/{SITE_ITEM}", output[0]
        ),
        start=lambda wc: (
            f"--start {shlex.quote(init_model_dir(wc.round))}"
            if checks_start(RUN, wc.round)
            else ""
        ),


if not aggregates_here():

    # With adapters only the aggregate adapter travels; rule merge_adapter makes the model here. With
    # federation.exchange compressed its update does; rule decode_aggregate makes the model here.
    # After this cluster's own models of the round, which the aggregate needs.
    use rule fetch_manifest as fetch_aggregate with:
        input:
            after=lambda wc: [site_model_dir(wc.round, site) for site in LOCAL_SITES],
        output:
            directory(
                aggregate_adapter_dir("{round}")
                if ADAPTERS
                else (
                    aggregate_update_dir("{round}")
                    if COMPRESSED
                    else aggregate_model_dir("{round}")
                )
            ),
        log:
            log_path("fetch_aggregate", "{round}"),
        localrule: True
        params:
            args=lambda wc, output: receive_args(
                f"round-{wc.round}/aggregate/{AGGREGATE_ITEM}", output[0]
            ),
            start=lambda wc: (
                f"--start {shlex.quote(init_model_dir(wc.round))}"
                if checks_start(RUN, wc.round)
                else ""
            ),


# evaluate.cross_site none: the scores made on another cluster, where a site's text is, one JSON per (model,
# site), marked complete with its sha256 as models are. A round's scores are waited for once the round's
# aggregate is made here (the other clusters score it), the base model's once it is here.
import re

SCORED_ELSEWHERE = [site for site in SITES if not scored_here(site)]
if aggregates_here() and SCORED_ELSEWHERE:

    use rule fetch_manifest as fetch_score with:
        input:
            after=lambda wc: aggregate_model_dir(wc.round),
        output:
            run_path("round-{round}", "eval", "{model}", "{site}.json"),
        log:
            log_path("fetch_score", "{round}-{model}-{site}"),
        wildcard_constraints:
            site=one_of(SCORED_ELSEWHERE),
            model=one_of([re.escape(m) for m in EVAL_MODELS]),
        localrule: True
        params:
            args=lambda wc, output: receive_args(
                scoring.made_at(RUN, wc.model, wc.site, wc.round), output[0]
            ),

    use rule fetch_manifest as fetch_base_score with:
        input:
            after=base_model_dir(),
        output:
            run_path("eval", "base", "{site}.json"),
        log:
            log_path("fetch_score", "base-{site}"),
        wildcard_constraints:
            site=one_of(SCORED_ELSEWHERE),
        localrule: True
        params:
            args=lambda wc, output: receive_args(
                scoring.score_path("base", wc.site), output[0]
            ),


# The report's cost table (fedtune.report.cost): a cluster where the models do not meet writes its own
# commands with its own sacct accounting after everything else it makes, and sends it like a score.
COST_PARTS_ELSEWHERE = [c.maker for c in cost_crossings(RUN) if c.maker != HERE]
if HERE in {c.maker for c in cost_crossings(RUN)}:

    rule report_cost_part:
        input:
            # After this cluster's last job: everything else it sends.
            [
                run_path(item)
                for item, maker, *_ in crossing_items()
                if maker == HERE and item != cost_part(HERE)
            ],
        output:
            run_path(cost_part(HERE)),
        log:
            log_path("report", "cost-part"),
        localrule: True
        conda:
            CONDA_ENV
        container:
            CONTAINER
        params:
            run=lambda wc: str(RUN_DIR),
            cluster=HERE,
        shell:
            "python -m fedtune.report.cost --jobs-only {params.cluster} --run {params.run:q} --out {output:q}"
            " > {log:q} 2>&1"


if aggregates_here() and COST_PARTS_ELSEWHERE:

    use rule fetch_manifest as fetch_cost_part with:
        input:
            after=aggregate_model_dir(ROUNDS[-1]),
        output:
            run_path(cost_part("{cluster}")),
        log:
            log_path("fetch_cost_part", "{cluster}"),
        wildcard_constraints:
            cluster=one_of(COST_PARTS_ELSEWHERE),
        localrule: True
        params:
            args=lambda wc, output: receive_args(cost_part(wc.cluster), output[0]),


# A folder or file another cluster pulls: the sha256 list of its files, written once it is in place, and
# the item with its list published under exchange/outbox (a copy, a reflink where the file system has
# them: never a link to the live file), where the others read it.
rule mark_complete:
    input:
        run_path("{item}"),
    output:
        run_path("{item}.COMPLETE"),
    log:
        log_path("mark_complete", "{item}"),
    wildcard_constraints:
        item=CROSSING_ITEM,
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        outbox=lambda wc: outbox_path(wc.item),
    shell:
        f"{TRANSFER} mark --path {{input:q}} --out {{output:q}} --outbox {{params.outbox:q}} > {{log:q}} 2>&1"


# A folder or file sent to a cluster whose federation.remotes entry says push: its old marker there
# withdrawn, then into its inbox, checked, the marker last; the receipt here records it. The receiver
# copies it out of its inbox and keeps the inbox copy, so a deleted received output comes back from there.
rule push:
    input:
        run_path("{item}"),
    output:
        run_path("sent", "{cluster}", "{item}.COMPLETE"),
    log:
        log_path("push", "{cluster}", "{item}"),
    wildcard_constraints:
        item=CROSSING_ITEM,
        cluster=one_of(PUSH_TO),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    threads: 0
    params:
        args=lambda wc: commands.push_args(RUN, LAYOUT, wc.item, wc.cluster),
    shell:
        f"{TRANSFER} push {{params.args}} --receipt {{output:q}} 2>&1 | tee {{log:q}}"
