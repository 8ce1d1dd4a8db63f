"""One registry each for merge methods and server optimizers (fedtune.aggregate.options): the schema's
enums and defaults are the registries' names and parameter defaults, every entry's function streams
through the same signature, and a method added as one entry runs through the merge."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from safetensors.torch import load_file

from fedtune.aggregate import methods, server_optimizers
from fedtune.aggregate.options import (
    LOW_RANK_SERVER_OPTIMIZERS,
    MERGE_METHODS,
    SERVER_OPTIMIZERS,
    AggregateOptions,
    MergeMethodEntry,
    ServerOptimizerOptions,
)
from fedtune.core.options import schema

AGGREGATE = schema("aggregate.schema.yaml")["properties"]
SERVER = AGGREGATE["server_optimizer"]["properties"]


def test_method_names_are_the_schemas_enum():
    assert AGGREGATE["method"]["enum"] == list(MERGE_METHODS)
    # aggregate.compare names methods through aggregate.method's enum, not a copy of it.
    assert AGGREGATE["compare"]["items"] == {"$ref": "#/properties/method"}
    assert AGGREGATE["rescale"]["enum"] == list(methods.RESCALES)


def test_method_parameters_are_schema_keys_with_the_schemas_defaults():
    read = set()
    for method in MERGE_METHODS.values():
        for name, default in method.parameters.items():
            assert AGGREGATE[name]["default"] == default, (method.name, name)
        read |= set(method.parameters)
    # Every method parameter of the section is read by some method, and the options pass them all.
    assert read == set(AggregateOptions.from_mapping({}).parameters)


def test_server_optimizer_names_and_parameters_are_the_schemas():
    assert SERVER["name"]["enum"] == list(SERVER_OPTIMIZERS)
    read = set()
    for optimizer in SERVER_OPTIMIZERS.values():
        for name, default in optimizer.parameters.items():
            expected = SERVER[name]["default"]
            same = list(default) == expected if isinstance(default, tuple) else default == expected
            assert same, (optimizer.name, name)
        read |= set(optimizer.parameters)
    fields = {f.name for f in dataclasses.fields(ServerOptimizerOptions)}
    assert read == fields - {"name"} == set(SERVER) - {"name"}


def test_the_low_rank_server_optimizers_are_linear():
    """The optimizers the registry marks low_rank (the ones adapter runs take) are linear: the update
    for a*D1 + b*D2 is a*update(D1) + b*update(D2) with the same state."""
    linear = [o.name for o in SERVER_OPTIMIZERS.values() if o.low_rank]
    assert list(LOW_RANK_SERVER_OPTIMIZERS) == linear == ["sgd", "fedavgm", "nesterov"]
    generator = torch.Generator().manual_seed(0)
    d1, d2, m = (torch.randn(16, generator=generator) for _ in range(3))
    for name in linear:
        options = ServerOptimizerOptions.from_mapping({"name": name, "lr": 1.5})
        slots = server_optimizers.slots(options)

        def update(delta, options=options, slots=slots):
            out = {slot: torch.empty(16) for slot in slots}
            return server_optimizers.step(options, delta.clone(), {slot: m for slot in slots}, out)

        combined = update(2 * d1 - 3 * d2) - update(torch.zeros(16))
        parts = 2 * (update(d1) - update(torch.zeros(16))) - 3 * (update(d2) - update(torch.zeros(16)))
        assert torch.allclose(combined, parts, atol=1e-5), name


def test_every_method_has_the_one_signature_and_streams_in_chunks():
    g = torch.Generator().manual_seed(0)
    n = methods.CHUNK + 77  # two chunks, the second partial
    base = torch.randn(n, generator=g)
    sites = [base + 0.01 * torch.randn(n, generator=g) for _ in range(2)]
    for entry in MERGE_METHODS.values():
        method = methods.merge_method(entry.name)
        assert list(inspect.signature(method.merge).parameters) == ["base", "sites", "weights", "params"]
        params = {**method.parameters, "name": "w"}
        sizes = [part.numel() for part in method.merge(base, sites, [0.5, 0.5], params)]
        assert sizes == [methods.CHUNK, 77], method.name


@pytest.mark.parametrize("name", list(SERVER_OPTIMIZERS))
def test_every_server_optimizer_keeps_the_state_it_names(name):
    options = ServerOptimizerOptions.from_mapping({"name": name, "lr": 0.5})
    delta = torch.ones(4)
    out = {slot: torch.full((4,), float("nan")) for slot in server_optimizers.slots(options)}
    update = server_optimizers.step(options, delta, dict.fromkeys(out), out)
    assert torch.isfinite(update).all()
    assert all(torch.isfinite(state).all() for state in out.values()), "a slot was left unwritten"


def test_options_round_trip_through_their_json_form():
    options = AggregateOptions.from_mapping(
        {"method": "ties", "lambda": 0.5, "server_optimizer": {"name": "fedadam"}, "weights": {"a": 1}}
    )
    assert AggregateOptions.from_json(options.to_json()) == options
    assert options.to_dict()["lambda"] == 0.5 and options.server_optimizer.betas == (0.9, 0.99)
    compared = AggregateOptions.from_json(options.compared_json("dare_ties"))
    assert compared.method == "dare_ties" and compared.server_optimizer.plain and compared.lam == 0.5


def test_the_run_config_holds_the_section_as_options_with_the_models_dtype():
    from fedtune.core.options import ConfigError
    from fedtune.run.config import build_run_config
    from tests.workflow_harness import demo_config

    config = demo_config()
    config["model"]["dtype"] = "bfloat16"
    config["aggregate"] = {"method": "ties", "weights": {"alpha": 1, "beta": 2}}
    run = build_run_config(config)
    assert isinstance(run.aggregate, AggregateOptions) and run.aggregate.dtype == "bfloat16"
    # The default server optimizer (docs/federation.md): sgd at lr 1, FedAvg's step.
    default = run.aggregate.server_optimizer
    assert run.aggregate.method == "ties" and (default.name, default.lr, default.plain) == ("sgd", 1.0, True)
    config = demo_config()
    config["aggregate"] = {"weights": {"alpha": 1}}
    with pytest.raises(
        ConfigError, match=r"aggregate.weights: must name every site once.*missing: \['beta'\]"
    ):
        build_run_config(config)
    with pytest.raises(ConfigError, match="dtype: 'int8' is not one of auto, float32"):
        AggregateOptions.from_mapping({"dtype": "int8"})


def test_the_plain_step_is_what_the_registry_flags():
    """plain (every step the merged task vector) and plain_first_step come from the entries' flags."""
    flags = {
        name: (options.plain, options.plain_first_step)
        for name in SERVER_OPTIMIZERS
        for options in [ServerOptimizerOptions.from_mapping({"name": name, "lr": 1.0})]
    }
    assert flags == {
        "sgd": (True, True),
        "fedavgm": (False, True),
        "nesterov": (False, False),  # its first step is lr (1 + momentum) delta
        "fedexp": (False, False),
        "fedadam": (False, False),
        "fedyogi": (False, False),
        "fedadagrad": (False, False),
    }
    assert not ServerOptimizerOptions.from_mapping({"name": "sgd", "lr": 0.5}).plain_first_step
    assert ServerOptimizerOptions.plain_step() == ServerOptimizerOptions.from_mapping({"name": "sgd"})


