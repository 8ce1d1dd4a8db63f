# tokenize: one CPU job per (site, split, shard), then a manifest per site.


rule tokenize:
    input:
        raw=raw_data_dir("{site}"),
        tokenizer=base_model_dir(),
    output:
        directory(run_path("data", "{site}", "{split}", "shard-{shard}")),
    log:
        log_path("tokenize", "{site}", "{split}-{shard}"),
    conda:
        CONDA_ENV
    container:
        CONTAINER
    threads: 2
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        # A function: the template's {text} must not be read as a wildcard.
        options=lambda wc: RUN.sites[wc.site].tokenize.to_json(),
    shell:
        "python -m fedtune.tokenize shard --raw {input.raw:q} --split {wildcards.split}"
        " --shard {wildcards.shard} --tokenizer {input.tokenizer:q} --site {wildcards.site}"
        " --options {params.options:q} --num-proc {threads} --out {output:q} > {log:q} 2>&1"


rule tokenize_manifest:
    input:
        lambda wc: shard_dirs(wc.site, "train") + shard_dirs(wc.site, "test"),
    output:
        manifest_path("{site}"),
    log:
        log_path("tokenize_manifest", "{site}"),
    wildcard_constraints:
        site=one_of(LOCAL_SITES),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    shell:
        "python -m fedtune.tokenize manifest --out {output:q} {input:q} > {log:q} 2>&1"
