"""Server optimizers: two rounds of each equal a hand computation of its update rule (1e-6); the state
travels between rounds as a checksummed safetensors folder and is refused when it does not fit."""

from __future__ import annotations

import json

import pytest
import torch

from fedtune.aggregate import methods as merge_methods
from fedtune.aggregate.merge import AggregateError, AggregateJob, aggregate, main
from fedtune.core.options import ConfigError
from tests.test_aggregate import options as aggregate_options
from tests.test_aggregate import read_output, write_checkpoint

NAMES = {"model.layers.0.mlp.up_proj.weight": (12, 8), "model.norm.weight": (8,)}
OPTIONS = {
    "sgd": {"name": "sgd", "lr": 0.7},
    "fedavgm": {"name": "fedavgm", "lr": 0.5, "momentum": 0.8},
    "nesterov": {"name": "nesterov", "lr": 0.7, "momentum": 0.9},
    "fedexp": {"name": "fedexp", "lr": 0.9},
    "fedadam": {"name": "fedadam", "lr": 0.01, "betas": [0.9, 0.99], "tau": 1e-3},
    "fedyogi": {"name": "fedyogi", "lr": 0.01, "betas": [0.8, 0.95], "tau": 1e-2},
    "fedadagrad": {"name": "fedadagrad", "lr": 0.05, "betas": [0.5, 0.9], "tau": 1e-3},
}


def near(model, g, scale=0.05):
    return {n: t + scale * torch.randn(*t.shape, generator=g) for n, t in model.items()}


def hand_step(options, delta, m, v, site_deltas=(), weights=()):
    """One server step in float64, written from Reddi et al. 2021, Algorithm 2 (m, v start at 0), and
    FedExP's (Jhunjhunwala et al. 2023, Algorithm 1) per tensor, its eta clipped to [1, sites]."""
    name, lr = options["name"], options["lr"]
    if name == "sgd":
        return lr * delta, m, v
    if name == "fedexp":
        spread = sum(w * float((d**2).sum()) for w, d in zip(weights, site_deltas, strict=True))
        eta = min(max(spread / (2 * float((delta**2).sum())), 1.0), len(site_deltas))
        return lr * eta * delta, m, v
    if name == "fedavgm":
        m = options["momentum"] * m + delta
        return lr * m, m, v
    if name == "nesterov":
        m = options["momentum"] * m + delta
        return lr * (delta + options["momentum"] * m), m, v
    b1, b2 = options["betas"]
    m = b1 * m + (1 - b1) * delta
    if name == "fedadagrad":
        v = v + delta**2
    elif name == "fedyogi":
        v = v - (1 - b2) * delta**2 * torch.sign(v - delta**2)
    else:
        v = b2 * v + (1 - b2) * delta**2
    return lr * m / (torch.sqrt(v) + options["tau"]), m, v


@pytest.mark.parametrize("optimizer", list(OPTIONS))
def test_two_rounds_equal_the_update_rule(tmp_path, optimizer):
    options = OPTIONS[optimizer]
    g = torch.Generator().manual_seed(3)
    base = {n: torch.randn(*s, generator=g) for n, s in NAMES.items()}
    start = write_checkpoint(tmp_path / "base", base)
    weights = [0.25, 0.75]
    m = {n: torch.zeros(s, dtype=torch.float64) for n, s in NAMES.items()}
    v = {n: torch.zeros(s, dtype=torch.float64) for n, s in NAMES.items()}
    state_in = None
    for r in (1, 2):
        current = read_output(start)
        sites = [near(current, g) for _ in weights]
        models = {s: write_checkpoint(tmp_path / f"r{r}-{s}", t) for s, t in zip("ab", sites, strict=True)}
        state_out = tmp_path / f"round-{r}" / "server_state"
        aggregate(
            AggregateJob(
                models,
                tmp_path / f"round-{r}" / "model",
                start=start,
                server_state_in=state_in,
                server_state_out=state_out,
            ),
            aggregate_options(weights={"a": 1, "b": 3}, max_shard_size="400B", server_optimizer=options),
        )
        merged = read_output(tmp_path / f"round-{r}" / "model")
        for n in NAMES:
            site_deltas = [s[n].double() - current[n].double() for s in sites]
            delta = sum(w * d for w, d in zip(weights, site_deltas, strict=True))
            update, m[n], v[n] = hand_step(options, delta, m[n], v[n], site_deltas, weights)
            expected = current[n].double() + update
            torch.testing.assert_close(merged[n].double(), expected, rtol=1e-6, atol=1e-6)
            assert (merged[n] - current[n]).abs().max() > 1e-4  # the step moved the model
        state = json.loads((state_out / "state.json").read_text())
        assert state["step"] == r and state["optimizer"]["name"] == optimizer
        if optimizer in ("sgd", "fedexp"):
            assert not list(state_out.glob("*.safetensors"))
        else:
            saved = read_output(state_out)
            for n in NAMES:
                torch.testing.assert_close(saved[f"m.{n}"].double(), m[n], rtol=1e-6, atol=1e-7)
                if f"v.{n}" in saved:
                    torch.testing.assert_close(saved[f"v.{n}"].double(), v[n], rtol=1e-6, atol=1e-9)
            assert (state_out / "fedtune-checksums.json").is_file()
            assert len(list(state_out.glob("*.safetensors"))) > 1
        start, state_in = tmp_path / f"round-{r}" / "model", state_out


