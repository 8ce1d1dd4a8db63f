"""federation.exchange: a site's update compressed (fedtune.core.exchange, fedtune.core.updates), with error
feedback, and rebuilt inside the streamed merge (fedtune.aggregate.merge): the codec's error and size per
mode, error feedback at work over rounds, the merge of updates equal to the merge of the models they
rebuild, and a corrupted or mismatched update refused with its site and folder named."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedtune.aggregate.merge import AggregateJob, aggregate
from fedtune.aggregate.merge import main as merge_main
from fedtune.aggregate.options import AggregateOptions
from fedtune.core import exchange
from fedtune.core.exchange_options import ExchangeOptions
from fedtune.core.models import ModelError, record_checksums
from fedtune.core.options import ConfigError
from fedtune.core.updates import CompressJob, compress, decode_folder

from .test_aggregate import random_tensors, read_output, write_checkpoint
from .test_config import ROOT, demo

UNIFORM = AggregateOptions.from_mapping({"weights": "uniform"})
MODES = [("bf16", "block"), ("fp16", "block"), ("int8", "row"), ("int8", "block"), ("int4", "block")]


def start_and_site(tmp_path: Path, seed: int = 0, step: float = 1e-2) -> tuple[Path, Path]:
    """A start model (with its checksum record, as every writer leaves one) and a site trained from it:
    an update in one direction the site keeps from round to round (seed 100), plus noise of its own."""
    direction = torch.Generator().manual_seed(100)
    noise = torch.Generator().manual_seed(200 + seed)
    tensors = random_tensors(seed)
    tensors["model.position_ids"] = torch.arange(7)  # a buffer: must travel unchanged
    trained = {
        name: (
            t.float()
            + step * (torch.randn(t.shape, generator=direction) + 0.3 * torch.randn(t.shape, generator=noise))
        ).to(t.dtype)
        if t.is_floating_point()
        else t
        for name, t in tensors.items()
    }
    start = write_checkpoint(tmp_path / f"start-{seed}", tensors)
    record_checksums(start)
    site = write_checkpoint(tmp_path / f"site-{seed}", trained)
    (site / "training.json").write_text(json.dumps({"site": "a"}))
    return start, site


@pytest.mark.parametrize("dtype,scale", MODES)
def test_each_mode_rebuilds_the_update_within_its_precision(dtype, scale):
    options = ExchangeOptions(dtype=dtype, scale=scale)
    g = torch.Generator().manual_seed(0)
    # Of the largest value: the float's rounding (half a unit in the last place), or half a step of the
    # scale (the group's largest value / the integer range; the bf16 scale rounded up, 2**-8 at most).
    bound = {"bf16": 2**-8, "fp16": 2**-11, "int8": 0.51 / 127, "int4": 0.51 / 7}[dtype]
    for shape in [(33, 64), (37,), (5, 3, 7)]:
        update = torch.randn(math.prod(shape), generator=g) * 1e-3
        encoding = exchange.encoding_for(options, torch.float32)
        parts = exchange.encode(update, encoding, shape)
        sizes = exchange.part_shapes(encoding, shape, torch.float32)
        assert {s: (p.dtype, p.numel()) for s, p in parts.items()} == sizes
        assert all(p.numel() * p.dtype.itemsize % 8 == 0 for p in parts.values())  # parts stay aligned
        decoded = exchange.decode(parts, encoding, shape)
        assert (decoded - update).abs().max() <= bound * update.abs().max(), (dtype, shape)
        # The merge's chunked rebuild: the whole-tensor decode plus the start, bit for bit, in the start's dtype.
        for start_dtype in (torch.bfloat16, torch.float32):
            start = torch.randn(math.prod(shape), generator=g).to(start_dtype)
            expected = decoded.clone().add_(start.float()).to(start_dtype)
            rebuilder = exchange.Rebuilder()
            rebuilder.CHUNK = 128  # several chunks, and a last one of part of a group
            assert torch.equal(rebuilder.rebuild(start, parts, encoding, shape), expected)


def test_bytes_per_value_against_bf16():
    """The issue's goals on a 7B-shaped matrix: int8 at most 0.52x of bf16, int4 at most 0.28x."""
    shape = (4096, 4096)
    bf16 = math.prod(shape) * 2

    def ratio(**options) -> float:
        encoding = exchange.encoding_for(ExchangeOptions(**options), torch.bfloat16)
        sizes = exchange.part_shapes(encoding, shape, torch.bfloat16).values()
        return sum(dtype.itemsize * numel for dtype, numel in sizes) / bf16

    assert ratio(dtype="bf16") == 1.0
    assert ratio(dtype="int8", scale="row") < 0.501
    assert ratio(dtype="int8") <= 0.52
    assert ratio(dtype="int4") <= 0.28


