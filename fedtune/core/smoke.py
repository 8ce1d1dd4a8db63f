"""The smoke test (config key `smoke`, which the cluster profiles set under FEDTUNE_SMOKE=1): what a
validated config becomes for it."""

from __future__ import annotations

# What each site's training becomes, and how many documents each split keeps.
SMOKE_TRAIN = {"nodes": 2, "runtime": 10, "max_steps": 10}
SMOKE_DOCUMENTS = 10000


def apply_smoke(config: dict) -> None:
    """A validated config with `smoke: true` made into its smoke test, in place: its own run folder
    (<run>-smoke, so that nothing of it counts for the real run), one round, every site trained on
    smoke_nodes (2 unless a profile says) nodes for 10 steps with a 10-minute limit, at most
    SMOKE_DOCUMENTS documents per split in one tokenize shard, and no pooled baseline or sweep."""
    config["run"] = f"{config['run']}-smoke"
    config["federation"].update(rounds=1, pooled_baseline=False)
    config["sweep"] = None
    config["tokenize"]["shards"] = 1
    smoke_train = {**SMOKE_TRAIN, "nodes": config.get("smoke_nodes", SMOKE_TRAIN["nodes"])}
    config["train"].update(smoke_train)
    for site in config["sites"].values():
        site["train"].update(smoke_train)
        dataset = site["dataset"]
        dataset["max_documents"] = min(dataset.get("max_documents") or SMOKE_DOCUMENTS, SMOKE_DOCUMENTS)