@pytest.mark.parametrize(
    ("spread", "eta"),
    [("agree", 1.0), ("orthogonal", 2.0), ("cancel", 4.0)],
)
def test_fedexp_extrapolates_as_far_as_the_sites_updates_pull_apart(tmp_path, spread, eta):
    """Four equal sites: updates that agree take FedAvg's step; orthogonal ones (disjoint coordinates)
    M / 2 = 2 times it; updates that nearly cancel the cap, M = 4 times it. aggregate.json says which."""
    shape = (8, 16)
    base = {"w": torch.zeros(shape)}
    start = write_checkpoint(tmp_path / "base", base)
    deltas = []
    for i in range(4):
        d = torch.zeros(shape)
        if spread == "agree":
            d += 0.1
        elif spread == "orthogonal":
            d[2 * i : 2 * i + 2] = 0.1
        else:
            d += 0.1 if i % 2 == 0 else -0.1
            d[0, 0] += 0.01  # what is left of the mean
        deltas.append(d)
    models = {s: write_checkpoint(tmp_path / s, {"w": d}) for s, d in zip("abcd", deltas, strict=True)}
    record = aggregate(
        AggregateJob(models, tmp_path / "model", start=start),
        aggregate_options(weights="uniform", server_optimizer={"name": "fedexp"}),
    )
    mean = sum(deltas) / 4
    torch.testing.assert_close(read_output(tmp_path / "model")["w"], eta * mean, rtol=1e-6, atol=1e-7)
    assert record["server_optimizer"]["extrapolation"]["max"] == pytest.approx(eta)
    # Plain FedAvg on the same sites is the mean: fedexp never steps shorter.
    fedavg = aggregate(
        AggregateJob(models, tmp_path / "fedavg", start=start), aggregate_options(weights="uniform")
    )
    assert "extrapolation" not in fedavg.get("server_optimizer", {})
    torch.testing.assert_close(read_output(tmp_path / "fedavg")["w"], mean, rtol=1e-6, atol=1e-7)


def test_server_optimizer_composes_with_ties(tmp_path):
    g = torch.Generator().manual_seed(5)
    base = {n: torch.randn(*s, generator=g) for n, s in NAMES.items()}
    sites = [near(base, g) for _ in range(2)]
    models = {s: write_checkpoint(tmp_path / s, t) for s, t in zip("ab", sites, strict=True)}
    options = OPTIONS["fedadam"]
    aggregate(
        AggregateJob(
            models,
            tmp_path / "out",
            start=write_checkpoint(tmp_path / "base", base),
            server_state_out=tmp_path / "state",
        ),
        aggregate_options(weights="uniform", method="ties", density=0.4, server_optimizer=options),
    )
    merged = read_output(tmp_path / "out")
    for n in NAMES:
        flat = [s[n].reshape(-1) for s in sites]
        params = {"density": 0.4, "lambda": 1.0}
        delta = merge_methods.task_vector("ties", base[n].reshape(-1), flat, [0.5, 0.5], params)
        zeros = torch.zeros_like(delta, dtype=torch.float64)
        update, _, _ = hand_step(options, delta.double(), zeros, zeros)
        expected = base[n].reshape(-1).double() + update
        torch.testing.assert_close(merged[n].reshape(-1).double(), expected, rtol=1e-6, atol=1e-6)


