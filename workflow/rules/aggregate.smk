# aggregate: merge the site models of a round into one, streaming tensor by tensor: a merge method over
# the sites' task vectors against the round's start model, then the server optimizer. A round's merges and
# evaluations form the group round-<r>: one Slurm job where the Slurm profile's group-components joins
# the group's parts (local runs ignore groups).


# The aggregate section as build_run_config checked it, with the merged models' dtype (model.dtype).
AGGREGATE = RUN.aggregate


# On the other clusters of a multi-cluster federation, fetch_aggregate (transfer.smk) brings it in.
# Adapters (train.adapter) are combined by the rules of adapters.smk instead.
if aggregates_here() and not ADAPTERS:

    rule aggregate:
        input:
            # federation.participation: the round's participating sites only.
            models=round_model_dirs,
            manifests=round_manifests,
            start=lambda wc: init_model_dir(wc.round),
            server_state=server_state_in,
        output:
            # federation.exchange compressed: the merged model, before it is compressed to go back.
            model=directory(merge_output_dir("{round}")),
            server_state=directory(server_state_dir("{round}")),
        log:
            log_path("aggregate", "round-{round}"),
        priority: 1
        group:
            "round-{round}"
        conda:
            CONDA_ENV
        container:
            CONTAINER
        resources:
            # Private memory: a few copies of the largest tensor in fp32 (under 4 GB for Llama-2-7B;
            # benchmarks/results/aggregate/2026-11-26.md).
            mem_mb=4000,
            runtime=60,
        params:
            models=site_model_args,
            manifests=round_manifest_args,
            options=round_merge_json,
            # With tracking on, the merge's record goes to the run's tracker after it is written.
            track=lambda wc, output: (
                f" && python -m fedtune.core.tracking aggregate --path {output.model}/aggregate.json"
                f" --round {wc.round} {tracking_args()}"
                f" >> {shlex.quote(log_path('aggregate', f'round-{wc.round}'))} 2>&1"
                if tracking_args()
                else ""
            ),
            state_in=lambda wc, input: (
                f"--server-state-in {shlex.quote(input.server_state[0])}"
                if input.server_state
                else ""
            ),
        shell:
            "python -m fedtune.aggregate --out {output.model:q} --options {params.options:q}"
            " --start {input.start:q} {params.state_in}"
            " --server-state-out {output.server_state:q}"
            " --model {params.models:q} --manifest {params.manifests:q} > {log:q} 2>&1"
            "{params.track}"

    rule aggregate_compare:
        input:
            models=round_model_dirs,
            manifests=round_manifests,
            start=lambda wc: init_model_dir(wc.round),
        output:
            directory(compare_model_dir("{round}", "{method}")),
        log:
            log_path("aggregate_compare", "round-{round}-{method}"),
        wildcard_constraints:
            method=one_of(AGGREGATE.compare),
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
            models=site_model_args,
            manifests=round_manifest_args,
            # The compared method with the same parameters, without a server optimizer.
            options=lambda wc: round_merge_json(wc, wc.method),
        shell:
            "python -m fedtune.aggregate --out {output:q} --options {params.options:q}"
            " --start {input.start:q}"
            " --model {params.models:q} --manifest {params.manifests:q} > {log:q} 2>&1"