def test_error_feedback_makes_the_sum_of_sent_updates_converge_to_the_true_sum(tmp_path):
    """Ten rounds of int4 (coarse on purpose), each from a new start model, the site's updates alike from
    round to round as a site's are: with error feedback the residual is exactly what was not sent yet and
    stays about one round's error, so the sum of what the site sent tracks the sum of its true updates ever
    closer (relative to the sum, like 1/rounds); without it the rounding errors of every round add up."""
    rounds = 10
    results = {}
    for feedback in (True, False):
        options = ExchangeOptions(dtype="int4", error_feedback=feedback)
        sent_sum: dict[str, torch.Tensor] = {}
        true_sum: dict[str, torch.Tensor] = {}
        residual = None
        relative = []
        for r in range(rounds):
            work = tmp_path / f"{feedback}-{r}"
            work.mkdir()
            start, site = start_and_site(work, seed=r, step=1e-2)
            out = work / "update"
            residual_out = work / "residual" if feedback else None
            compress(CompressJob(site, start, out, residual_in=residual, residual_out=residual_out), options)
            residual = residual_out
            decode_folder(out, start, work / "rebuilt")
            starts, sites, rebuilt = (
                load_file(start / "model.safetensors"),
                read_output(site),
                read_output(work / "rebuilt"),
            )
            for name, value in sites.items():
                if not value.is_floating_point():
                    assert torch.equal(rebuilt[name], value)
                    continue
                true_sum[name] = true_sum.get(name, 0) + value.float() - starts[name].float()
                sent_sum[name] = sent_sum.get(name, 0) + rebuilt[name].float() - starts[name].float()
            gap = sum(float((sent_sum[n] - true_sum[n]).square().sum()) for n in true_sum) ** 0.5
            size = sum(float(true_sum[n].square().sum()) for n in true_sum) ** 0.5
            relative.append(gap / size)
            if feedback:
                # What is still to be sent is exactly the residual the site keeps.
                kept = load_file(residual / "model.safetensors")
                for name in kept:
                    torch.testing.assert_close(kept[name], true_sum[name] - sent_sum[name], rtol=0, atol=1e-6)
        results[feedback] = relative
    with_feedback, without = results[True], results[False]
    # Measured: with 0.089 -> 0.013 over ten rounds (like 1/rounds), without 0.089 -> 0.032 (the rounding
    # errors of independent rounds add up like sqrt(rounds), the sum like rounds).
    assert with_feedback[-1] < with_feedback[0] / 5
    assert with_feedback[-1] < without[-1] / 2
    assert without[-1] > without[0] / 5


