"""config/examples/smollm2-it-cs.yaml, the published experiment in miniature: the real SmolLM2-135M (from
its GGUF file) fine-tuned on real Italian and Czech text, FedAvg, the pooled baseline. Cut down to a few
steps and short test splits, it runs end to end here, and fine-tuning must help: each site's model beats
the base on its own text, and the aggregate beats the base on both. Its dry run on Leonardo plans the
same stages as Slurm jobs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from .workflow_harness import ROOT, dry_run, snakemake, write_config

EXAMPLE = ROOT / "config" / "examples" / "smollm2-it-cs.yaml"
ROUNDS, STEPS = 2, 2


def example_config(gguf: Path) -> dict:
    """The example with its files made absolute, so that it runs from any working directory."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["model"]["path"] = str(gguf)
    for site in config["sites"].values():
        files = site["dataset"]["data_files"]
        for split, path in files.items():
            files[split] = str(ROOT / path)
    return config


def test_the_example_names_the_fetched_model_and_the_shipped_text():
    config = yaml.safe_load(EXAMPLE.read_text())
    assert config["model"] == {
        "source": "gguf",
        "path": ".cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "dtype": "float32",
    }
    fetch = (ROOT / "scripts" / "fetch-smollm2").read_text()
    assert (
        "file=SmolLM2-135M-Instruct.Q4_1.gguf" in fetch and "{FEDTUNE_MODELS:-.cache/models}/smollm2" in fetch
    )
    for site in config["sites"].values():
        for path in site["dataset"]["data_files"].values():
            assert (ROOT / path).is_file(), path
    assert config["federation"]["pooled_baseline"] and config["federation"]["rounds"] >= 3
    assert config["train"]["lr"] == 0.0001 and config.get("aggregate", {}).get("method", "fedavg") == "fedavg"


@pytest.fixture(scope="module")
def smollm2_run(smollm2_gguf, tmp_path_factory):
    """The example cut down: 2 rounds of 2 steps of one 128-token block (a step of the 135M model is about
    4 s of one core here), 20 documents per site, one test page per site (about 700 tokens: evaluating
    runs at about 230 tokens/s here), only the last round evaluated. Each job checkpoints its last step
    only (the pooled model's 8 steps, every 2nd would write 1.6 GB each time)."""
    workdir = tmp_path_factory.mktemp("smollm2")
    config = example_config(smollm2_gguf)
    config["federation"]["rounds"] = ROUNDS
    config["train"].update(max_steps=STEPS, warmup_steps=1, checkpoint_every=0, micro_batch=1, global_batch=1)
    config["evaluate"].update(max_documents=1, intermediate="none")
    for site in config["sites"].values():
        site["dataset"]["max_documents"] = 20
    write_config(workdir, config)
    started = time.monotonic()
    snakemake(workdir, timeout=1200)
    print(f"\nsmollm2-it-cs, cut down: the workflow ran in {time.monotonic() - started:.0f} s")
    return workdir / "results" / config["run"]


@pytest.mark.slow
def test_fine_tuning_the_real_model_beats_the_base_at_every_site_and_after_merging(smollm2_run):
    run = smollm2_run
    table = pd.read_csv(run / "report" / "perplexity.csv")
    print(table.to_string())
    last = table[(table["round"] == ROUNDS) | (table["model"].isin(["base", "pooled"]))].set_index("model")
    for site in ("it", "cs"):
        assert last.loc[site, site] < last.loc["base", site], (site, last)
        assert last.loc["aggregate", site] < last.loc["base", site], (site, last)
        assert last.loc["pooled", site] < last.loc["base", site], (site, last)
        # A pretrained model: the base is far from random (vocabulary 49,152), unlike a model from scratch.
        assert last.loc["base", site] < 1000, last
    record = json.loads((run / "model" / "base" / "fedtune-source.json").read_text())
    assert record["source"] == "gguf" and record["gguf"]["architecture"] == "llama"
    for site in ("it", "cs"):
        training = json.loads((run / f"round-{ROUNDS}" / site / "model" / "training.json").read_text())
        assert training["steps"] == STEPS and training["first_step"] == (ROUNDS - 1) * STEPS
    assert (run / "report" / "gap.csv").stat().st_size > 0


def test_the_example_plans_its_jobs_on_leonardo(smollm2_gguf, tmp_path, monkeypatch):
    """The example on Leonardo's Booster, one GPU per site (the pooled baseline needs both sites' data on
    one cluster): the dry run with Leonardo's profile converts the GGUF file in a download job on
    lrd_all_serial and trains every site and the pooled model on boost_usr_prod."""
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "proj123")
    config = example_config(smollm2_gguf)
    for site in config["sites"].values():
        site["cluster"] = "leonardo"
    config["train"].update(gpus_per_node=1, cpus_per_process=8, mem_mb=60000, precision="bf16")
    write_config(tmp_path, config)
    jobs = dry_run(tmp_path, profile="leonardo")
    rules = {job.name for job in jobs}
    assert {"download_model", "tokenize", "train", "train_pooled", "aggregate", "report"} <= rules, rules
    (download,) = [job for job in jobs if job.name == "download_model"]
    assert download.resources["slurm_partition"] == "lrd_all_serial", download.resources
    assert '"source":"gguf"' in download.shell and str(smollm2_gguf) in download.shell, download.shell
    trains = [job for job in jobs if job.name == "train"]
    assert len(trains) == 2 * config["federation"]["rounds"]
    assert all(job.resources["slurm_partition"] == "boost_usr_prod" for job in trains), trains[0].resources


def test_the_lora_example_adapts_attention_and_mlp_and_says_what_it_moves(smollm2_gguf, tmp_path):
    """config/examples/smollm2-it-cs-lora.yaml: the same run with LoRA on every attention and MLP
    projection, embeddings frozen; its dry run states an adapter's bytes from the GGUF file's shapes."""
    from fedtune.aggregate.adapter_size import transfer_bytes
    from fedtune.core.models import gguf_model_config

    lora = yaml.safe_load((ROOT / "config" / "examples" / "smollm2-it-cs-lora.yaml").read_text())
    full = yaml.safe_load(EXAMPLE.read_text())
    assert {k: v for k, v in lora.items() if k not in ("run", "train", "aggregate")} == {
        k: v for k, v in full.items() if k not in ("run", "train")
    }
    assert {k: v for k, v in lora["train"].items() if k not in ("adapter", "lr")} == {
        k: v for k, v in full["train"].items() if k != "lr"
    }
    adapter = lora["train"]["adapter"]
    assert adapter["target_modules"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert adapter["modules_to_save"] is None  # the tied embeddings stay frozen
    config = example_config(smollm2_gguf)
    config.update(run=lora["run"], train=lora["train"], aggregate=lora["aggregate"])
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "-n")
    sizes = transfer_bytes(
        gguf_model_config(smollm2_gguf), {"r": 8, "target_modules": adapter["target_modules"]}
    )
    # 30 layers x r 8 x (q 576+576, k and v 576+192, o 576+576, gate and up 576+1536, down 1536+576)
    assert sizes["adapter_bytes"] == 4 * 30 * 8 * (2 * 1152 + 2 * 768 + 3 * 2112)
    assert "adapters: site it: adapter 9.8 MB" in result.stderr, result.stderr[-2000:]
    assert f"(shapes from {smollm2_gguf})" in result.stderr
