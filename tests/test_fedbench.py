"""benchmarks/federation_yardstick.py runs the product's stages: its merge of a round is the aggregate
stage's, byte for byte what `python -m fedtune.aggregate` writes from the same inputs; its corpora give
every site its own documents (its partial participation is the product's: tests/test_yardstick.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedtune.aggregate.options import AggregateOptions
from tests.test_aggregate import write_manifest
from tests.test_vocab_rows import sites_with_counts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import federation_corpora  # noqa: E402
import federation_yardstick  # noqa: E402

COUNTS = {"a": [5] * 16 + [0] * 16, "b": [0] * 8 + [2] * 24}


def _files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but aggregate.json, which records the folders' paths and the wall time."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "aggregate.json"}


def _cli(tmp_path: Path, models, manifests, options, start, state_in, state_out, out) -> None:
    command = [sys.executable, "-m", "fedtune.aggregate", "--out", str(out), "--options", options.to_json(),
               "--model", *(f"{s}={p}" for s, p in models.items()),
               "--manifest", *(f"{s}={p}" for s, p in manifests.items()),
               "--start", str(start), "--server-state-out", str(state_out)]  # fmt: skip
    if state_in is not None:
        command += ["--server-state-in", str(state_in)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(command, check=True, cwd=tmp_path, env=env, capture_output=True)


@pytest.mark.parametrize(
    "section",
    [
        {},  # the schema's default: plain FedAvg
        # fedavgm with momentum, vocab rows by token counts stepped times the sites (the default until
        # 2026-11-28): the server state is written and read back in round 2
        {"server_optimizer": {"name": "fedavgm"}, "vocab_rows": "counts"},
        {"server_optimizer": {"name": "fedexp"}},
    ],
    ids=["default", "fedavgm-vocab", "fedexp"],
)
def test_benchmark_merge_is_the_aggregate_cli_byte_for_byte(tmp_path, section):
    # Token weights from the manifests; two rounds, so a server state is read too.
    start, models = sites_with_counts(tmp_path, COUNTS)
    manifests = {s: write_manifest(tmp_path / f"{s}.json", s, n) for s, n in (("a", 300), ("b", 100))}
    options = AggregateOptions.from_mapping({"dtype": "float32", **section})
    rows = ["lm_head.weight", "model.embed_tokens.weight"] if options.vocab_rows == "counts" else []
    bench_state = cli_state = None
    for r in (1, 2):
        bench, cli = tmp_path / f"bench-{r}", tmp_path / f"cli-{r}"
        record = federation_yardstick.merge_round(
            models, bench, options, manifests, start, bench_state, tmp_path / f"bench-state-{r}"
        )
        _cli(tmp_path, models, manifests, options, start, cli_state, tmp_path / f"cli-state-{r}", cli)
        assert record["vocab_rows"]["tensors"] == rows
        bench_state, cli_state = tmp_path / f"bench-state-{r}", tmp_path / f"cli-state-{r}"
        assert _files(bench) == _files(cli)
        assert _files(bench_state) == _files(cli_state)
        # Not the start model: the merge did move the weights.
        assert _files(bench)["model.safetensors"] != (start / "model.safetensors").read_bytes()
        cli_record = json.loads((cli / "aggregate.json").read_text())
        assert (
            cli_record["weights"]["normalised"] == record["weights"]["normalised"] == {"a": 0.75, "b": 0.25}
        )


@pytest.mark.skipif(not Path("/usr/share/man/man5").is_dir(), reason="needs Debian's manual pages")
def test_corpora_give_each_site_its_own_documents_by_topic_and_at_random():
    topic = federation_corpora.split_sites("tuning", 4, 6, 40, iid=False)
    iid = federation_corpora.split_sites("tuning", 4, 6, 40, iid=True)
    assert [s.topic for s in topic] == ["commands", "library", "admin", "overviews"]
    for split in (topic, iid):
        assert all(len(s.test) == 40 and len(s.train) == 6 for s in split)
        documents = [d for s in split for d in s.train + s.test]
        assert len(documents) == len(set(documents))  # no document in two sites or two splits
    # The IID control deals the same documents; its sites mix the topics.
    cut = federation_corpora.TEST_CHARS  # test documents are cut shorter than training ones
    assert {d[:cut] for s in topic for d in s.train + s.test} == {
        d[:cut] for s in iid for d in s.train + s.test
    }
    assert all(s.topic == "mixed" for s in iid)
    assert "\\fB" not in "".join(topic[0].train) and not any(
        line.startswith(".TH") for line in topic[0].train
    )


def test_checkpoint_writer_group_follows_a_new_world(tmp_path, monkeypatch):
    # The benchmark calls fedtune.train.loop.train once per site and round in one process; each call
    # starts a world and ends it, so the background writer's group must belong to the current world.
    import torch.distributed as dist

    from fedtune.train import checkpoint

    monkeypatch.setattr(checkpoint, "_async_group", None)
    groups = []
    for _ in range(2):
        store = dist.FileStore(str(tmp_path / f"store-{len(groups)}"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            groups.append(checkpoint._gloo_group())
            assert checkpoint._gloo_group() is groups[-1]  # one per world
            dist.barrier(group=groups[-1])  # usable: a stale group raises here
        finally:
            dist.destroy_process_group()
    assert groups[0] is not groups[1]


def test_benchmark_exchange_is_the_workflows_codec_bit_for_bit(tmp_path, tiny_model_dir):
    """federation_yardstick.py --exchange: two rounds of a site's update and the aggregate's, each the
    bits that `python -m fedtune.core.updates compress` then `decode` (what compress_update,
    decode_site_model, compress_aggregate and decode_aggregate run) give from the same model folders,
    the residual of the round before included."""
    import federation_exchange
    import torch
    from safetensors.torch import load_file

    from fedtune.core import updates
    from fedtune.core.exchange_options import ExchangeOptions
    from fedtune.core.models import load_causal_lm, load_tokenizer, save_model

    model, tokenizer = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    options = ExchangeOptions(dtype="int8", error_feedback=True)
    bench = federation_exchange.Exchange(options, tmp_path / "bench")
    g = torch.Generator().manual_seed(0)

    def moved(folder: Path, out: Path) -> Path:  # a training round's change: small, off int8's grid
        state = load_causal_lm(folder).state_dict()
        model.load_state_dict({k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state.items()})
        save_model(model, tokenizer, out)
        return out

    def product(r, item, model_dir, start):
        """The rules' commands on the same model folder: the rebuilt model's folder."""
        folder = tmp_path / "cli" / f"round-{r}" / item
        residual = ["--residual-out", str(folder / "residual")]
        if r > 1:
            residual += ["--residual-in", str(tmp_path / "cli" / f"round-{r - 1}" / item / "residual")]
        assert updates.main(["compress", "--model", str(model_dir), "--start", str(start),
                             "--options", options.to_json(), *residual, "--out", str(folder / "update")]) == 0  # fmt: skip
        assert updates.main(["decode", "--update", str(folder / "update"), "--start", str(start),
                             "--out", str(folder / "rebuilt")]) == 0  # fmt: skip
        return folder / "rebuilt"

    def same(a: Path, b: Path) -> bool:
        x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    start = bench_start = tiny_model_dir
    for r in (1, 2):
        trained = moved(start, tmp_path / f"trained-{r}")
        site = bench.send(r, "a", trained, bench_start)
        assert same(site, product(r, "a", trained, start))
        # The codec did round: the merge sees what was sent, not what was trained.
        assert not same(site, trained)
        merged = moved(site, tmp_path / f"merged-{r}")
        bench_start = bench.send(r, "aggregate", merged, bench_start)
        start = product(r, "aggregate", merged, start)
        assert same(bench_start, start)
    assert not (tmp_path / "bench" / "round-1").exists()  # the round before, gone once it is not read
    assert [(b["round"], b["item"]) for b in bench.bytes] == [
        (1, "a"),
        (1, "aggregate"),
        (2, "a"),
        (2, "aggregate"),
    ]
    assert bench.sent_fraction() < 1 / 3  # int8 of a float32 model


def test_yardstick_names_compressed_exchange_rows_and_sets_the_config(tmp_path):
    """--exchange reaches the product's config (federation.exchange, validated by its schema) and names
    the strategies' rows <strategy>+<dtype>[+ef]; the pooled model and an uncompressed exchange keep
    their names."""
    from argparse import Namespace

    for site in ("a", "b"):
        (tmp_path / site).mkdir()
        for split in ("train", "test"):
            (tmp_path / site / f"{split}.jsonl").write_text('{"text": "x"}\n')
    args = Namespace(rounds=2, steps=2, participation=1.0, strategies=["fedavg"], regime="scratch",
                     exchange={"dtype": "int8", "error_feedback": True})  # fmt: skip

    def name() -> str:
        run = federation_yardstick.cell_runs(["a", "b"], tmp_path, args, 0)["fedavg"]
        return federation_yardstick.model_name("fedavg", run.exchange)

    run = federation_yardstick.cell_runs(["a", "b"], tmp_path, args, 0)["fedavg"]
    assert run.exchange.dtype == "int8" and run.exchange.keeps_residual
    assert name() == "fedavg+int8+ef"
    args.exchange = {"dtype": "int4", "error_feedback": False}
    assert name() == "fedavg+int4"
    args.exchange = {"dtype": "full"}
    assert name() == "fedavg"
    args.exchange = {"dtype": "int3"}
    with pytest.raises(federation_yardstick.fconfig.ConfigError, match="int3"):
        federation_yardstick.cell_runs(["a", "b"], tmp_path, args, 0)


def test_fine_tuning_cell_is_the_smollm2_example_cut_and_old_csvs_read_as_scratch(tmp_path):
    # The fine-tuning regime's cell goes through the product's config (schema and all): the SmolLM2
    # example's model and settings, the fine-tuning cut, the cell's seed and strategy.
    for site in ("help_de", "help_fr"):
        (tmp_path / site).mkdir()
        for split in ("train", "test"):
            (tmp_path / site / f"{split}.jsonl").write_text('{"text": "x"}\n')
    runs = {
        strategy: federation_yardstick.fconfig.build_run_config(
            federation_yardstick.cell_config(
                ["help_de", "help_fr"], tmp_path, 4, 3, 7, strategy, 1.0, "finetune"
            ),
            base_dir=ROOT,
        )
        for strategy in ("default", "fedavg", "fedavgm-vocab")
    }
    run = runs["default"]
    gguf = ROOT / ".cache" / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert run.model.source == "gguf" and Path(run.model.path) == gguf
    assert run.tokenize.block_size == 64 and run.rounds == 4
    options = run.sites["help_de"].train
    assert (options.max_steps, options.global_batch, options.seed, options.lr) == (3, 4, 7, 1e-4)
    assert run.pooled.max_steps == 4 * 3 * 2  # the product's pooled baseline: every site's every round
    assert run.aggregate.server_optimizer.name == "sgd" and run.aggregate.vocab_rows == "weights"
    assert runs["fedavg"].aggregate == run.aggregate  # the default is plain FedAvg
    old = runs["fedavgm-vocab"].aggregate
    assert (old.server_optimizer.name, old.server_optimizer.momentum) == ("fedavgm", 0.5)
    assert old.vocab_rows == "counts" and old.vocab_step == "sites"
    # The strategies train alike; only the vocab rows by counts need the sites' token counts.
    counting = runs["fedavgm-vocab"].sites["help_de"].train
    assert counting.token_counts and not options.token_counts
    assert dataclasses.replace(options, token_counts=True) == counting
    # A CSV written before the regimes existed is the scratch regime's.
    old = tmp_path / "old.csv"
    old.write_text(
        "half,split,sites,participation,rounds,steps,seed,model,lr_factor,lr,site,topic,perplexity\n"
        "tuning,topic,2,1.0,4,4,0,pooled,1.0,0.003,s00,a,10.0\n"
    )
    frame = federation_yardstick.read_results([old])
    assert frame.loc[0, ["regime", "set", "embedding_factor"]].tolist() == ["scratch", "", 1.0]
    assert frame.loc[0, "device"] == "cpu"  # every run before the GPU one was on CPUs
    assert "device" in federation_yardstick.CELL  # a GPU's cells are tables of their own


def test_benchmark_adapter_round_is_the_workflows_commands_byte_for_byte(tmp_path):
    """The LoRA regime's round (merge_adapter_round) is what aggregate_adapters and merge_adapter write:
    `python -m fedtune.aggregate.adapters` (the adapters, their manifests, the start, a server state),
    then `--merge` of that adapter into the start, from the same site adapters."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.test_adapter_aggregate import ATTENTION, llama_config, save_base, train_adapter

    torch.manual_seed(0)
    base = save_base(LlamaForCausalLM(llama_config()), tmp_path / "base")
    adapters = {
        site: train_adapter(LlamaForCausalLM, base, tmp_path / site, seed, r=4, target_modules=ATTENTION)
        for site, seed in (("a", 1), ("b", 2))
    }
    manifests = {s: write_manifest(tmp_path / f"{s}.json", s, n) for s, n in (("a", 300), ("b", 100))}
    # fedavgm: the server step and its state (as stacked factors) are the aggregate stage's too.
    options = AggregateOptions.from_mapping({"server_optimizer": {"name": "fedavgm"}, "dtype": "float32"})
    bench = tmp_path / "bench" / "aggregate-1"
    bench.parent.mkdir()
    record = federation_yardstick.merge_adapter_round(
        adapters, bench, options, manifests, base, None, tmp_path / "bench-state"
    )
    assert record["weights"]["normalised"] == {"a": 0.75, "b": 0.25}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    adapter, merged = tmp_path / "cli-adapter", tmp_path / "cli-merged"
    run = [sys.executable, "-m", "fedtune.aggregate.adapters"]
    subprocess.run([*run, "--out", str(adapter), "--options", options.merge_json(),
                    "--adapters", *(f"{s}={p}" for s, p in adapters.items()), "--start", str(base),
                    "--server-state-out", str(tmp_path / "cli-state"),
                    "--manifest", *(f"{s}={p}" for s, p in manifests.items())],
                   check=True, cwd=tmp_path, env=env, capture_output=True)  # fmt: skip
    subprocess.run([*run, "--merge", str(adapter), "--base", str(base), "--out", str(merged),
                    "--options", options.merge_json()], check=True, cwd=tmp_path, env=env, capture_output=True)  # fmt: skip
    assert _files(bench) == _files(merged)
    assert _files(tmp_path / "bench-state") == _files(tmp_path / "cli-state")
    # The round moved the model: not the start's bytes.
    assert _files(bench)["model.safetensors"] != (base / "model.safetensors").read_bytes()
