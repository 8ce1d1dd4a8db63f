# exchange (federation.exchange): with a dtype other than full, each site sends its update (its model
# minus the round's start model) compressed instead of its model, on every cluster alike, so that a
# one-cluster run merges the same bytes as a federation. The site's cluster compresses it after training
# (compress_update), keeping what was not sent for its next round (the residual, error feedback); the
# merge rebuilds each tensor against the start model (aggregate.smk); where a remote site's model itself
# is needed (its evaluation), decode_site_model rebuilds it from the update that arrived.
if COMPRESSED:

    rule compress_update:
        input:
            model=site_model_dir("{round}", "{site}"),
            start=lambda wc: init_model_dir(wc.round),
            residual=previous_residual,
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
            # A few copies of the largest tensor in fp32, as the merge.
            mem_mb=4000,
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
