"""What another cluster sends is checked before it is used (issue 47, "Values" and "Identity"): each attack
below drives the real merge, decode, loading, training-data or config path, and each was accepted before
these checks. A site model holding NaN or infinities, tensors that are not the start model's, a token count
that is no count, a compressed update with a short part, a weight index that names another folder's file,
a manifest that points training outside its folder, NaN in the config, a private site's token histogram,
and a site model trained from another start than its round's."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedtune.aggregate.merge import AggregateError, AggregateJob, aggregate
from fedtune.aggregate.options import AggregateOptions
from fedtune.core import exchange
from fedtune.core.exchange_options import ExchangeOptions
from fedtune.core.models import check_loadable, record_checksums
from fedtune.core.options import ConfigError
from fedtune.core.safetensors_stream import WeightsError
from fedtune.core.updates import CompressJob, compress, decode_folder
from fedtune.run.config import build_run_config, load_config
from fedtune.tokenize.blocks import DataError, manifest_shards

from .test_aggregate import options, random_tensors, read_output, write_checkpoint, write_manifest
from .test_config import ROOT, demo
from .test_data_stays import two_clusters
from .test_exchange import UNIFORM, start_and_site

pytest_plugins = ["tests.train_fixtures"]

NAME = "model.layers.0.self_attn.q_proj.weight"


def sites_with(tmp_path: Path, value: float | None, name: str = NAME) -> dict[str, Path]:
    """Sites a and b under round-3/ of a run, trained from one start (round-3/start); site b's tensor
    `name` holds `value` in one entry (None: both sites are sound)."""
    start = write_checkpoint(tmp_path / "round-3" / "start", random_tensors(0))
    record_checksums(start)
    models = {}
    for i, site in enumerate("ab"):
        tensors = random_tensors(i + 1)
        if site == "b" and value is not None:
            tensors[name].view(-1)[5] = value
        models[site] = write_checkpoint(tmp_path / "round-3" / site / "model", tensors)
    return models


START = {"sgd (the sites' mean, start not read)": {}, "fedadam (steps from the start)": {"name": "fedadam"}}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("server", START.values(), ids=START.keys())
def test_a_site_model_holding_nan_or_inf_stops_the_merge_naming_site_tensor_and_round(
    tmp_path, value, server
):
    models = sites_with(tmp_path, value)
    out = tmp_path / "round-3" / "aggregate" / "model"
    kwargs = {"server_state_out": tmp_path / "state"} if server else {}
    with pytest.raises(AggregateError) as error:
        aggregate(
            AggregateJob(models, out, start=tmp_path / "round-3" / "start", **kwargs),
            options(weights="uniform", server_optimizer=server),
        )
    message = str(error.value)
    assert message.startswith(f"round 3: site b: tensor {NAME} holds NaN or infinite values"), message
    assert "aggregate.non_finite: leave_out" in message
    assert not out.exists() and not (tmp_path / "state").exists()


def test_a_non_finite_site_is_left_out_where_the_user_allows_it_and_the_record_says_so(tmp_path):
    models = sites_with(tmp_path, float("nan"))
    out = tmp_path / "round-3" / "aggregate" / "model"
    weights = {"a": 1, "b": 3}
    record = aggregate(AggregateJob(models, out), options(weights=weights, non_finite="leave_out"))
    assert record["left_out"] == [{"site": "b", "tensor": NAME, "reason": "non-finite values"}]
    assert record["weights"]["normalised"] == {"a": 1.0}
    assert [entry["site"] for entry in record["inputs"]] == ["a"]
    on_disk = json.loads((out / "aggregate.json").read_text())
    assert on_disk["left_out"] == record["left_out"]
    merged, site_a = read_output(out), read_output(models["a"])
    assert all(torch.equal(merged[n], site_a[n]) for n in site_a)
    # Every site non-finite: nothing is left to merge, and nothing is written.
    models["a"] = sites_with(tmp_path / "second", float("inf"))["b"]
    with pytest.raises(AggregateError, match="no other site is left"):
        aggregate(AggregateJob(models, tmp_path / "out2"), options(non_finite="leave_out", weights="uniform"))
    assert not (tmp_path / "out2").exists()


def test_a_compressed_update_that_rebuilds_to_nan_is_refused(tmp_path):
    start, site = start_and_site(tmp_path)
    tensors = read_output(site)
    tensors[NAME].view(-1)[3] = float("nan")
    site.joinpath("model.safetensors").unlink()
    save_file(tensors, site / "model.safetensors", metadata={"format": "pt"})
    update = tmp_path / "round-2" / "beta" / "update"
    compress(CompressJob(site, start, update), ExchangeOptions(dtype="bf16"))
    with pytest.raises(AggregateError, match=rf"^round 2: site beta: tensor {NAME} holds NaN"):
        aggregate(
            AggregateJob({"beta": update}, tmp_path / "round-2" / "aggregate" / "model", start=start), UNIFORM
        )


CHANGES = {
    "a tensor the start lacks": lambda t: {**t, "model.extra.weight": torch.zeros(4)},
    "another shape": lambda t: {**t, NAME: torch.zeros(8, 4, dtype=torch.float16)},
    "an integer dtype for a float tensor": lambda t: {
        **t,
        "model.norm.weight": torch.zeros(8, dtype=torch.int64),
    },
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_sites_that_agree_with_each_other_but_not_with_the_start_model_are_refused(tmp_path, change):
    """The plain mean reads no value of the start model: its tensor table is still the sites' yardstick."""
    start = write_checkpoint(tmp_path / "start", random_tensors(0))
    models = {s: write_checkpoint(tmp_path / s, change(random_tensors(i))) for i, s in enumerate("ab")}
    with pytest.raises(AggregateError, match=r"the site models cannot be merged:\n  the start model"):
        aggregate(AggregateJob(models, tmp_path / "out", start=start), options(weights="uniform"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("kept", "recorded", "expected"),
    [
        (-900, 1000, "splits.train.tokens_kept is -900; a site's token count must be positive"),
        (
            10**15,
            1000,
            f"splits.train.tokens_kept is {10**15}, more than the 1000 of its splits.train.tokens",
        ),
    ],
    ids=["negative", "1e15"],
)
def test_a_token_count_that_is_no_count_is_refused(tmp_path, kept, recorded, expected):
    models = {s: write_checkpoint(tmp_path / s, random_tensors(i)) for i, s in enumerate("ab")}
    manifests = {"a": write_manifest(tmp_path / "a.json", "a", 1000)}
    manifests["b"] = tmp_path / "b.json"
    manifests["b"].write_text(
        json.dumps({"site": "b", "splits": {"train": {"tokens_kept": kept, "tokens": recorded}}})
    )
    with pytest.raises(AggregateError) as error:
        aggregate(AggregateJob(models, tmp_path / "out", manifests=manifests), options())
    assert str(error.value).startswith(f"site b: manifest {manifests['b']}: {expected}"), str(error.value)
    assert not (tmp_path / "out").exists()


def rewrite_part(update: Path, part: str, change) -> None:
    """A peer's edit of one part of its update, with the sha256 list rewritten to match (the list comes
    from the same peer: it catches corruption, not tampering)."""
    path = update / "model.safetensors"
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    tensors[part] = change(tensors[part])
    path.unlink()
    save_file(tensors, path, metadata=metadata)
    record_checksums(update)


@pytest.mark.parametrize(
    ("dtype", "part", "change"),
    [
        ("int8", NAME, lambda t: t[:-8]),
        ("int8", NAME + ":scale", lambda t: t[:-4]),
        ("bf16", NAME, lambda t: torch.cat([t, t])),
    ],
    ids=["short values", "short scales", "long values"],
)
def test_a_compressed_update_whose_part_is_short_or_long_is_refused(tmp_path, dtype, part, change):
    start, site = start_and_site(tmp_path)
    update = tmp_path / "round-2" / "beta" / "update"
    compress(CompressJob(site, start, update), ExchangeOptions(dtype=dtype))
    rewrite_part(update, part, change)
    expected = rf"site beta: the update {update}: tensor {NAME}'s part '{part}' holds \d+ "
    with pytest.raises(exchange.ExchangeError, match=expected):
        aggregate(AggregateJob({"beta": update}, tmp_path / "out", start=start), UNIFORM)
    with pytest.raises(exchange.ExchangeError, match=rf"the update {update}: tensor {NAME}'s part"):
        decode_folder(update, start, tmp_path / "rebuilt", label="site beta")
    assert not (tmp_path / "out").exists() and not (tmp_path / "rebuilt").exists()


def test_a_weight_index_that_names_a_file_outside_its_folder_is_refused(tmp_path):
    """The peer's site model cs names this cluster's own site model it as its weights: refused by the
    merge and by every load, naming the site, the index and the entry."""
    own = write_checkpoint(tmp_path / "round-1" / "it" / "model", random_tensors(0))
    peer = write_checkpoint(tmp_path / "round-1" / "cs" / "model", random_tensors(1), shards=2)
    index_path = peer / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = dict.fromkeys(random_tensors(0), "../../it/model/model.safetensors")
    index_path.write_text(json.dumps(index))
    with pytest.raises(WeightsError) as error:
        aggregate(AggregateJob({"it": own, "cs": peer}, tmp_path / "out"), options(weights="uniform"))
    message = str(error.value)
    assert message.startswith(f"site cs: {index_path}: entry "), message
    assert "'../../it/model/model.safetensors' is not a plain file name of the index's own folder" in message
    assert not (tmp_path / "out").exists()
    for entry in ("/etc/passwd", "..", "sub/model.safetensors"):
        index["weight_map"] = dict.fromkeys(random_tensors(0), entry)
        index_path.write_text(json.dumps(index))
        with pytest.raises(WeightsError, match=f"the model {peer}: .*{entry!r} is not a plain file"):
            check_loadable(peer, task="causal-lm")


def test_a_manifest_whose_shards_lie_outside_its_folder_is_refused(tmp_path):
    site = tmp_path / "run" / "data" / "cs"
    (site / "train" / "shard-0").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (site / "train" / "shard-1").symlink_to(tmp_path / "elsewhere")
    manifest = site / "manifest.json"
    for shard in ("../../../elsewhere", "/etc", "train/shard-1", "train/../../it/train/shard-0"):
        manifest.write_text(json.dumps({"splits": {"train": {"shards": ["train/shard-0", shard]}}}))
        with pytest.raises(DataError) as error:
            manifest_shards(manifest)
        assert str(error.value).startswith(f"{manifest}: splits.train.shards names {shard!r}, which lies "), (
            shard
        )
    manifest.write_text(json.dumps({"splits": {"train": {"shards": ["train/shard-0"]}}}))
    assert manifest_shards(manifest) == [site / "train" / "shard-0"]


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("train.lr", float("nan"), "train.lr: nan is not a finite number"),
        ("train.lr", float("inf"), "train.lr: inf is not a finite number"),
        ("aggregate.weights", {"alpha": float("nan"), "beta": 1.0}, "aggregate.weights.alpha: nan is not"),
        (
            "aggregate.server_optimizer.tau",
            float("inf"),
            "aggregate.server_optimizer.tau: inf is not a finite",
        ),
    ],
    ids=["lr nan", "lr inf", "weights nan", "tau inf"],
)
def test_nan_and_inf_are_refused_when_the_config_loads_naming_the_key(tmp_path, key, value, named):
    config = demo()
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as error:
        load_config(path, base_dir=ROOT)
    assert str(error.value).startswith(f"{path}: "), str(error.value)
    assert named in str(error.value), str(error.value)
    # The CLIs' --options (JSON: NaN, Infinity) go through the same check.
    with pytest.raises(ConfigError, match=r"--options: aggregate.lambda: nan is not a finite number"):
        AggregateOptions.from_json('{"lambda": NaN}')


