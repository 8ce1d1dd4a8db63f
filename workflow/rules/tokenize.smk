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
        shards=RUN.tokenize["shards"],
        block_size=RUN.tokenize["block_size"],
        mode=RUN.tokenize["mode"],
        bos="--add-bos" if RUN.tokenize["add_bos"] else "--no-add-bos",
        template=lambda wc: RUN.sites[wc.site].prompt_template,
        text_field=lambda wc: RUN.sites[wc.site].dataset["text_field"],
        label_field=lambda wc: RUN.sites[wc.site].dataset["label_field"],
        task=TASK,
    shell:
        "python -m fedtune.tokenize shard --raw {input.raw:q} --split {wildcards.split}"
        " --shard {wildcards.shard} --num-shards {params.shards} --tokenizer {input.tokenizer:q}"
        " --template {params.template:q} --text-field {params.text_field:q} --site {wildcards.site}"
        " --block-size {params.block_size} --mode {params.mode} {params.bos}"
        " --task {params.task} --label-field {params.label_field:q}"
        " --num-proc {threads} --out {output:q} > {log:q} 2>&1"


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
