# download: the only stage with network access. It runs on the login node (a local rule), unless the
# cluster's profile gives the rule a partition (set-resources: download_data: slurm_partition: ...):
# then it is a Slurm job there. Leonardo's login nodes stop a process after 10 minutes of CPU time, and
# its serial partition lrd_all_serial reaches the internet (profiles/leonardo).


# The download rules given a partition by the profile.
DOWNLOAD_JOBS = {
    name
    for name, resources in workflow.resource_settings.overwrite_resources.items()
    if name.startswith("download_") and "slurm_partition" in resources
}


rule download_data:
    output:
        directory(run_path("data", "{site}", "raw")),
    log:
        log_path("download_data", "{site}"),
    localrule: "download_data" not in DOWNLOAD_JOBS
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        options=lambda wc: RUN.sites[wc.site].dataset.download_json(),
        # One param for both flags: a one-cluster run's shell and params stay as they were (no rerun).
        labels=lambda wc: commands.download_flags(RUN, LAYOUT, wc.site),
    shell:
        "python -m fedtune.download data --options {params.options:q} {params.labels}"
        " --out {output:q} > {log:q} 2>&1"


rule download_model:
    input:
        # A model built from scratch gets a tokenizer trained on every site's training text.
        corpora=lambda wc: (
            [raw_data_dir(site) for site in SITES]
            if RUN.model.source == "init"
            else []
        ),
        # A GGUF file is converted here: a newer file makes a new base model.
        gguf=lambda wc: ([RUN.model.path] if RUN.model.source == "gguf" else []),
    output:
        directory(base_model_dir()),
    log:
        log_path("download_model", "base"),
    localrule: "download_model" not in DOWNLOAD_JOBS
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        # Functions, not strings: the templates' {text} must not be read as a wildcard.
        options=lambda wc: RUN.model.to_json(),
        corpora=lambda wc: to_json(commands.tokenizer_corpora(RUN, LAYOUT)),
        task=TASK,
    shell:
        "python -m fedtune.download model --options {params.options:q} --corpora {params.corpora:q}"
        " --task {params.task} --out {output:q} > {log:q} 2>&1"


rule download_tasks:
    output:
        # Task YAML copies, their data files, the hub data sets (datasets' cache) and tasks.json.
        directory(tasks_dir()),
    log:
        log_path("download_tasks", "tasks"),
    localrule: "download_tasks" not in DOWNLOAD_JOBS
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        tasks=[task.entry for task in DOWNSTREAM],
        # sha256 of the task YAMLs and their data files: an edit reruns the download and the scores.
        sources=lambda wc: commands.downstream_sources(RUN),
    shell:
        "python -m fedtune.download tasks --tasks {params.tasks:q} --out {output:q} > {log:q} 2>&1"
