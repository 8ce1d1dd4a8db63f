# download: the only stage with network access; it runs on the login node (localrule).


rule download_data:
    output:
        directory(run_path("data", "{site}", "raw")),
    log:
        log_path("download_data", "{site}"),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        spec=lambda wc: to_json(config["sites"][wc.site]["dataset"]),
        # A classifier's labels are checked here, before any expensive stage reads them.
        labels=(
            f"--num-labels {config['model']['num_labels']}" if CLASSIFICATION else ""
        ),
    shell:
        "python -m fedtune.download data --spec {params.spec:q} {params.labels}"
        " --out {output:q} > {log:q} 2>&1"


rule download_model:
    input:
        # A model built from scratch gets a tokenizer trained on every site's training text.
        corpora=lambda wc: (
            [raw_data_dir(site) for site in SITES]
            if config["model"]["source"] == "init"
            else []
        ),
    output:
        directory(base_model_dir()),
    log:
        log_path("download_model", "base"),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        # Functions, not strings: the templates' {text} must not be read as a wildcard.
        spec=lambda wc: to_json(config["model"]),
        corpora=lambda wc: to_json(tokenizer_corpora()),
        task=TASK,
    shell:
        "python -m fedtune.download model --spec {params.spec:q} --corpora {params.corpora:q}"
        " --task {params.task} --out {output:q} > {log:q} 2>&1"