def first_site(base, sites, weights, params):
    """A toy merge method: lambda times the first site's task vector, whatever the weights."""
    yield from methods._whole((sites[0].float() - base.float()) * params["lambda"])


def test_a_merge_method_is_one_registry_entry_and_its_function(tmp_path, monkeypatch):
    """Adding a merge method: its function (here, this module's first_site) and one entry in
    MERGE_METHODS; the merge streams it through the server optimizer like any other."""
    from fedtune.aggregate.merge import AggregateJob, aggregate
    from tests.test_aggregate import write_checkpoint

    entry = MergeMethodEntry("first_site", "tests.test_aggregate_registries:first_site", {"lambda": 1.0})
    monkeypatch.setitem(MERGE_METHODS, entry.name, entry)
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    sites = [{k: v + torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    start = write_checkpoint(tmp_path / "start", base)
    models = {s: write_checkpoint(tmp_path / s, tensors) for s, tensors in zip("ab", sites, strict=True)}
    options = AggregateOptions.from_mapping(
        {"lambda": 0.5, "weights": "uniform", "server_optimizer": {"name": "sgd", "lr": 2.0}}
    )
    record = aggregate(
        AggregateJob(models, tmp_path / "out", start=start), dataclasses.replace(options, method="first_site")
    )
    merged = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in base.items():
        # sgd at lr 2 steps twice the method's task vector: base + 2 * 0.5 * (site a - base).
        torch.testing.assert_close(merged[name], value + (sites[0][name] - value), rtol=0, atol=1e-6)
    assert record["method"] == "first_site"