def test_vocab_rows_counts_with_a_site_whose_text_stays_home_is_refused():
    """Its token histogram would leave the site with its model, as the pooled baseline would pool its text."""
    config = two_clusters(private=("beta",))
    config["aggregate"] = {"vocab_rows": "counts"}
    with pytest.raises(
        ConfigError,
        match=r"^x.yaml: aggregate.vocab_rows: counts sends each site's token histogram .* but site beta's "
        r"text may not leave it \(sites.beta.dataset.shareable: false\); set aggregate.vocab_rows: weights",
    ):
        build_run_config(copy.deepcopy(config), source="x.yaml")
    config["sites"]["beta"]["dataset"]["shareable"] = True
    assert build_run_config(config).aggregate.vocab_rows == "counts"


def test_a_site_model_trained_from_another_start_is_refused_naming_site_round_and_both(tmp_path):
    """A stale copy (the previous round's model of site b, or an attempt from another start): refused
    before a byte is written, naming the site, the round and both identities."""
    models = sites_with(tmp_path, None)
    start = tmp_path / "round-3" / "start"
    here = exchange.start_identity(start)["identity"]
    stale = "e" * 64
    for site, identity in (("a", here), ("b", stale)):
        record = {
            "site": site,
            "round": 3,
            "start": {"identity": identity},
            "attempt": {"id": f"attempt-{site}"},
        }
        (models[site] / "training.json").write_text(json.dumps(record))
    out = tmp_path / "round-3" / "aggregate" / "model"
    with pytest.raises(AggregateError) as error:
        aggregate(AggregateJob(models, out, start=start), options(weights="uniform"))
    assert str(error.value).startswith(
        f"round 3: site b trained from start model {stale}, but the round's start model {start} is {here}"
    ), str(error.value)
    assert not out.exists()
    # The round's own models merge, and the aggregate records its start and attempt in turn.
    (models["b"] / "training.json").write_text(json.dumps({"site": "b", "start": {"identity": here}}))
    record = aggregate(AggregateJob(models, out, start=start), options(weights="uniform"))
    assert record["start_identity"] == here and len(record["attempt"]["id"]) == 32


