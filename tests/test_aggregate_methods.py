"""Merge methods over task vectors: equal to mergekit's own functions on the same tensors (fp32, 1e-6),
DARE's masks reproducible from the seed whatever the sharding, and fedavg unchanged bit for bit."""

from __future__ import annotations

import pytest
import torch
from mergekit.merge_methods import merge_tensors

from fedtune.aggregate import methods as merge_methods
from fedtune.aggregate.merge import AggregateError, AggregateJob, aggregate
from fedtune.core.options import ConfigError
from tests.test_aggregate import options as aggregate_options
from tests.test_aggregate import read_output, write_checkpoint

WEIGHTS = [0.2, 0.3, 0.5]


def task_inputs(shape, seed=0, sites=3):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(*shape, generator=g)
    return base, [base + 0.1 * torch.randn(*shape, generator=g) for _ in range(sites)]


def mergekit_merge(method, base, sites, weights, *, lam, density, seed, name):
    # mergekit draws DARE's masks from torch's global generator, site after site; ours draws them
    # from a generator seeded per tensor, site after site: same seed, same masks.
    torch.manual_seed(merge_methods.tensor_seed(seed, name))
    parameters = {"weight": list(weights), "lambda": lam}
    if method != "task_arithmetic":
        parameters["density"] = density
    return merge_tensors([base, *sites], method, parameters=parameters, base_index=0)


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare_linear", "dare_ties"])
@pytest.mark.parametrize(("density", "lam"), [(0.3, 1.0), (0.7, 0.6), (1.0, 1.4)])
@pytest.mark.parametrize("shape", [(48, 32), (257,)])
def test_methods_equal_mergekit(method, density, lam, shape):
    base, sites = task_inputs(shape)
    params = {"lambda": lam, "density": density, "seed": 11, "name": "model.w", "rescale": "l1"}
    flat = [s.reshape(-1) for s in sites]
    ours = base.reshape(-1) + merge_methods.task_vector(method, base.reshape(-1), flat, WEIGHTS, params)
    theirs = mergekit_merge(method, base, sites, WEIGHTS, lam=lam, density=density, seed=11, name="model.w")
    torch.testing.assert_close(ours, theirs.reshape(-1), rtol=0, atol=1e-6)
    if method != "task_arithmetic" and density < 1:
        # The sparsification did something: the result is not plain task arithmetic.
        plain = merge_methods.task_vector("task_arithmetic", base.reshape(-1), flat, WEIGHTS, params)
        assert (base.reshape(-1) + plain - ours).abs().max() > 1e-3


def test_ties_by_hand():
    """TIES on a small case worked out on paper: trim to the top 50%, elect by summed mass, disjoint mean."""
    base = torch.zeros(4)
    sites = [torch.tensor([3.0, -1.0, 0.5, -2.0]), torch.tensor([-1.0, -4.0, 2.0, 0.1])]
    # trimmed: site0 keeps 3, -2; site1 keeps -4, 2. Weighted (0.5, 0.5): [1.5, 0, 0, -1], [0, -2, 1, 0]
    # elected signs: +, -, +, -; disjoint mean divides by the kept weights (0.5 each).
    merged = merge_methods.task_vector("ties", base, sites, [0.5, 0.5], {"density": 0.5, "lambda": 1.0})
    assert merged.tolist() == [3.0, -4.0, 2.0, -2.0]


def test_dare_paper_rescale_is_one_over_density():
    base, sites = task_inputs((1000,), seed=3, sites=2)
    params = {"density": 0.25, "lambda": 1.0, "seed": 4, "name": "t", "rescale": "density"}
    ours = merge_methods.task_vector("dare_linear", base, sites, [0.5, 0.5], params)
    generator = torch.Generator().manual_seed(merge_methods.tensor_seed(4, "t"))
    expected = torch.zeros(1000, dtype=torch.float64)
    for site in sites:
        mask = torch.bernoulli(torch.full((1000,), 0.25), generator=generator)
        expected += 0.5 * (site - base).double() * mask.double() / 0.25
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=1e-6)


