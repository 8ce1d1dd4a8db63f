# report: tables and figures of the whole run, collected by `snakemake --report`.
import os

# ROUND:SITE=PATH of the files the train stage writes into every site model folder.
TRAINING_SUMMARIES = [
    f"{r}:{site}={site_model_dir(r, site)}/training.json"
    for r in ROUNDS
    for site in SITES
]
LOSS_CURVES = [
    f"{r}:{site}={site_model_dir(r, site)}/loss.csv" for r in ROUNDS for site in SITES
]


rule report:
    input:
        evals=EVAL_RESULTS,
        # training.json and loss.csv live inside these folders (directory outputs of train).
        models=[site_model_dir(r, site) for r in ROUNDS for site in SITES],
    output:
        perplexity=report(
            run_path("report", "perplexity.csv"),
            caption="../report/perplexity.rst",
            category="Perplexity",
        ),
        perplexity_md=report(
            run_path("report", "perplexity.md"),
            caption="../report/perplexity.rst",
            category="Perplexity",
        ),
        bits_per_byte=report(
            run_path("report", "bits_per_byte.csv"),
            caption="../report/bits_per_byte.rst",
            category="Perplexity",
        ),
        heatmap=report(
            run_path("report", "perplexity.png"),
            caption="../report/heatmap.rst",
            category="Perplexity",
        ),
        rounds=report(
            run_path("report", "rounds.png"),
            caption="../report/rounds.rst",
            category="Perplexity",
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
    log:
        log_path("report", "report"),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        out=lambda wc, output: os.path.dirname(output.perplexity),
        training=TRAINING_SUMMARIES,
        losses=LOSS_CURVES,
    shell:
        "python -m fedtune.report --out {params.out:q} --eval {input.evals:q}"
        " --training {params.training:q} --loss {params.losses:q} > {log:q} 2>&1"
