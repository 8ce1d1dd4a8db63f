# aggregate: merge the site models of a round into one (FedAvg), streaming tensor by tensor.

# --weights: tokens, uniform, or the mapping site -> number as JSON.
AGGREGATE_WEIGHTS = (
    to_json(config["aggregate"]["weights"])
    if isinstance(config["aggregate"]["weights"], dict)
    else config["aggregate"]["weights"]
)


# On the other clusters of a multi-cluster federation, fetch_aggregate (transfer.smk) brings it in.
if aggregates_here():

    rule aggregate:
        input:
            models=lambda wc: [site_model_dir(wc.round, site) for site in SITES],
            manifests=[manifest_path(site) for site in SITES],
        output:
            directory(aggregate_model_dir("{round}")),
        log:
            log_path("aggregate", "round-{round}"),
        conda:
            CONDA_ENV
        container:
            CONTAINER
        resources:
            # Private memory: about four copies of the largest tensor in fp32 (2 GB for Llama-2-7B).
            mem_mb=4000,
            runtime=60,
        params:
            models=lambda wc: [
                f"{site}={site_model_dir(wc.round, site)}" for site in SITES
            ],
            manifests=[f"{site}={manifest_path(site)}" for site in SITES],
            method=config["aggregate"]["method"],
            weights=AGGREGATE_WEIGHTS,
            dtype=config["model"]["dtype"],
            max_shard_size=config["aggregate"]["max_shard_size"],
        shell:
            "python -m fedtune.aggregate --out {output:q} --method {params.method}"
            " --weights {params.weights:q} --dtype {params.dtype} --max-shard-size {params.max_shard_size}"
            " --model {params.models:q} --manifest {params.manifests:q} > {log:q} 2>&1"
