# Adapters (train.adapter): the sites' LoRA adapters are combined into one adapter where the models
# meet (aggregate.adapter_merge), and every cluster merges that adapter into the round's start model
# itself, so only adapters cross between clusters: merge_adapter in the round's merge job where the
# models meet, the training job itself on the other clusters (train_merging). The next round starts
# from the merged model with fresh adapters (FLoRA).

if ADAPTERS and aggregates_here():

    rule aggregate_adapters:
        input:
            models=lambda wc: [site_model_dir(wc.round, site) for site in SITES],
            manifests=[manifest_path(site) for site in SITES],
            server_state=server_state_in,
            # The round's start model: tensors the sites train whole (modules_to_save) step from it.
            start=lambda wc: init_model_dir(wc.round),
        output:
            adapter=directory(aggregate_adapter_dir("{round}")),
            server_state=directory(server_state_dir("{round}")),
        log:
            log_path("aggregate", "round-{round}"),
        group:
            "round-{round}"
        conda:
            CONDA_ENV
        container:
            CONTAINER
        resources:
            mem_mb=4000,
            runtime=30,
        params:
            models=site_model_args,
            manifests=[f"{site}={manifest_path(site)}" for site in SITES],
            # adapter_merge, weights, server_optimizer and max_shard_size of the aggregate section.
            options=RUN.aggregate.merge_json(),
            state_in=lambda wc, input: (
                f"--server-state-in {shlex.quote(input.server_state[0])}"
                if input.server_state
                else ""
            ),
        shell:
            "python -m fedtune.aggregate.adapters --out {output.adapter:q} --options {params.options:q}"
            " --adapters {params.models:q} {params.state_in} --start {input.start:q}"
            " --server-state-out {output.server_state:q}"
            " --manifest {params.manifests:q} > {log:q} 2>&1"


# Where the models do not meet, an aggregate adapter that an evaluation job scores there (the last
# round's; the earlier ones are scored merged by the next training, train_merging) is merged into the
# round's start at a site there, which is the aggregating cluster's start bit for bit: the same command
# makes the same bits as here.
if ADAPTERS:

    rule merge_adapter:
        input:
            adapter=aggregate_adapter_dir("{round}"),
            start=lambda wc: (
                init_model_dir(wc.round)
                if aggregates_here() or int(wc.round) == 1
                else site_start_dir(wc.round, LOCAL_SITES[0])
            ),
        output:
            directory(aggregate_model_dir("{round}")),
        log:
            log_path("merge_adapter", "round-{round}"),
        group:
            "round-{round}"
        conda:
            CONDA_ENV
        container:
            CONTAINER
        resources:
            # Streamed tensor by tensor, like aggregate.
            mem_mb=4000,
            runtime=60,
        params:
            options=RUN.aggregate.merge_json(),
        shell:
            "python -m fedtune.aggregate.adapters --merge {input.adapter:q} --base {input.start:q}"
            " --out {output:q} --options {params.options:q} > {log:q} 2>&1"


if MERGES_IN_TRAINING:

    # A training of round r >= 2 on a cluster where the models do not meet: the job first merges round
    # r-1's aggregate adapter into round r-1's start model (the same command as merge_adapter, so the
    # same bits), then trains from it. One Slurm job per training and round; each local site keeps its
    # own copy of the start model (round-<r>/<site>/start), which never crosses to another cluster.
    use rule train as train_merging with:
        input:
            init=previous_start,
            adapter=lambda wc: aggregate_adapter_dir(int(wc.round) - 1),
            manifest=lambda wc: manifest_path(wc.site),
            shards=lambda wc: shard_dirs(wc.site, "train"),
            optimizer=previous_optimizer,
            token_manifests=token_step_manifests,
            # evaluate.cross_site none: the scores it makes before training (score_before_training).
            test=lambda wc: raw_data_dir(wc.site) if SCORED_BEFORE else [],
            previous=scored_previous_model,
        output:
            **OPTIMIZER_OUTPUT,
            **SCORE_OUTPUT,
            model=directory(site_model_dir("{round}", "{site}")),
            start=directory(site_start_dir("{round}", "{site}")),
        wildcard_constraints:
            site=one_of(LOCAL_SITES),
            round=r"[2-9]|[1-9]\d+",
        params:
            start=lambda wc, output: output.start,
            # The merge, then (evaluate.cross_site none) the scores of the start it made and of the
            # site's previous adapter.
            merge=lambda wc, input, output: (
                f"python -m fedtune.aggregate.adapters --merge {shlex.quote(input.adapter)}"
                f" --base {shlex.quote(input.init)} --out {shlex.quote(output.start)}"
                f" --options {shlex.quote(RUN.aggregate.merge_json())}"
                f" >> {shlex.quote(log_path('train', f'round-{wc.round}', wc.site))} 2>&1 && "
                + score_before_training(wc, input, output)
            ),
