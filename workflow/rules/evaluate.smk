# evaluate: perplexity of the base model, every site model and every aggregate on each site's test text.
import re

EVAL_MODELS = [*SITES, "aggregate"]

# Every evaluation result, base model first (the report's inputs).
EVAL_RESULTS = [run_path("eval", "base", f"{site}.json") for site in SITES] + [
    run_path(f"round-{r}", "eval", model, f"{site}.json")
    for r in ROUNDS
    for model in EVAL_MODELS
    for site in SITES
]

# The text is built as the tokenize stage builds it: same template, same BOS choice.
EVAL_BOS = "--add-bos" if config["tokenize"]["add_bos"] else "--no-add-bos"


EVAL_SHELL = (
    "python -m fedtune.evaluate --model {input.model:q} --data {input.data:q} --split test"
    " --text-field {params.text_field:q} --template {params.template:q} {params.bos}"
    " --options {params.options:q} {params.task}"
    " --site {wildcards.site} --label {params.label} --round {params.round}"
    " {params.tracking} --out {output:q} > {log:q} 2>&1"
)


rule evaluate_base:
    input:
        model=base_model_dir(),
        data=raw_data_dir("{site}"),
    output:
        run_path("eval", "base", "{site}.json"),
    log:
        log_path("evaluate", "base", "{site}"),
    conda:
        CONDA_ENV
    container:
        CONTAINER
    threads: 2
    resources:
        mem_mb=16000,
        runtime=60,
    params:
        template=lambda wc: config["sites"][wc.site]["prompt_template"],
        text_field=lambda wc: config["sites"][wc.site]["dataset"]["text_field"],
        bos=EVAL_BOS,
        options=to_json(config["evaluate"]),
        label="base",
        round=0,
        task=lambda wc: eval_task_args(wc.site),
        tracking=lambda wc: tracking_args(),
    shell:
        EVAL_SHELL


rule evaluate_round:
    input:
        # A site's model of that round, or the round's aggregate.
        model=lambda wc: (
            aggregate_model_dir(wc.round)
            if wc.model == "aggregate"
            else site_model_dir(wc.round, wc.model)
        ),
        data=raw_data_dir("{site}"),
    output:
        run_path("round-{round}", "eval", "{model}", "{site}.json"),
    log:
        log_path("evaluate", "round-{round}", "{model}", "{site}"),
    wildcard_constraints:
        model="|".join(re.escape(m) for m in EVAL_MODELS),
    conda:
        CONDA_ENV
    container:
        CONTAINER
    threads: 2
    resources:
        mem_mb=16000,
        runtime=60,
    params:
        template=lambda wc: config["sites"][wc.site]["prompt_template"],
        text_field=lambda wc: config["sites"][wc.site]["dataset"]["text_field"],
        bos=EVAL_BOS,
        options=to_json(config["evaluate"]),
        label=lambda wc: wc.model,
        round=lambda wc: wc.round,
        task=lambda wc: eval_task_args(wc.site),
        tracking=lambda wc: tracking_args(),
    shell:
        EVAL_SHELL
