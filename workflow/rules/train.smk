# train: one job per (round, site), over the site's nodes. The job checkpoints into
# round-<r>/<site>/checkpoints (not an output: Snakemake deletes the outputs of failed jobs), exits 75
# after a checkpoint forced by SIGUSR1/SIGTERM, and a retry resumes from the newest checkpoint.
# Conda but no container: under apptainer the whole shell, scripts/launch's srun included, would run
# inside the image, which has no Slurm.


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
    # Retried by the main Snakemake, in a new Slurm job; never by the job's own Snakemake (REMOTE mode),
    # which would restart training in the same allocation, minutes before its time limit.
    retries: 0 if workflow.remote_exec else max(train_options(site)["retries"] for site in SITES)
    conda:
        CONDA_ENV
    threads: lambda wc: train_cpus_per_task(wc.site)
    resources:
        nodes=lambda wc: train_options(wc.site)["nodes"],
        tasks=lambda wc: train_slurm_tasks(wc.site),
        tasks_per_gpu=lambda wc: train_tasks_per_gpu(wc.site),
        cpus_per_task=lambda wc: train_cpus_per_task(wc.site),
        gres=lambda wc: train_gres(wc.site),
        mem_mb=lambda wc: train_options(wc.site)["mem_mb"],
        runtime=lambda wc: train_options(wc.site)["runtime"],
        # The job's shell then runs in the allocation itself, and scripts/launch's srun starts the tasks.
        mpi=lambda wc: "srun" if train_launcher(wc.site) != "local" else None,
    params:
        launcher=LAUNCH,
        launch=lambda wc: train_launch_args(wc.site),
        options=lambda wc: to_json(train_options(wc.site)),
        dtype=config["model"]["dtype"],
        checkpoints=lambda wc: run_path(f"round-{wc.round}", wc.site, "checkpoints"),
        pickle="--allow-pickle" if config["model"]["allow_pickle"] else "",
    shell:
        # Appended, not overwritten: a resumed attempt keeps the log of the one it continues.
        "{params.launcher:q} {params.launch} -- python -m fedtune.train --site {wildcards.site}"
        " --init {input.init:q} --manifest {input.manifest:q} --options {params.options:q}"
        " --dtype {params.dtype} --checkpoints {params.checkpoints:q} --out {output:q}"
        " {params.pickle} >> {log:q} 2>&1"
