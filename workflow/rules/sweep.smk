# Scaling sweep (config `sweep`, fedtune/schemas/sweep.schema.yaml): the swept site trains once per
# value, each job from the base model with that value's options (SWEEP_POINTS, common.smk), and
# sweep_report compares the runs. Only where the site trains; the jobs record training.json and
# loss.csv, no weights.
import re


use rule train as train_sweep with:
    input:
        init=base_model_dir(),
        manifest=lambda wc: manifest_path(wc.site),
        shards=lambda wc: shard_dirs(wc.site, "train"),
        optimizer=[],
    output:
        model=directory(run_path("sweep", "{site}", "{label}")),
    log:
        log_path("train_sweep", "{site}", "{label}"),
    wildcard_constraints:
        site=one_of([RUN.sweep_site] if SWEEP_HERE else []),
        label=one_of([re.escape(label) for label in SWEEP_POINTS]),
    # As train: retried in a new Slurm job, never inside the job (workflow.remote_exec).
    retries: 0 if workflow.remote_exec else max((p.options.retries for p in RUN.sweep), default=0)
    params:
        # Beside the output, not in it: Snakemake deletes the outputs of a failed job.
        checkpoints=lambda wc: run_path("sweep", wc.site, "checkpoints", wc.label),
        round_args="",
        summary_only="--summary-only",


rule sweep_report:
    input:
        runs=[run_path("sweep", RUN.sweep_site, label) for label in SWEEP_POINTS],
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
        axis=RUN.sweep_axis,
    shell:
        "python -m fedtune.report.sweep report --out {params.out:q} --axis {params.axis}"
        " --run {input.runs:q} > {log:q} 2>&1"