def first_round(tmp_path, options):
    g = torch.Generator().manual_seed(7)
    base = {n: torch.randn(*s, generator=g) for n, s in NAMES.items()}
    start = write_checkpoint(tmp_path / "base", base)
    models = {s: write_checkpoint(tmp_path / s, near(base, g)) for s in "ab"}
    aggregate(
        AggregateJob(models, tmp_path / "r1", start=start, server_state_out=tmp_path / "state1"),
        aggregate_options(weights="uniform", server_optimizer=options),
    )
    return models, tmp_path / "r1"


def test_state_of_another_optimizer_or_a_damaged_state_is_refused(tmp_path):
    models, r1 = first_round(tmp_path, OPTIONS["fedadam"])
    with pytest.raises(AggregateError, match="written by server optimizer 'fedadam', not 'fedyogi'"):
        aggregate(
            AggregateJob(
                models,
                tmp_path / "r2",
                start=r1,
                server_state_in=tmp_path / "state1",
                server_state_out=tmp_path / "state2",
            ),
            aggregate_options(weights="uniform", server_optimizer=OPTIONS["fedyogi"]),
        )
    state_file = tmp_path / "state1" / "model.safetensors"
    data = bytearray(state_file.read_bytes())
    data[-1] ^= 0xFF
    state_file.write_bytes(bytes(data))
    assert (
        main(
            [
                "--out",
                str(tmp_path / "r2"),
                "--options",
                aggregate_options(weights="uniform", server_optimizer=OPTIONS["fedadam"]).to_json(),
                "--model",
                *(f"{s}={p}" for s, p in models.items()),
                "--start",
                str(r1),
                "--server-state-in",
                str(tmp_path / "state1"),
                "--server-state-out",
                str(tmp_path / "state2"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "r2").exists() and not (tmp_path / "state2").exists()


def test_bad_server_options_fail_before_reading(tmp_path):
    for options, message in [
        ({"name": "adamw"}, "name: 'adamw' is not one of"),
        ({"name": "fedadam", "betas": [0.9, 1.0]}, "betas.1: 1.0 is greater than or equal to the maximum"),
        ({"name": "fedavgm", "lr": 0}, "lr: 0 is less than or equal to the minimum"),
    ]:
        with pytest.raises(ConfigError, match=f"aggregate.server_optimizer.{message}"):
            aggregate_options(weights="uniform", server_optimizer=options)
    with pytest.raises(AggregateError, match="--server-state-out is needed"):
        aggregate(
            AggregateJob({"a": tmp_path / "a"}, tmp_path / "out", start=tmp_path),
            aggregate_options(weights="uniform", server_optimizer={"name": "fedadam"}),
        )


def test_a_start_model_in_another_float_dtype_is_taken(tmp_path):
    """A hub base stored in fp16 under sites that export bf16 (the llama2 examples): the default
    server optimizer reads the start, and its step is taken in fp32 whatever the start's dtype."""
    g = torch.Generator().manual_seed(5)
    base = {n: torch.randn(*s, generator=g) for n, s in NAMES.items()}
    start = write_checkpoint(tmp_path / "base", {n: t.to(torch.float16) for n, t in base.items()})
    sites = {s: near(base, g) for s in ("a", "b")}
    models = {
        s: write_checkpoint(tmp_path / s, {n: t.to(torch.bfloat16) for n, t in m.items()})
        for s, m in sites.items()
    }
    out = tmp_path / "out"
    aggregate(
        AggregateJob(models, out, start=start, server_state_out=tmp_path / "state"),
        aggregate_options(weights="uniform", dtype="float32"),
    )
    got = read_output(out)
    for name in NAMES:
        start_value = base[name].to(torch.float16).float()
        mean = sum(m[name].to(torch.bfloat16).float() for m in sites.values()) / 2
        assert torch.allclose(got[name], start_value + (mean - start_value), atol=1e-6), name
    # A site in another dtype than the first site is still refused.
    models["b"] = write_checkpoint(tmp_path / "b16", {n: t.to(torch.float16) for n, t in sites["b"].items()})
    with pytest.raises(AggregateError, match="tensor dtypes differ"):
        aggregate(
            AggregateJob(models, tmp_path / "out2", start=start, server_state_out=tmp_path / "state2"),
            aggregate_options(weights="uniform"),
        )
