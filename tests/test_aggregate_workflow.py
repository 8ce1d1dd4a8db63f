"""The aggregate rules' wiring (dry run): the round's start model, the server state handed from round
to round, and the compared methods' models."""

from __future__ import annotations

import json
import shlex

from tests.workflow_harness import demo_config, snakemake, write_config


def shell_commands(output: str, module: str) -> list[list[str]]:
    """The printed shell commands (dry run with -p) that run `python -m module`, split into words."""
    commands = []
    for line in output.splitlines():
        line = line.strip().removeprefix("Shell command:").strip()
        if line.startswith(f"python -m {module} "):
            commands.append(shlex.split(line.split(" > ")[0]))
    return commands


def option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def test_rounds_pass_start_and_server_state_and_compare_models_are_targets(tmp_path):
    config = demo_config()
    config["federation"]["rounds"] = 2
    config["aggregate"] = {
        "method": "fedavg",
        "server_optimizer": {"name": "fedadam", "lr": 0.1},
        "compare": ["ties", "dare_linear"],
        "density": 0.5,
    }
    write_config(tmp_path, config)
    run = "results/demo"
    compared = [f"{run}/round-{r}/compare/{m}/model" for r in (1, 2) for m in ("ties", "dare_linear")]
    result = snakemake(tmp_path, "-n", "-p", f"{run}/round-2/aggregate/model", *compared)
    commands = shell_commands(result.stdout, "fedtune.aggregate")
    merged = {option(c, "--out"): c for c in commands}
    assert set(merged) == {f"{run}/round-1/aggregate/model", f"{run}/round-2/aggregate/model", *compared}
    first, second = merged[f"{run}/round-1/aggregate/model"], merged[f"{run}/round-2/aggregate/model"]
    assert option(first, "--start") == f"{run}/model/base"
    assert option(second, "--start") == f"{run}/round-1/aggregate/model"
    assert "--server-state-in" not in first
    assert option(second, "--server-state-in") == f"{run}/round-1/aggregate/server_state"
    assert option(second, "--server-state-out") == f"{run}/round-2/aggregate/server_state"
    options = json.loads(option(second, "--options"))
    assert options["server_optimizer"] == {
        "name": "fedadam",
        "lr": 0.1,
        "momentum": 0.5,
        "betas": [0.9, 0.99],
        "tau": 0.001,
    }
    # The compared methods are not the merge's business: adding one does not rerun the aggregation.
    assert options["compare"] == [] and options["dtype"] == config["model"].get("dtype", "float32")
    ties = merged[f"{run}/round-2/compare/ties/model"]
    compared = json.loads(option(ties, "--options"))
    assert compared["method"] == "ties" and compared["density"] == 0.5
    assert option(ties, "--start") == f"{run}/round-1/aggregate/model"
    assert compared["server_optimizer"]["name"] == "sgd" and compared["server_optimizer"]["lr"] == 1.0
    assert "--server-state-out" not in ties
