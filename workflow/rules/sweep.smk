# Scaling sweep (config `sweep`, workflow/schemas/sweep.schema.yaml): the swept site trains once per
# value, each job from the base model with that value's options, and sweep_report compares the runs.
# Only where the site trains (LOCAL_SITES); the jobs record training.json and loss.csv, no weights.
import re

from fedtune.sweep import sweep_points, sweep_site

SWEEP_SITE = sweep_site(config)
# label (devices-4, ...) -> that job's train options, checked with the config
SWEEP_POINTS = dict(sweep_points(config))
SWEEP_HERE = bool(SWEEP_POINTS) and SWEEP_SITE in LOCAL_SITES
# Part of rule all (get_final_output) where the swept site trains.
SWEEP_TARGETS = [run_path("report", "sweep.csv")] if SWEEP_HERE else []


rule train_sweep:
    input:
        init=base_model_dir(),
        manifest=lambda wc: manifest_path(wc.site),
        shards=lambda wc: shard_dirs(wc.site, "train"),
    output:
        directory(run_path("sweep", "{site}", "{label}")),
    log:
        log_path("train_sweep", "{site}", "{label}"),
    wildcard_constraints:
        site=one_of([SWEEP_SITE] if SWEEP_HERE else []),
        label=one_of([re.escape(label) for label in SWEEP_POINTS]),
    # As train: retried in a new Slurm job, never inside the job (workflow.remote_exec).
    retries:
        0
        if workflow.remote_exec
        else max((o["retries"] for o in SWEEP_POINTS.values()), default=0)
    # As the train rule: conda but no container (scripts/launch's srun must run outside the image).
    conda:
        CONDA_ENV
    threads: lambda wc: train_cpus_per_task(wc.site, SWEEP_POINTS[wc.label])
    resources:
        nodes=lambda wc: SWEEP_POINTS[wc.label]["nodes"],
        tasks=lambda wc: train_slurm_tasks(wc.site, SWEEP_POINTS[wc.label]),
        tasks_per_gpu=lambda wc: train_tasks_per_gpu(wc.site, SWEEP_POINTS[wc.label]),
        cpus_per_task=lambda wc: train_cpus_per_task(wc.site, SWEEP_POINTS[wc.label]),
        gres=lambda wc: train_gres(wc.site, SWEEP_POINTS[wc.label]),
        mem_mb=lambda wc: SWEEP_POINTS[wc.label]["mem_mb"],
        runtime=lambda wc: SWEEP_POINTS[wc.label]["runtime"],
        mpi=lambda wc: (
            "srun"
            if train_launcher(wc.site, SWEEP_POINTS[wc.label]) != "local"
            else None
        ),
    params:
        launcher=LAUNCH,
        launch=lambda wc: train_launch_args(wc.site, SWEEP_POINTS[wc.label]),
        options=lambda wc: to_json(SWEEP_POINTS[wc.label]),
        dtype=config["model"]["dtype"],
        # Beside the output, not in it: Snakemake deletes the outputs of a failed job.
        checkpoints=lambda wc: run_path("sweep", wc.site, "checkpoints", wc.label),
        pickle="--allow-pickle" if config["model"]["allow_pickle"] else "",
    shell:
        "{params.launcher:q} {params.launch} -- python -m fedtune.train --site {wildcards.site}"
        " --init {input.init:q} --manifest {input.manifest:q} --options {params.options:q}"
        " --dtype {params.dtype} --checkpoints {params.checkpoints:q} --out {output:q}"
        " --summary-only {params.pickle} >> {log:q} 2>&1"


rule sweep_report:
    input:
        runs=[run_path("sweep", SWEEP_SITE, label) for label in SWEEP_POINTS],
    output:
        csv=report(
            run_path("report", "sweep.csv"),
            caption="../report/sweep.rst",
            category="Scaling sweep",
        ),
        md=report(
            run_path("report", "sweep.md"),
            caption="../report/sweep.rst",
            category="Scaling sweep",
        ),
        png=report(
            run_path("report", "sweep.png"),
            caption="../report/sweep.rst",
            category="Scaling sweep",
        ),
    log:
        log_path("sweep_report", "sweep"),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        out=lambda wc, output: os.path.dirname(output.csv),
        axis=(config["sweep"] or {}).get("axis", "devices"),
    shell:
        "python -m fedtune.sweep report --out {params.out:q} --axis {params.axis}"
        " --run {input.runs:q} > {log:q} 2>&1"
