# report: tables and figures of the whole run, collected by `snakemake --report`.
import os
import shlex

# ROUND:SITE=PATH of the files the train stage writes into every site model folder.
TRAINING_SUMMARIES = [
    f"{r}:{site}={site_model_dir(r, site)}/training.json"
    for r in ROUNDS
    for site in round_sites(r)
] + ([f"{ROUNDS[-1]}:pooled={pooled_model_dir()}/training.json"] if RUN.pooled else [])
LOSS_CURVES = [
    f"{r}:{site}={site_model_dir(r, site)}/loss.csv"
    for r in ROUNDS
    for site in round_sites(r)
]
# The main table and its companion (fedtune.core.metrics): perplexity and bits per byte, or accuracy and
# macro-F1.
REPORT_SECOND = TASK_METRICS[TASK].second
REPORT_TITLE = TASK_METRICS[TASK].title
HEATMAP_CAPTION = TASK_METRICS[TASK].heatmap_caption
# With the pooled baseline: the federation gap, merged model against pooled model, per round and site.
GAP_OUTPUTS = (
    {
        name: report(
            run_path("report", f"gap.{ext}"),
            caption="../report/gap.rst",
            category="Federation gap",
        )
        for name, ext in (
            ("gap", "csv"),
            ("gap_md", "md"),
            ("gap_html", "html"),
            ("gap_png", "png"),
        )
    }
    if RUN.pooled
    else {}
)

# With evaluate.tasks: one table per downstream task (report/tasks/<task>.csv, .md, .html).
TASK_OUTPUTS = {
    f"task{i}_{ext}": report(
        task_table(name, ext),
        caption="../report/tasks.rst",
        category="Downstream tasks",
    )
    for i, name in enumerate(DOWNSTREAM_NAMES)
    for ext in ("html", "csv", "md")
}


rule report_settings:
    output:
        run_path("report", "settings.json"),
    log:
        log_path("report", "settings"),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        # The config as validated, defaults included. A function: the templates' {text} is no wildcard.
        settings=lambda wc: to_json(RUN.raw),
    shell:
        "printf '%s\\n' {params.settings:q} > {output:q} 2> {log:q}"


rule report:
    input:
        evals=EVAL_RESULTS,
        tasks=TASK_RESULTS,
        # A file, not a param: the report shows every param of its rule beside each result.
        settings=run_path("report", "settings.json"),
        # training.json and loss.csv live inside these folders (directory outputs of train).
        models=[site_model_dir(r, site) for r in ROUNDS for site in round_sites(r)]
        + ([pooled_model_dir()] if RUN.pooled else []),
    output:
        **GAP_OUTPUTS,
        **TASK_OUTPUTS,
        # The report shows web pages and images; CSV and Markdown files are downloads there.
        main_html=report(
            run_path("report", f"{REPORT_METRIC}.html"),
            caption=f"../report/{REPORT_METRIC}.rst",
            category=REPORT_TITLE,
        ),
        main=report(
            run_path("report", f"{REPORT_METRIC}.csv"),
            caption=f"../report/{REPORT_METRIC}.rst",
            category=REPORT_TITLE,
        ),
        main_md=report(
            run_path("report", f"{REPORT_METRIC}.md"),
            caption=f"../report/{REPORT_METRIC}.rst",
            category=REPORT_TITLE,
        ),
        second=report(
            run_path("report", f"{REPORT_SECOND}.csv"),
            caption=f"../report/{REPORT_SECOND}.rst",
            category=REPORT_TITLE,
        ),
        heatmap=report(
            run_path("report", f"{REPORT_METRIC}.png"),
            caption=f"../report/{HEATMAP_CAPTION}",
            category=REPORT_TITLE,
        ),
        rounds=report(
            run_path("report", "rounds.png"),
            caption="../report/rounds.rst",
            category=REPORT_TITLE,
        ),
        training_html=report(
            run_path("report", "training.html"),
            caption="../report/training.rst",
            category="Training",
        ),
        training=report(
            run_path("report", "training.csv"),
            caption="../report/training.rst",
            category="Training",
        ),
        training_md=report(
            run_path("report", "training.md"),
            caption="../report/training.rst",
            category="Training",
        ),
        loss=report(
            run_path("report", "loss.png"),
            caption="../report/loss.rst",
            category="Training",
        ),
        settings_html=report(
            run_path("report", "settings.html"),
            caption="../report/settings.rst",
            category="Settings",
        ),
        settings=run_path("report", "settings.csv"),
    log:
        log_path("report", "report"),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        out=lambda wc, output: os.path.dirname(output.main),
        training=TRAINING_SUMMARIES,
        losses=LOSS_CURVES,
        tasks=commands.task_args(RUN, LAYOUT),
        pooled=commands.pooled_point_args(RUN),
    shell:
        "python -m fedtune.report --out {params.out:q} --eval {input.evals:q}"
        " --training {params.training:q} --loss {params.losses:q} {params.tasks} {params.pooled}"
        " --settings {input.settings:q} > {log:q} 2>&1"


# What the run cost (fedtune.report.cost): per round and cluster, bytes crossed, the time split,
# node-hours, GPU-hours and energy from the jobs' records (logs/jobs/) and, for Slurm jobs, sacct, which
# runs here in the controller (a local rule), where Slurm's commands answer.
COST_CROSSINGS = " ".join(
    f"--crossing {shlex.quote(f'{rnd}:{maker}:{receiver}={item}')}"
    for item, maker, receiver, rnd, _ in crossing_items()
    if rnd > 0
)


# The clusters where the models do not meet send their own accounting (their sacct) after their last job.
COST_PARTS = [run_path(c.item) for c in cost_crossings(RUN) if c.receiver == HERE]


rule report_cost:
    input:
        evals=EVAL_RESULTS,
        remote_jobs=COST_PARTS,
        settings=run_path("report", "settings.json"),
        models=[site_model_dir(r, site) for r in ROUNDS for site in round_sites(r)]
        + ([pooled_model_dir()] if RUN.pooled else []),
    output:
        html=report(
            run_path("report", "cost.html"),
            caption="../report/cost.rst",
            category="Cost",
        ),
        png=report(
            run_path("report", "cost.png"),
            caption="../report/cost.rst",
            category="Cost",
        ),
        csv=run_path("report", "cost.csv"),
        md=run_path("report", "cost.md"),
        crossed=run_path("report", "cost_items.csv"),
        per_job=run_path("report", "cost_jobs.csv"),
        summary=run_path("report", "cost_summary.csv"),
    log:
        log_path("report", "cost"),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        out=lambda wc, output: os.path.dirname(output.csv),
        run=lambda wc: str(RUN_DIR),
        training=TRAINING_SUMMARIES,
        crossings=COST_CROSSINGS,
        remote_jobs=lambda wc, input: (
            "--remote-jobs " + " ".join(shlex.quote(p) for p in input.remote_jobs)
            if input.remote_jobs
            else ""
        ),
    shell:
        "python -m fedtune.report.cost --out {params.out:q} --run {params.run:q}"
        " --settings {input.settings:q} --eval {input.evals:q} --training {params.training:q}"
        " {params.remote_jobs} {params.crossings} > {log:q} 2>&1"