def test_aggregate_streams_a_method_equal_to_mergekit(tmp_path):
    """The whole CLI path (sharded inputs, bf16 and fp32 tensors mixed, tokens weights) against
    mergekit per tensor; DARE's masks do not depend on sharding or visiting order."""
    g = torch.Generator().manual_seed(1)
    names = {f"model.layers.{i}.mlp.up_proj.weight": (24, 16) for i in range(4)}
    names["model.norm.weight"] = (16,)
    base = {n: torch.randn(*s, generator=g) for n, s in names.items()}
    sites = [{n: t + 0.05 * torch.randn(*t.shape, generator=g) for n, t in base.items()} for _ in range(2)]
    start = write_checkpoint(tmp_path / "start", base)
    models = {
        "a": write_checkpoint(tmp_path / "a", sites[0]),
        "b": write_checkpoint(tmp_path / "b", sites[1], shards=3),
    }
    options = {"method": "dare_ties", "weights": {"a": 1, "b": 3}, "lam": 0.8, "density": 0.5, "seed": 9}
    record = aggregate(
        AggregateJob(models, tmp_path / "one", start=start),
        aggregate_options(**options, max_shard_size="2KB"),
    )
    merged = read_output(tmp_path / "one")
    for name in names:
        theirs = mergekit_merge(
            "dare_ties",
            base[name],
            [s[name] for s in sites],
            [0.25, 0.75],
            lam=0.8,
            density=0.5,
            seed=9,
            name=name,
        )
        torch.testing.assert_close(merged[name], theirs, rtol=0, atol=1e-6)
    assert record["parameters"]["density"] == 0.5 and record["start"]["model_dir"] == str(start)
    # Other sharding of inputs and output, same seed: the same model, bit for bit.
    models_resharded = {
        "a": write_checkpoint(tmp_path / "a2", sites[0], shards=2),
        "b": write_checkpoint(tmp_path / "b2", sites[1]),
    }
    aggregate(AggregateJob(models_resharded, tmp_path / "two", start=start), aggregate_options(**options))
    again = read_output(tmp_path / "two")
    assert all(torch.equal(again[n], merged[n]) for n in names)
    # Another seed draws other masks.
    aggregate(
        AggregateJob(models, tmp_path / "three", start=start), aggregate_options(**{**options, "seed": 10})
    )
    other = read_output(tmp_path / "three")
    assert any(not torch.equal(other[n], merged[n]) for n in names)


def test_fedavg_with_start_is_todays_mean_bit_for_bit(tmp_path):
    """fedavg with sgd at lr 1 is today's running mean, bit for bit, whether or not --start is given."""
    g = torch.Generator().manual_seed(2)
    tensors = [
        {"w": torch.randn(33, 7, generator=g).to(torch.bfloat16), "n": torch.randn(9, generator=g)}
        for _ in range(3)
    ]
    models = {s: write_checkpoint(tmp_path / s, t) for s, t in zip("abc", tensors, strict=True)}
    weights = {"a": 1, "b": 2.5, "c": 7}
    aggregate(AggregateJob(models, tmp_path / "plain"), aggregate_options(weights=weights))
    aggregate(
        AggregateJob(models, tmp_path / "start", start=models["a"]),
        aggregate_options(weights=weights, server_optimizer={"name": "sgd", "lr": 1.0}),
    )
    plain, with_start = read_output(tmp_path / "plain"), read_output(tmp_path / "start")
    normalised = [w / 10.5 for w in (1, 2.5, 7)]
    for name in ("w", "n"):
        # Today's code path: acc = x_1; acc += w_k / W_k * (x_k - acc) in fp32, rounded once.
        acc = tensors[0][name].float().clone()
        cumulative = normalised[0]
        for w, t in zip(normalised[1:], tensors[1:], strict=True):
            cumulative += w
            acc.add_(t[name].float() - acc, alpha=w / cumulative)
        assert torch.equal(plain[name], with_start[name])
        assert torch.equal(plain[name], acc.to(tensors[0][name].dtype))