def test_a_trained_site_model_carries_its_start_and_attempt_and_another_start_refuses_it(
    reference_run, tiny_model_dir, tmp_path
):
    """The real export (fedtune.train.loop) writes the start's identity and the attempt into training.json;
    merged against another start model (same tensors, other values), the site model is refused."""
    model = reference_run / "model"
    summary = json.loads((model / "training.json").read_text())
    assert summary["start"]["identity"] == exchange.start_identity(tiny_model_dir)["identity"]
    assert len(summary["attempt"]["id"]) == 32 and summary["attempt"]["host"]
    other = tmp_path / "other-start"
    shutil.copytree(tiny_model_dir, other)
    tensors = load_file(other / "model.safetensors")
    first = next(iter(tensors))
    tensors[first] = tensors[first] + 1
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    record_checksums(other)
    with pytest.raises(
        AggregateError, match=rf"^round 1: site alpha trained from start model {summary['start']['identity']}"
    ):
        aggregate(AggregateJob({"alpha": model}, tmp_path / "out", start=other), UNIFORM)
    aggregate(AggregateJob({"alpha": model}, tmp_path / "out", start=tiny_model_dir), UNIFORM)


def test_a_sites_adapter_holding_nan_stops_the_adapter_merge_or_is_left_out(tmp_path):
    """train.adapter: the same check over the sites' LoRA adapters (loaded whole, they are small)."""
    from transformers import LlamaForCausalLM

    from fedtune.aggregate.adapters import (
        ADAPTER_WEIGHTS,
        AdapterAggregateError,
        AdapterAggregateJob,
        aggregate_adapters,
    )

    from .test_adapter_aggregate import llama_config, opts, save_base, train_adapter

    torch.manual_seed(0)
    base = save_base(LlamaForCausalLM(llama_config()), tmp_path / "base")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    sites = {
        s: train_adapter(LlamaForCausalLM, base, tmp_path / "round-2" / s / "model", i, **lora)
        for i, s in enumerate("ab")
    }
    weights = load_file(sites["b"] / ADAPTER_WEIGHTS)
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, sites["b"] / ADAPTER_WEIGHTS)
    out = tmp_path / "round-2" / "aggregate" / "adapter"
    with pytest.raises(
        AdapterAggregateError, match=rf"^round 2: site b: tensor {name} of its adapter holds NaN"
    ):
        aggregate_adapters(AdapterAggregateJob(sites, out), opts())
    assert not out.exists()
    record = aggregate_adapters(AdapterAggregateJob(sites, out), opts(non_finite="leave_out"))
    assert record["left_out"] == [{"site": "b", "tensor": name, "reason": "non-finite values"}]
    assert [entry["site"] for entry in record["inputs"]] == ["a"]
