# Paths and input functions of the aggregate rules (aggregate.smk includes this file).


def server_state_dir(round):
    """The server optimizer's state after round `round` (read by the next round's aggregate)."""
    return run_path(f"round-{round}", "aggregate", "server_state")


def server_state_in(wildcards):
    round = int(wildcards.round)
    return [server_state_dir(round - 1)] if round > 1 else []


def compare_model_dir(round, method):
    """Round `round`'s site models merged by `method` (aggregate.compare), beside the aggregate."""
    return run_path(f"round-{round}", "compare", method, "model")


def compare_outputs():
    """Every compared model of every round; empty unless aggregate.compare names methods."""
    if not aggregates_here():
        return []
    return [
        compare_model_dir(r, m) for r in ROUNDS for m in config["aggregate"]["compare"]
    ]


def site_model_args(wildcards):
    return [f"{site}={site_model_dir(wildcards.round, site)}" for site in SITES]
