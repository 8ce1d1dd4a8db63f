# train: one job per (round, site), over the site's nodes. The job checkpoints into
# round-<r>/<site>/checkpoints (not an output: Snakemake deletes the outputs of failed jobs), exits 75
# after a checkpoint forced by SIGUSR1/SIGTERM, and a retry resumes from the newest checkpoint.
# Conda but no container: under apptainer the whole shell, scripts/launch's srun included, would run
# inside the image, which has no Slurm. Resources come from train_job_options (common.smk), so that
# train_sweep (sweep.smk) reuses this rule with its own options.


rule train:
    input:
        init=lambda wc: init_model_dir(wc.round),
        manifest=lambda wc: manifest_path(wc.site),
        shards=lambda wc: shard_dirs(wc.site, "train"),
    output:
        directory(site_model_dir("{round}", "{site}")),
    log:
        log_path("train", "round-{round}", "{site}"),
    wildcard_constraints:
        # Sites of other clusters come in through fetch_site_model (transfer.smk).
        site=one_of(LOCAL_SITES),
    retries: max(RUN.sites[site].train.retries for site in SITES)
    conda:
        CONDA_ENV
    threads: lambda wc: train_job_options(wc).cpus_per_task
    resources:
        nodes=lambda wc: train_job_options(wc).nodes,
        tasks=lambda wc: train_job_options(wc).slurm_tasks,
        tasks_per_gpu=lambda wc: train_job_options(wc).tasks_per_gpu,
        cpus_per_task=lambda wc: train_job_options(wc).cpus_per_task,
        gres=lambda wc: train_job_options(wc).gres,
        mem_mb=lambda wc: train_job_options(wc).mem_mb,
        runtime=lambda wc: train_job_options(wc).runtime,
        # The job's shell then runs in the allocation itself, and scripts/launch's srun starts the tasks.
        mpi=lambda wc: "srun" if train_job_options(wc).job_launcher != "local" else None,
    params:
        launcher=LAUNCH,
        launch=train_launch_args,
        options=lambda wc: train_job_options(wc).to_json(),
        dtype=config["model"]["dtype"],
        checkpoints=lambda wc: run_path(f"round-{wc.round}", wc.site, "checkpoints"),
        pickle="--allow-pickle" if config["model"]["allow_pickle"] else "",
        summary_only="",
    shell:
        # Appended, not overwritten: a resumed attempt keeps the log of the one it continues.
        "{params.launcher:q} {params.launch} -- python -m fedtune.train --site {wildcards.site}"
        " --init {input.init:q} --manifest {input.manifest:q} --options {params.options:q}"
        " --dtype {params.dtype} --checkpoints {params.checkpoints:q} --out {output:q}"
        " {params.pickle} {params.summary_only} >> {log:q} 2>&1"