def test_the_merge_of_updates_equals_the_merge_of_the_models_they_rebuild(tmp_path):
    """Decompressed tensor by tensor inside the stream: the same bits as merging the rebuilt site models
    (fedavg, and fedadam with its server state); aggregate.json lists the update's bytes."""
    start, site_a = start_and_site(tmp_path, 0)
    site_b = tmp_path / "site-b"
    shutil.copytree(site_a, site_b)
    tensors = read_output(site_a)
    tensors = {n: (t.float() * 1.01).to(t.dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    shutil.rmtree(site_b)
    write_checkpoint(site_b, tensors)
    options = ExchangeOptions(dtype="int8")
    for name, site in (("a", site_a), ("b", site_b)):
        compress(CompressJob(site, start, tmp_path / f"update-{name}"), options)
        decode_folder(tmp_path / f"update-{name}", start, tmp_path / f"rebuilt-{name}")
    updates = {s: tmp_path / f"update-{s}" for s in "ab"}
    rebuilt = {s: tmp_path / f"rebuilt-{s}" for s in "ab"}
    fedadam = AggregateOptions.from_mapping({"weights": "uniform", "server_optimizer": {"name": "fedadam"}})
    for options_, state in ((UNIFORM, False), (fedadam, True)):
        outs = []
        for tag, models in (("u", updates), ("r", rebuilt)):
            out = tmp_path / f"merged-{tag}-{state}"
            kwargs = {"server_state_out": tmp_path / f"state-{tag}"} if state else {}
            record = aggregate(AggregateJob(models, out, start=start, **kwargs), options_)
            outs.append(read_output(out))
            if tag == "u":
                assert record["inputs"][0]["bytes"] == (updates["a"] / "model.safetensors").stat().st_size
        assert outs[0].keys() == outs[1].keys()
        for name in outs[0]:
            assert torch.equal(outs[0][name], outs[1][name]), name


def test_a_corrupted_update_is_refused_naming_its_file(tmp_path):
    start, site = start_and_site(tmp_path)
    update = tmp_path / "round-1" / "beta" / "update"
    compress(CompressJob(site, start, update), ExchangeOptions(dtype="int8"))
    data = bytearray((update / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (update / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"round-1/beta/update/model.safetensors: sha256 differs"):
        aggregate(AggregateJob({"beta": update}, tmp_path / "out", start=start), UNIFORM)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ModelError, match=r"round-1/beta/update/model.safetensors: sha256 differs"):
        decode_folder(update, start, tmp_path / "rebuilt")
    assert not (tmp_path / "rebuilt").exists()


def test_an_update_against_another_start_model_is_refused(tmp_path, capsys, monkeypatch):
    """Taken against round 1's start, merged against another: refused before a byte is decoded, with
    the site, the update's folder and both start models' identities named; the CLI says it in one line."""
    from fedtune.core.offline import OFFLINE_VARIABLES

    for name in OFFLINE_VARIABLES:
        monkeypatch.setenv(name, "0")
    start, site = start_and_site(tmp_path, 0)
    other, _ = start_and_site(tmp_path, 1)
    update = tmp_path / "round-2" / "beta" / "update"
    compress(CompressJob(site, start, update), ExchangeOptions(dtype="int4"))
    identity = exchange.start_identity(start)["identity"]
    with pytest.raises(
        exchange.ExchangeError,
        match=rf"site beta: the update {update} was taken against start model {identity}",
    ):
        aggregate(AggregateJob({"beta": update}, tmp_path / "out", start=other), UNIFORM)
    argv = ["--out", str(tmp_path / "out"), "--model", f"beta={update}", "--options", UNIFORM.to_json()]
    capsys.readouterr()
    assert merge_main([*argv, "--start", str(other)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "error: site beta: the update" in err[0] and "cannot be rebuilt" in err[0]
    assert merge_main(argv) == 2
    assert "--start is needed: sites beta sent compressed updates" in capsys.readouterr().err
    with pytest.raises(exchange.ExchangeError, match="cannot be rebuilt from this start model"):
        decode_folder(update, other, tmp_path / "rebuilt")
    assert not (tmp_path / "out").exists() and not (tmp_path / "rebuilt").exists()


def test_the_setting_its_default_and_what_crosses():
    from fedtune.run.config import build_run_config
    from fedtune.run.crossings import crossing_items

    config = demo()
    assert build_run_config(config, base_dir=ROOT).exchange == ExchangeOptions()
    assert not ExchangeOptions().compressed
    config["federation"] = {"exchange": {"dtype": "int8", "scale": "row"}}
    run = build_run_config(config, base_dir=ROOT)
    assert run.exchange == ExchangeOptions(dtype="int8", scale="row", error_feedback=True)
    assert config["federation"]["exchange"]["block_size"] == 64  # the schema's default, filled in
    config["cluster"] = "leo"
    for name, site in config["sites"].items():
        site["cluster"] = "leo" if name == "alpha" else "karo"
    config["federation"].update(aggregate_on="leo", remotes={"karo": "/k", "leo": "/l"})
    items = [c.item for c in crossing_items(build_run_config(config, base_dir=ROOT))]
    assert "round-1/beta/update" in items and "round-1/beta/model" not in items
    config["federation"]["exchange"] = {"dtype": "int3"}
    with pytest.raises(ConfigError, match="federation.exchange.dtype"):
        build_run_config(config, base_dir=ROOT)
    config["federation"]["exchange"] = {"dtype": "int8"}
    config["train"] = {**config.get("train", {}), "adapter": {"r": 4}}
    config["aggregate"] = {**config.get("aggregate", {}), "server_optimizer": {"name": "fedavgm"}}
    with pytest.raises(ConfigError, match="sites train adapters"):
        build_run_config(config, base_dir=ROOT)


def test_the_report_counts_the_update_as_what_the_site_sent(tmp_path):
    from fedtune.report.build import folder_bytes, sent_folder

    start, site = start_and_site(tmp_path)
    model = tmp_path / "round-1" / "a" / "model"
    shutil.copytree(site, model)
    assert sent_folder(model) == model
    compress(CompressJob(model, start, model.parent / "update"), ExchangeOptions(dtype="int4"))
    assert sent_folder(model) == model.parent / "update"
    assert folder_bytes(sent_folder(model)) < folder_bytes(model) + 8192


def test_the_aggregate_goes_back_as_an_update_rebuilt_bit_for_bit_on_every_cluster(tmp_path):
    """Round 2's merged model compressed against round 1's aggregate (with the server's residual): a
    site's copy of round 1's aggregate and the aggregating cluster's own rebuild the same bits, which
    are the next round's start there too (decode_aggregate); what compression dropped is the residual,
    exactly; a previous aggregate the update was not taken against is refused, and nothing written."""
    previous, merged = start_and_site(tmp_path, 0)
    copy = tmp_path / "karo" / "round-1" / "aggregate" / "model"
    shutil.copytree(previous, copy)
    options = ExchangeOptions(dtype="int8")
    update, residual = tmp_path / "round-2" / "aggregate" / "update", tmp_path / "round-2" / "residual"
    compress(
        CompressJob(merged, previous, update, residual_out=residual, label="the aggregate of round 2"),
        options,
    )
    decode_folder(update, previous, tmp_path / "leo-next")
    decode_folder(update, copy, tmp_path / "karo-next")
    leo, karo = (
        {p.name: p.read_bytes() for p in (tmp_path / where).glob("*.safetensors")}
        for where in ("leo-next", "karo-next")
    )
    assert leo and leo == karo
    assert json.loads((tmp_path / "karo-next" / "training.json").read_text()) == {"site": "a"}
    rebuilt, wanted, starts = read_output(tmp_path / "leo-next"), read_output(merged), read_output(previous)
    kept = load_file(residual / "model.safetensors")
    changed = False
    for name, value in wanted.items():
        if not value.is_floating_point():
            assert torch.equal(rebuilt[name], value)
            continue
        meant = value.float() - starts[name].float()
        sent = rebuilt[name].float() - starts[name].float()
        torch.testing.assert_close(kept[name], meant - sent, rtol=0, atol=1e-6)
        changed |= not torch.equal(rebuilt[name], value)
    assert changed  # int8 drops something: the merged model itself would not be the sites' start
    other, _ = start_and_site(tmp_path, 1)
    with pytest.raises(exchange.ExchangeError, match="cannot be rebuilt from this start model"):
        decode_folder(update, other, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()


def test_dry_run_with_int8_the_other_cluster_fetches_the_aggregates_update(tmp_path, tiny_model_dir):
    """Two clusters, int8: leo merges into round-<r>/aggregate/merged, compresses it against the round's
    start (with the previous round's residual) and marks the update complete; karo fetches the update,
    never the model, and both rebuild the aggregate from it (decode_aggregate)."""
    import re

    from .test_data_stays import two_clusters
    from .workflow_harness import dry_run, write_config

    plans = {}
    for cluster in ("leo", "karo"):
        workdir = tmp_path / cluster
        workdir.mkdir()
        config = two_clusters(private=(), aggregate_on="leo", rounds=2, exchange={"dtype": "int8"})
        config.update(cluster=cluster, model={"source": "local", "path": str(tiny_model_dir)})
        write_config(workdir, config)
        plans[cluster] = dry_run(workdir)
    leo, karo = plans["leo"], plans["karo"]
    fetched = {re.search(r"--out \S*results/demo/(\S+)", job.shell).group(1) for job in karo
               if job.name == "fetch_aggregate"}  # fmt: skip
    assert fetched == {"round-1/aggregate/update", "round-2/aggregate/update"}
    assert {job.wildcards["round"] for job in karo if job.name == "decode_aggregate"} == {"1", "2"}
    assert not [job for job in karo if job.name in ("aggregate", "compress_aggregate")]
    merges = {job.wildcards["round"]: job.shell for job in leo if job.name == "aggregate"}
    assert "round-2/aggregate/merged" in merges["2"] and "--start" in merges["2"]
    packs = {job.wildcards["round"]: job.shell for job in leo if job.name == "compress_aggregate"}
    assert set(packs) == {"1", "2"}
    assert re.search(r"--model \S*round-2/aggregate/merged --start \S*round-1/aggregate/model", packs["2"])
    assert "--residual-in" in packs["2"] and "round-1/aggregate/residual" in packs["2"]
    assert "--residual-in" not in packs["1"] and "--residual-out" in packs["1"]
    decodes = {job.wildcards["round"]: job.shell for job in leo if job.name == "decode_aggregate"}
    assert re.search(r"--update \S*round-2/aggregate/update --start \S*round-1/aggregate/model", decodes["2"])
    marked = {job.wildcards["item"] for job in leo if job.name == "mark_complete"}
    assert {"round-1/aggregate/update", "round-2/aggregate/update"} <= marked
    assert not {"round-1/aggregate/model", "round-2/aggregate/model"} & marked


def test_compress_memory_grows_with_the_largest_tensor_and_covers_the_7b_measurement():
    """Llama-2-7B's compress took 4,824 MB private on one H200 machine (2026-11-28,
    benchmarks/results/gpu/2026-11-28-published-7b.md): the flat 4,000 MB it had been given would have
    stopped it; a 128k vocabulary holds four times the rows."""
    from fedtune.aggregate.adapter_size import EXCHANGE_MIN_MB, exchange_mem_mb

    llama2 = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32)  # fmt: skip
    assert exchange_mem_mb(llama2) >= 4824 * 1.2
    assert exchange_mem_mb({**llama2, "vocab_size": 128256}) > 3 * exchange_mem_mb(llama2)
    assert exchange_mem_mb(None) == EXCHANGE_MIN_MB
    tiny = dict(model_type="llama", vocab_size=2000, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    assert exchange_mem_mb(tiny) == EXCHANGE_MIN_MB
    rules = (Path(__file__).resolve().parent.parent / "workflow" / "rules" / "exchange.smk").read_text()
    assert rules.count("mem_mb=exchange_mem_mb") == 2  # compress_update and compress_aggregate
