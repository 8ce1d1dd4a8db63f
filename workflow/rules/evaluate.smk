# evaluate: perplexity of the base model, every site model and every aggregate on each site's test text, one
# job per model (loaded once for every site); with evaluate.tasks, lm-eval's downstream tasks on the base
# model and the last round's models. A round's evaluations run in the round's merge job (group round-<r>).
# With evaluate.cross_site none (sites on several clusters, by default) each cluster scores the models it
# holds on its own sites' text only (fedtune.run.scoring): a site's model on its own text, the base model
# and the merged models on every site here; the scores made elsewhere arrive (fetch_score) as files.
import re

# Every evaluation result, base model first (the report's inputs), wherever it is made.
EVAL_RESULTS = [
    run_path(path) for path in scoring.score_paths(RUN)
] + pooled_point_evals()
# The models scored here on every site whose text is read here (cross_site text_to_models: every model
# where the models meet), and the site models scored here on their own site's text only (cross_site none).
CROSS_MODELS_HERE = (
    (EVAL_MODELS if aggregates_here() else [])
    if scoring.cross_site(RUN)
    else (MERGED_MODELS if aggregates_here() else ["aggregate"])
)
OWN_MODELS_HERE = (
    []
    if scoring.cross_site(RUN)
    else [site for site in SITES if scored_here(site) and trains_here(site)]
)

# The evaluation command with the rules' params (fedtune.workflow.commands.evaluate_command).
EVAL_SHELL = commands.EVAL_SHELL
DOWNSTREAM_MODELS = [*SITES, "aggregate"]


sites_scored_here = functools.partial(layout.sites_scored_here, RUN)
# Host memory from the model's size (fedtune.workflow.resources).
evaluation_mem_mb = lambda wc: resources.evaluation_mem_mb(RUN, base_model_dir())
# The base an evaluated adapter sits on (layout.adapter_base), and the flag that gives it.
adapter_base = lambda wc: LAYOUT.adapter_base(wc.get("model"), wc.get("round"))
base_arg = lambda wc, input: (
    f"--base {shlex.quote(input.base[0])}" if input.get("base") else ""
)


# Nothing is scored on a cluster that reads no site's text (with cross_site text_to_models, the
# clusters where the models do not meet).
if sites_scored_here("base"):

    rule evaluate_base:
        input:
            model=base_model_dir(),
            data=[raw_data_dir(site) for site in sites_scored_here("base")],
        output:
            [
                run_path("eval", "base", f"{site}.json")
                for site in sites_scored_here("base")
            ],
        log:
            log_path("evaluate", "base"),
        conda:
            CONDA_ENV
        container:
            CONTAINER
        threads: 2
        resources:
            # From the model's size (evaluation_mem_mb, above).
            mem_mb=evaluation_mem_mb,
            runtime=60,
        params:
            sites=lambda wc, output: commands.eval_sites(RUN, LAYOUT, output),
            options=EVAL_OPTIONS.perplexity_json(),
            label="base",
            round=0,
            base="",
            tracking=lambda wc: tracking_args(),
        shell:
            EVAL_SHELL

    use rule evaluate_base as evaluate_round with:
        input:
            # A site's model of that round, the round's aggregate or a compared merge.
            model=lambda wc: round_model_dir(wc.round, wc.model),
            data=[raw_data_dir(site) for site in sites_scored_here("aggregate")],
            # A site's adapter (train.adapter) is evaluated on its round's start model, unmerged.
            base=adapter_base,
        output:
            [
                run_path("round-{round}", "eval", "{model}", f"{site}.json")
                for site in sites_scored_here("aggregate")
            ],
        log:
            log_path("evaluate", "round-{round}", "{model}"),
        wildcard_constraints:
            model=one_of([re.escape(m) for m in CROSS_MODELS_HERE]),
        # With the round's merge: one Slurm job per round where the models meet (profiles' group-components).
        group:
            "round-{round}"
        params:
            label=lambda wc: wc.model,
            round=lambda wc: wc.round,
            base=base_arg,

    # evaluate.cross_site none: a site's model on its own site's text only, on the site's cluster.
    use rule evaluate_round as evaluate_round_own with:
        input:
            model=lambda wc: round_model_dir(wc.round, wc.model),
            data=lambda wc: [raw_data_dir(wc.model)],
            base=adapter_base,
        output:
            run_path("round-{round}", "eval", "{model}", "{model}.json"),
        log:
            log_path("evaluate", "round-{round}", "{model}"),
        wildcard_constraints:
            model=one_of(OWN_MODELS_HERE),

    if RUN.pooled:

        use rule evaluate_base as evaluate_pooled with:
            input:
                model=pooled_model_dir(),
                data=[raw_data_dir(site) for site in SITES],
                base=adapter_base,
            output:
                [pooled_eval(site) for site in SITES],
            log:
                log_path("evaluate", "pooled"),
            params:
                label="pooled",
                base=base_arg,
                # Beside the last round's models, whose tokens it has seen.
                round=RUN.rounds,

    if RUN.pooled and POOLED_POINTS:

        # Each pooled model of the lr sweep (federation.pooled_lr_factors), labelled as its folder.
        use rule evaluate_pooled as evaluate_pooled_sweep with:
            input:
                model=lambda wc: pooled_point_dir(wc.point, "model"),
                data=[raw_data_dir(site) for site in SITES],
                base=adapter_base,
            output:
                [pooled_point_dir("{point}", "eval", f"{site}.json") for site in SITES],
            log:
                log_path("evaluate", "{point}"),
            wildcard_constraints:
                point=one_of(POOLED_POINTS),
            params:
                label=lambda wc: wc.point,


# Downstream tasks (evaluate.tasks): lm-eval on the data the download stage put in the run folder.
TASKS_SHELL = (
    "python -m fedtune.evaluate.downstream --model {input.model:q} {params.base} --tasks-dir {input.tasks:q}"
    " --options {params.options:q}"
    " --label {params.label} --round {params.round} --out {output:q} > {log:q} 2>&1"
)


rule evaluate_tasks_base:
    input:
        model=base_model_dir(),
        tasks=tasks_dir(),
    output:
        task_scores("base"),
    log:
        log_path("evaluate_tasks", "base"),
    conda:
        CONDA_ENV
    container:
        CONTAINER
    threads: 2
    resources:
        # From the model's size (common.smk).
        mem_mb=evaluation_mem_mb,
        runtime=60,
    params:
        options=EVAL_OPTIONS.downstream_json(),
        label="base",
        round=0,
        base="",
    shell:
        TASKS_SHELL


use rule evaluate_tasks_base as evaluate_tasks_round with:
    input:
        model=lambda wc: round_model_dir(wc.round, wc.model),
        tasks=tasks_dir(),
        base=adapter_base,
    output:
        task_scores("{model}", "{round}"),
    log:
        log_path("evaluate_tasks", "round-{round}", "{model}"),
    wildcard_constraints:
        model="|".join(re.escape(m) for m in DOWNSTREAM_MODELS),
    params:
        label=lambda wc: wc.model,
        round=lambda wc: wc.round,
        base=base_arg,
