# transfer: models and manifests made on other clusters come in with rsync (federation.remotes).
# These rules only match what this cluster does not make itself, so no output has two producers.


rule fetch_site_model:
    output:
        directory(site_model_dir("{round}", "{site}")),
    log:
        log_path("fetch_site_model", "{round}-{site}"),
    wildcard_constraints:
        site=one_of(REMOTE_SITES),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        source=lambda wc, output: remote_source(
            site_cluster(wc.site), f"round-{wc.round}/{wc.site}/model", output[0]
        ),
        hint=lambda wc, output: fetch_hint(site_cluster(wc.site), output[0]),
    shell:
        "python -m fedtune.core.transfer --source {params.source:q} --out {output:q}"
        " --hint {params.hint:q} > {log:q} 2>&1"


rule fetch_manifest:
    output:
        manifest_path("{site}"),
    log:
        log_path("fetch_manifest", "{site}"),
    wildcard_constraints:
        site=one_of(REMOTE_SITES),
    localrule: True
    conda:
        CONDA_ENV
    container:
        CONTAINER
    params:
        source=lambda wc, output: remote_source(
            site_cluster(wc.site), f"data/{wc.site}/manifest.json", output[0]
        ),
        hint=lambda wc, output: fetch_hint(site_cluster(wc.site), output[0]),
    shell:
        "python -m fedtune.core.transfer --source {params.source:q} --out {output:q}"
        " --hint {params.hint:q} > {log:q} 2>&1"


if not aggregates_here():

    # With adapters only the aggregate adapter travels; rule merge_adapter makes the model here.
    rule fetch_aggregate:
        output:
            directory(
                aggregate_adapter_dir("{round}")
                if ADAPTERS
                else aggregate_model_dir("{round}")
            ),
        log:
            log_path("fetch_aggregate", "{round}"),
        localrule: True
        conda:
            CONDA_ENV
        container:
            CONTAINER
        params:
            source=lambda wc, output: remote_source(
                AGGREGATE_ON,
                f"round-{wc.round}/aggregate/{'adapter' if ADAPTERS else 'model'}",
                output[0],
            ),
            hint=lambda wc, output: fetch_hint(AGGREGATE_ON, output[0]),
        shell:
            "python -m fedtune.core.transfer --source {params.source:q} --out {output:q}"
            " --hint {params.hint:q} > {log:q} 2>&1"