def test_methods_need_the_start_model(tmp_path):
    with pytest.raises(AggregateError, match="--start"):
        aggregate(
            AggregateJob({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "out"),
            aggregate_options(weights="uniform", method="ties"),
        )
    with pytest.raises(ConfigError, match="aggregate.density"):
        aggregate_options(weights="uniform", method="ties", density=0)


def test_start_model_must_hold_the_same_tensors(tmp_path):
    base, sites = task_inputs((8, 4), sites=2)
    models = {s: write_checkpoint(tmp_path / s, {"w": t}) for s, t in zip("ab", sites, strict=True)}
    start = write_checkpoint(tmp_path / "start", {"w": base[:4]})
    with pytest.raises(AggregateError, match="the start model .* tensor shapes differ"):
        options = aggregate_options(weights="uniform", method="ties", density=0.5)
        aggregate(AggregateJob(models, tmp_path / "out", start=start), options)


def test_kth_largest_is_exact_on_large_tensors_with_ties():
    # Rounded to fp16, 1.5M values share a few thousand magnitudes: many ties at every cut.
    values = torch.randn(1_500_000, generator=torch.Generator().manual_seed(8)).half().float().abs()
    n = values.numel()
    for k in (1, 2, 1000, n // 3, n // 2, n - 5, n):
        assert merge_methods.kth_largest(values, k) == torch.kthvalue(values, n - k + 1).values, k


def whole_tensor_ties(base, sites, weights, density, lam):
    """TIES over whole tensors with bool masks and a full sort: the definition the streamed one keeps."""
    base = base.float()
    n = base.numel()
    k = max(1, int(density * n))
    weighted = []
    for src, weight in zip(sites, weights, strict=True):
        delta = src.float() - base
        magnitude = delta.abs()
        order = torch.sort(magnitude, descending=True, stable=True)
        threshold = order.values[k - 1]
        keep = magnitude > threshold
        if threshold > 0:
            equal = (magnitude == threshold).nonzero().reshape(-1)
            keep[equal[: k - int(keep.sum())]] = True
        weighted.append(delta * keep * weight)
    total = sum(weighted[1:], weighted[0].clone())
    majority = (total >= 0).float() * 2 - 1
    mixed = torch.zeros(n)
    divisor = torch.zeros(n)
    for delta, weight in zip(weighted, weights, strict=True):
        mask = delta.sign() == majority
        mixed += delta * mask
        divisor += mask * weight
    divisor[divisor == 0] = 1
    return mixed / divisor * lam


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_streamed_ties_equals_the_whole_tensor_definition_bit_for_bit(dtype):
    # Over 1M entries (the sampled bracket's path) and many chunks; fp16-rounded values put thousands
    # of entries at every cut, so the ties at the cut run out in the middle of a chunk.
    g = torch.Generator().manual_seed(5)
    n = 1_500_001
    base = (torch.randn(n, generator=g) * 0.02).to(dtype)
    sites = [(base.float() + torch.randn(n, generator=g) * 0.001).to(dtype) for _ in range(3)]
    weights = [0.2, 0.5, 0.3]
    for density, lam in ((0.5, 1.0), (0.13, 0.8)):
        ours = merge_methods.task_vector("ties", base, sites, weights, {"density": density, "lambda": lam})
        reference = whole_tensor_ties(base, sites, weights, density, lam)
        assert torch.equal(ours.view(torch.int32), reference.view(torch.int32)), density


def test_band_buffer_grows_and_keeps_what_was_added():
    band = merge_methods._Band(2)
    pieces = [torch.tensor([3.0, 1.0, 2.0]), torch.tensor([]), torch.arange(5.0)]
    for piece in pieces:
        band.add(piece)
    assert torch.equal(band.values(), torch.cat(pieces))
