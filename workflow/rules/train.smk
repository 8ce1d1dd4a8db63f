# train: one job per (round, site), over the site's nodes. The job checkpoints into
# round-<r>/<site>/checkpoints (not an output: Snakemake deletes the outputs of failed jobs), exits 75
# after a checkpoint forced by SIGUSR1/SIGTERM/SIGINT, and a retry resumes from the newest checkpoint.
# After its export it links what it wrote into checkpoints/export/: Snakemake, which deletes a model it
# holds incomplete (a controller killed while the job ran on), runs the job again and it restores the
# export instead of training; a job started while another trains into the folder stops, naming it
# (fedtune/train/export_record.py, job_lock.py; docs/reliability.md, Interruptions).
# Conda but no container: under apptainer the whole shell, scripts/launch's srun included, would run
# inside the image, which has no Slurm. Resources come from train_job_options (common.smk), so that
# train_sweep (sweep.smk) and train_pooled reuse this rule with their own options.


rule train:
    input:
        init=lambda wc: init_model_dir(wc.round),
        manifest=lambda wc: manifest_path(wc.site),
        shards=lambda wc: shard_dirs(wc.site, "train"),
        optimizer=previous_optimizer,
        token_manifests=token_step_manifests,
    output:
        **OPTIMIZER_OUTPUT,
        model=directory(site_model_dir("{round}", "{site}")),
    log:
        log_path("train", "round-{round}", "{site}"),
    wildcard_constraints:
        # Sites of other clusters come in through fetch_site_model (transfer.smk).
        site=one_of(LOCAL_SITES),
        # Where train_merging or train_scoring make the later rounds (below): round 1 only.
        round="1" if MERGES_IN_TRAINING or SCORED_BEFORE else r"\d+",
    # The rounds' trainings and merges are the run's critical path: when cores are short (a local run),
    # a round's trainings go first, side by side, and evaluations fill the gaps (the demo: see
    # benchmarks/results/workflow/2026-11-28-jobs-per-round.md).
    priority: 1
    # Retried by the main Snakemake, in a new Slurm job; never by the job's own Snakemake (REMOTE mode),
    # which would restart training in the same allocation, minutes before its time limit.
    retries: 0 if workflow.remote_exec else max(RUN.sites[site].train.retries for site in SITES)
    conda:
        CONDA_ENV
    threads: lambda wc: train_job_options(wc).cpus_per_task
    resources:
        nodes=lambda wc: train_job_options(wc).nodes,
        # The task geometry: see TrainOptions.slurm_tasks_per_node and tasks_per_gpu (never
        # --ntasks-per-gpu, which the job's own srun refuses from Slurm 23.11 on).
        tasks=lambda wc: train_job_options(wc).slurm_total_tasks,
        tasks_per_node=lambda wc: train_job_options(wc).slurm_tasks_per_node,
        tasks_per_gpu=lambda wc: train_job_options(wc).tasks_per_gpu,
        cpus_per_task=lambda wc: train_job_options(wc).cpus_per_task,
        gres=lambda wc: train_job_options(wc).gres,
        mem_mb=lambda wc: train_job_options(wc).mem_mb,
        runtime=lambda wc: train_job_options(wc).runtime,
        # --exclusive for a GPU job over several nodes (TrainOptions.slurm_extra).
        slurm_extra=lambda wc: train_job_options(wc).slurm_extra,
        # The job's shell then runs in the allocation itself, and scripts/launch's srun starts the tasks.
        mpi=lambda wc: "srun" if train_job_options(wc).job_launcher != "local" else None,
    params:
        launch=train_launch_args,
        site=lambda wc: wc.site,
        # The train section with what the job reads of the run (dtype, allow_pickle, rounds, ...).
        options=lambda wc: train_job_options(wc).to_json(),
        checkpoints=lambda wc: run_path(f"round-{wc.round}", wc.site, "checkpoints"),
        # The model training starts from; train_merging makes it in the job first.
        start=lambda wc, input: input.init,
        # What the job runs before training, each command ending in `&&`: train_merging's merge,
        # train_scoring's scores (one param, so that the shell of every other training stays as it was).
        merge="",
        round_args=lambda wc: round_args(wc) + token_steps_args(wc),
        summary_only="",
        tracking=lambda wc: tracking_args(),
    shell:
        # Appended, not overwritten: a resumed attempt keeps the log of the one it continues.
        '{params.merge}"$FEDTUNE_LAUNCH" {params.launch} -- python -m fedtune.train --site {params.site}'
        " --init {params.start:q} --manifest {input.manifest:q} --options {params.options:q}"
        " --checkpoints {params.checkpoints:q} --out {output.model:q}"
        " {params.round_args} {params.summary_only} {params.tracking}"
        " >> {log:q} 2>&1"


# Where the models do not meet (evaluate.cross_site none): a training of round r >= 2 first scores round
# r-1's aggregate (its start model) and the site's round r-1 model on the site's test text
# (score_before_training, common.smk), so that the cluster runs one Slurm job per site and round. With
# adapters train_merging does this after its merge.
if SCORED_BEFORE and not MERGES_IN_TRAINING:

    use rule train as train_scoring with:
        input:
            init=lambda wc: init_model_dir(wc.round),
            manifest=lambda wc: manifest_path(wc.site),
            shards=lambda wc: shard_dirs(wc.site, "train"),
            optimizer=previous_optimizer,
            token_manifests=token_step_manifests,
            test=lambda wc: raw_data_dir(wc.site),
            previous=scored_previous_model,
        output:
            **OPTIMIZER_OUTPUT,
            **SCORE_OUTPUT,
            model=directory(site_model_dir("{round}", "{site}")),
        wildcard_constraints:
            site=one_of(LOCAL_SITES),
            round=r"[2-9]|[1-9]\d+",
        params:
            merge=score_before_training,


# The pooled baseline (federation.pooled_baseline): every site's training data at once, from the base
# model, as many blocks as the whole federation trains; evaluated beside the rounds' models.
if RUN.pooled:

    use rule train as train_pooled with:
        input:
            init=base_model_dir(),
            manifest=[manifest_path(site) for site in SITES],
            shards=[d for site in SITES for d in shard_dirs(site, "train")],
        output:
            model=directory(pooled_model_dir()),
        log:
            log_path("train", "pooled"),
        # Off the critical path: evaluations and the pooled model share what the rounds leave.
        priority: 0
        # As train: retried in a new Slurm job, never inside the job (workflow.remote_exec).
        retries: 0 if workflow.remote_exec else RUN.pooled.retries
        params:
            site="pooled",
            checkpoints=run_path("pooled", "checkpoints"),
            round_args="",

    # The pooled model's lr sweep (federation.pooled_lr_factors): the same training at other lrs.
    use rule train_pooled as train_pooled_sweep with:
        output:
            model=directory(pooled_point_dir("{point}", "model")),
        log:
            log_path("train", "{point}"),
        wildcard_constraints:
            point=one_of(POOLED_POINTS),
        params:
            site="pooled",
            checkpoints=lambda wc: pooled_point_dir(wc.point, "checkpoints"),
            round_args="",
