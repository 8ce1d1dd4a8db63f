# exchange (federation.exchange): with a dtype other than full, each site sends its update (its model
# minus the round's start model) compressed instead of its model, on every cluster alike, so that a
# one-cluster run merges the same bytes as a federation. The site's cluster compresses it after training
# (compress_update), keeping what was not sent for its next round (the residual, error feedback); the
# merge rebuilds each tensor against the start model (aggregate.smk); where a remote site's model itself
# is needed (its evaluation), decode_site_model rebuilds it from the update that arrived. The aggregate
# goes back as an update too (compress_aggregate, decode_aggregate, below).


# With a compressed dtype the sites send their updates, and the merge reads them; with error feedback each
# compression keeps a residual for its next round.
EXCHANGE = RUN.exchange
COMPRESSED = EXCHANGE.compressed
RESIDUAL_OUTPUT = (
    {"residual_out": directory(site_residual_dir("{round}", "{site}"))}
    if EXCHANGE.keeps_residual
    else {}
)
AGGREGATE_RESIDUAL_OUTPUT = (
    {"residual_out": directory(aggregate_residual_dir("{round}"))}
    if EXCHANGE.keeps_residual
    else {}
)


# Several fp32 copies of the largest tensor (fedtune.workflow.resources).
exchange_mem_mb = lambda wc: resources.exchange_mem_mb(RUN, base_model_dir())
residual_args = lambda wc, input, output: commands.residual_args(
    RUN, output.get("residual_out"), input.residual
)


if COMPRESSED:

    rule compress_update:
        input:
            model=site_model_dir("{round}", "{site}"),
            start=lambda wc: init_model_dir(wc.round),
            residual=lambda wc: previous_residual(wc.round, wc.site),
        output:
            **RESIDUAL_OUTPUT,
            site_update=directory(site_update_dir("{round}", "{site}")),
        log:
            log_path("compress_update", "round-{round}", "{site}"),
        wildcard_constraints:
            site=one_of(LOCAL_SITES),
        priority: 1
        conda:
            CONDA_ENV
        container:
            CONTAINER
        resources:
            # Several fp32 copies of the largest tensor (aggregate.adapter_size.exchange_mem_mb).
            mem_mb=exchange_mem_mb,
            runtime=60,
        params:
            options=EXCHANGE.to_json(),
            residual=residual_args,
            label=lambda wc: f"site {wc.site} round {wc.round}",
        shell:
            "python -m fedtune.core.updates compress --model {input.model:q} --start {input.start:q}"
            " --options {params.options:q} {params.residual} --label {params.label:q}"
            " --out {output.site_update:q} > {log:q} 2>&1"

    if aggregates_here():

        rule decode_site_model:
            input:
                site_update=site_update_dir("{round}", "{site}"),
                start=lambda wc: init_model_dir(wc.round),
            output:
                directory(site_model_dir("{round}", "{site}")),
            log:
                log_path("decode_site_model", "round-{round}", "{site}"),
            wildcard_constraints:
                site=one_of(REMOTE_SITES),
            group:
                "round-{round}"
            conda:
                CONDA_ENV
            container:
                CONTAINER
            resources:
                mem_mb=4000,
                runtime=60,
            params:
                label=lambda wc: f"site {wc.site}'s update of round {wc.round}",
            shell:
                "python -m fedtune.core.updates decode --update {input.site_update:q} --start {input.start:q}"
                " --label {params.label:q} --out {output:q} > {log:q} 2>&1"

    # The aggregate goes back the same way, as an update against the previous aggregate (round 1: the base
    # model), which every cluster holds. The aggregating cluster keeps its own residual with error feedback
    # (the server-side error compensation of DoubleSqueeze, Tang et al., ICML 2019): what this round's
    # aggregate update did not send is added to the next one's.
    if aggregates_here():

        rule compress_aggregate:
            input:
                model=lambda wc: merge_output_dir(wc.round),
                start=lambda wc: init_model_dir(wc.round),
                residual=lambda wc: previous_residual(wc.round),
            output:
                **AGGREGATE_RESIDUAL_OUTPUT,
                aggregate_update=directory(aggregate_update_dir("{round}")),
            log:
                log_path("compress_aggregate", "round-{round}"),
            priority: 1
            group:
                "round-{round}"
            conda:
                CONDA_ENV
            container:
                CONTAINER
            resources:
                mem_mb=exchange_mem_mb,
                runtime=60,
            params:
                options=EXCHANGE.to_json(),
                residual=residual_args,
                label=lambda wc: f"the aggregate of round {wc.round}",
            shell:
                "python -m fedtune.core.updates compress --model {input.model:q} --start {input.start:q}"
                " --options {params.options:q} {params.residual} --label {params.label:q}"
                " --out {output.aggregate_update:q} > {log:q} 2>&1"

    # Every cluster, the aggregating one included, continues from the aggregate rebuilt from its update,
    # not from the merged model: the same bytes decoded against the same previous aggregate (its sha256
    # checked against the update's header) give the same bits everywhere, where the merged model would
    # drift from the sites' copies by what compression dropped.
    rule decode_aggregate:
        input:
            aggregate_update=aggregate_update_dir("{round}"),
            start=lambda wc: init_model_dir(wc.round),
        output:
            directory(aggregate_model_dir("{round}")),
        log:
            log_path("decode_aggregate", "round-{round}"),
        priority: 1
        group:
            "round-{round}"
        conda:
            CONDA_ENV
        container:
            CONTAINER
        resources:
            mem_mb=4000,
            runtime=60,
        params:
            label=lambda wc: f"the aggregate update of round {wc.round}",
        shell:
            "python -m fedtune.core.updates decode --update {input.aggregate_update:q} --start {input.start:q}"
            " --label {params.label:q} --out {output:q} > {log:q} 2>&1"
