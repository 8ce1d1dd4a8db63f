"""Merge methods: small functions over one tensor's values, as mergekit defines them.

A method is `f(base, sites, weights, params) -> iterator of task-vector chunks`: `base` is the tensor
of the model the round started from, `sites` the same tensor of every site model (flat, any floating
dtype, read-only), `weights` the sites' normalised weights (summing to 1), `params` the aggregate options
the method reads (its registry entry's `parameters`, and `name`, the tensor's name, which seeds DARE's
masks). It yields the merged task vector in fp32 (merged model = base + task vector) in the chunks of
`chunks(n)`, each valid until the next is asked for: elementwise methods (fedavg, TIES after its cut)
never hold a whole task vector. fedtune.aggregate.merge streams every method's chunks the same way
through the server optimizer (for every method but fedavg, the merged task vector plays the role of the
round's pseudo-gradient); `task_vector` collects them into one tensor. The registry, which names each
method's function here with its parameters and defaults, is fedtune.aggregate.options.MERGE_METHODS;
`merge_method(name)` gives an entry with its function.

The definitions follow mergekit 0.1.5 (mergekit/merge_methods/generalized_task_arithmetic.py, registry.py
and sparsify.py), with mergekit's per-model `weight` set to the normalised weights:

- task_arithmetic: base + lambda * sum_i w_i d_i (d_i = site_i - base; no normalisation);
- ties: each d_i trimmed to its `density` largest magnitudes; the sign of sum_i w_i d_i elected per
  entry; merged = lambda * sum_i w_i d_i [sign d_i = elected] / sum_i w_i [sign d_i = elected]
  (the disjoint mean; 0/0 counts as 0);
- dare_linear: each d_i keeps each entry with probability `density`, and is rescaled so that its L1
  norm is unchanged (`rescale: l1`, mergekit's since its 0.1 release) or by 1/density (`rescale:
  density`, the DARE paper and mergekit before 0.1); then as task_arithmetic;
- dare_ties: DARE's drop and rescale, then TIES's sign election, without dividing by the kept weights
  (mergekit's default normalize=false for dare_ties).

Two deliberate differences from mergekit: the arithmetic is in fp32 whatever the stored dtype (mergekit
computes in the models' dtype), and when several entries share the magnitude at TIES's cut, the first
ones in memory order are kept (mergekit keeps what its argsort returns first; here a linear-time
selection replaces the sort). DARE's masks come from a generator seeded by (seed, tensor name), so they
do not depend on the order tensors are visited in, nor on sharding."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from fedtune.aggregate.options import MERGE_METHODS, MergeMethodEntry, resolve
from fedtune.core.token_counts import rows_of_chunk

Params = Mapping[str, object]
# base, sites, weights, params -> the task vector's chunks, in order (see the module's docstring).
MergeFunction = Callable[
    [torch.Tensor, Sequence[torch.Tensor], Sequence[float], Params], Iterator[torch.Tensor]
]

RESCALES = ("l1", "density")


@dataclass(frozen=True)
class MergeMethod:
    """A registry entry (fedtune.aggregate.options.MERGE_METHODS) with its function."""

    entry: MergeMethodEntry
    merge: MergeFunction

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def parameters(self) -> Mapping[str, object]:
        return self.entry.parameters


def merge_method(name: str) -> MergeMethod:
    """The registry's entry `name` with its function (looked up when asked, so that an entry added at
    run time counts)."""
    entry = MERGE_METHODS[name]
    return MergeMethod(entry, _function(entry.function))


@functools.cache
def _function(function: str) -> MergeFunction:
    return resolve(function, __name__)


def weighted_mean(
    sites: Sequence[torch.Tensor], weights: Sequence[float], acc: torch.Tensor, tmp: torch.Tensor
) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i into `acc` (fp32, the inputs' length), using `tmp` as scratch.

    Computed as a running mean, acc += w_k / W_k * (x_k - acc) with W_k the cumulative weight, which
    returns an input unchanged, bit for bit, when every site holds the same values."""
    total = 0.0
    for src, weight in zip(sites, weights, strict=True):
        if weight == 0:
            continue
        total += weight
        if total == weight:
            acc.copy_(src)
            continue
        tmp.copy_(src)
        tmp.sub_(acc)
        acc.add_(tmp, alpha=weight / total)
    return acc


def fedavg(base, sites, weights, params):
    """The weighted mean's task vector, sum_i w_i (site_i - base) / sum_i w_i, chunk by chunk.

    Each difference is taken before weighting: sites close to the base then lose no precision to
    cancellation, as (mean - base) would."""
    n = base.numel()
    size = min(n, CHUNK)
    acc, tmp, base_full = (torch.empty(size) for _ in range(3))
    total = float(sum(weights))
    for start, end in chunks(n):
        # fp32 - fp16 rounds as fp32 - fp32 of the converted value, but torch's mixed-dtype kernels are
        # several times slower: convert the base once per chunk.
        base_f = base_full[: end - start].copy_(base[start:end])
        mean = acc[: end - start].zero_()
        for src, weight in zip(sites, weights, strict=True):
            if weight == 0:
                continue
            delta = tmp[: end - start].copy_(src[start:end]).sub_(base_f)
            mean.add_(delta, alpha=weight / total)
        yield mean


def fedavg_rows(base, sites, table: torch.Tensor, row_length: int):
    """fedavg's task vector with a weight per site and row (aggregate.vocab_rows: counts): `table` is
    (sites, rows), each column summing to the vocab step (fedtune.core.token_counts.row_weights times
    aggregate.vocab_step's factor); the tensor is (rows, row_length), flat."""
    n = base.numel()
    size = min(n, CHUNK)
    acc, tmp, base_full = (torch.empty(size) for _ in range(3))
    for start, end in chunks(n):
        base_f = base_full[: end - start].copy_(base[start:end])
        mean = acc[: end - start].zero_()
        weights = rows_of_chunk(table, start, end, row_length)
        for i, src in enumerate(sites):
            delta = tmp[: end - start].copy_(src[start:end]).sub_(base_f)
            mean.addcmul_(delta, weights[i])
        yield mean


def task_arithmetic(base, sites, weights, params):
    yield from _whole(_generalized(base, sites, weights, params, sparsify=None, consensus=False))


def ties(base, sites, weights, params):
    """TIES, chunk by chunk.

    The arithmetic of mergekit's TIES (see the module's docstring), entry for entry, streamed in
    cache-sized chunks: only the k-th largest magnitude of each task vector needs the whole tensor, and
    everything after it is elementwise, so the inputs are read once per stage instead of ~45 times.
    Masks are kept as fp32 0/1 (torch's mixed bool/float kernels are several times slower than its
    float ones), which changes no value: multiplying by 0 or 1 is exact, and the sign of a zero left
    by a dropped entry never reaches the result (it is masked out and added to +0)."""
    n = base.numel()
    cuts = _magnitude_cuts(base, sites, float(params["density"]))
    lam = float(params["lambda"])
    weights = [float(w) for w in weights]
    # Every divisor is a sum of weights of the sites agreeing with the elected sign: 0 where none does
    # (and there the numerator is +0), else at least the smallest positive weight. Raising the zeros to
    # that weight instead of 1 gives the same +0 in one float op.
    positive = [w for w in weights if w > 0]
    floor = min(positive) if positive and min(weights) >= 0 else None
    size = min(n, CHUNK)
    deltas_full = [torch.empty(size) for _ in sites]
    base_f_full, total_full, majority_full, mask_full, divisor_full, mixed_full = (
        torch.empty(size) for _ in range(6)
    )
    for start, end in chunks(n):
        size = end - start
        base_f = base_f_full[:size].copy_(base[start:end])
        deltas = []
        for src, cut, weight, buffer in zip(sites, cuts, weights, deltas_full, strict=True):
            delta = buffer[:size].copy_(src[start:end]).sub_(base_f)
            cut.apply(delta)
            deltas.append(delta.mul_(weight))
        total = total_full[:size].copy_(deltas[0])
        for delta in deltas[1:]:
            total.add_(delta)
        # The elected sign: +1 where the weighted sum is >= 0 (a zero sum elects +), else -1.
        majority = torch.ge(total, 0, out=majority_full[:size]).mul_(2).sub_(1)
        mixed = mixed_full[:size].zero_()
        divisor = divisor_full[:size].zero_()
        mask = mask_full[:size]
        for delta, weight in zip(deltas, weights, strict=True):
            # sign(delta) == majority: delta * majority is exact and positive exactly then.
            torch.gt(torch.mul(delta, majority, out=mask), 0, out=mask)
            mixed.addcmul_(delta, mask)
            divisor.add_(mask, alpha=weight)
        if floor is not None:
            divisor.clamp_min_(floor)
        else:
            divisor[divisor == 0] = 1
        mixed.div_(divisor)
        if lam != 1:
            mixed.mul_(lam)
        yield mixed


def dare_linear(base, sites, weights, params):
    yield from _whole(_generalized(base, sites, weights, params, sparsify=_bernoulli, consensus=False))


def dare_ties(base, sites, weights, params):
    yield from _whole(_generalized(base, sites, weights, params, sparsify=_bernoulli, consensus=True))


def chunks(n: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each chunk of a tensor of n entries: the streaming order of every method."""
    for start in range(0, n, CHUNK):
        yield start, min(n, start + CHUNK)


def task_vector(method: str, base, sites, weights, params: Params | None = None) -> torch.Tensor:
    """A method's whole task vector (fp32), with its parameters' defaults for those not in `params`."""
    entry = merge_method(method)
    out = torch.empty(base.numel())
    parts = entry.merge(base, sites, weights, {**entry.parameters, **(params or {})})
    for (start, end), part in zip(chunks(base.numel()), parts, strict=True):
        out[start:end].copy_(part)
    return out


def _whole(merged: torch.Tensor) -> Iterator[torch.Tensor]:
    """A task vector computed whole, handed out chunk by chunk."""
    for start, end in chunks(merged.numel()):
        yield merged[start:end]


def tensor_seed(seed: int, name: str) -> int:
    """The seed of one tensor's DARE masks: the same for a tensor wherever and whenever it is merged."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _generalized(base, sites, weights, params, *, sparsify, consensus: bool):
    """mergekit's GTATask.merge_group for one tensor, in fp32, with normalize=false (mergekit's default
    for these methods)."""
    lam = float(params["lambda"])
    base = base.float() if base.dtype != torch.float32 else base
    generator = None
    if sparsify is _bernoulli and float(params["density"]) < 1:
        generator = torch.Generator().manual_seed(tensor_seed(int(params["seed"]), str(params["name"])))
    weighted = []
    for src, weight in zip(sites, weights, strict=True):
        delta = src.float() if src.dtype != torch.float32 else src.clone()
        delta.sub_(base)
        if sparsify is not None:
            delta = sparsify(delta, params, generator)
        weighted.append(delta.mul_(float(weight)))
    if consensus:
        total = weighted[0].clone()
        for delta in weighted[1:]:
            total.add_(delta)
        majority = (total >= 0).float().mul_(2).sub_(1)
        del total
        # normalize=false: the agreeing entries are summed, not divided by their weights.
        mixed = torch.zeros_like(base)
        for delta in weighted:
            mixed.add_(delta.mul_(delta.sign() == majority))
        del majority
    else:
        mixed = weighted[0]
        for delta in weighted[1:]:
            mixed.add_(delta)
    if lam != 1:
        mixed.mul_(lam)
    return mixed


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest of a flat tensor, exactly. A full selection over a large tensor is the slowest
    step of TIES, so the value is first bracketed by quantiles of a sample; only the entries in the
    bracket go through the exact selection (the whole tensor does when the bracket misses)."""
    n = values.numel()
    if n <= 1 << 20:
        return torch.kthvalue(values, n - k + 1).values
    lo, hi = _bracket(values[torch.randint(n, (1 << 16,), generator=torch.Generator().manual_seed(0))], n, k)
    above = int(torch.count_nonzero(values > hi))
    band = values[(values >= lo).logical_and_(values <= hi)]
    if above < k <= above + band.numel():
        return torch.kthvalue(band, band.numel() - (k - above) + 1).values
    return torch.kthvalue(values, n - k + 1).values


# Entries per chunk of the streamed methods: a handful of 512 KiB fp32 chunk buffers stay within a core's
# L2 cache, and each chunk costs a few dozen small kernels whose fixed cost (microseconds each) dominated
# at 32K-entry chunks: TIES over the aggregate benchmark took 18.1 s in 32,704-entry chunks and 14.8 s in
# these (quiet machine). The merge runs on one intra-op thread (fedtune.aggregate.merge), so a chunk above
# at::parallel_for's grain is not split between threads. A multiple of every SIMD width (64 entries), so
# chunk boundaries never split a vector: elementwise results are the same as over the whole tensor.
CHUNK = 1 << 17


class _Cut:
    """What TIES keeps of one task vector, applied chunk by chunk in memory order: entries above
    `threshold`, plus the first `ties` entries equal to it. `zero` drops everything, `threshold` None
    keeps everything."""

    def __init__(self, threshold: float | None, ties: int = 0, zero: bool = False):
        self.threshold, self.ties, self.zero = threshold, ties, zero
        if ties > 0:
            # The next fp32 value below the threshold: |delta| > it exactly when |delta| >= threshold.
            below = torch.nextafter(torch.tensor(threshold), torch.tensor(0.0))
            self.below = float(below)

    def apply(self, delta: torch.Tensor) -> None:
        if self.zero:
            delta.zero_()
            return
        if self.threshold is None:
            return
        if self.ties > 0:
            # While this chunk's entries at the threshold all fit in the share still to keep, keep them
            # all with one float comparison; only the chunk where the share runs out needs indices.
            equal = torch.eq(delta.abs(), self.threshold, out=torch.empty_like(delta))
            count = int(equal.sum())
            if count <= self.ties:
                self.ties -= count
                torch.hardshrink(delta, self.below, out=delta)
                return
            first = equal.nonzero().reshape(-1)[: self.ties]
            kept = delta[first]
            self.ties = 0
            torch.hardshrink(delta, self.threshold, out=delta)
            delta[first] = kept
            return
        # hardshrink zeroes exactly the entries with |delta| <= threshold, in one vectorised pass.
        torch.hardshrink(delta, self.threshold, out=delta)


def _magnitude_cuts(base: torch.Tensor, sites: Sequence[torch.Tensor], density: float) -> list[_Cut]:
    """TIES's cut of each task vector src - base, in fp32: the `density` share of entries with the
    largest magnitude (at least one); when several entries share the magnitude at the cut, the first
    ones in memory order. Found without holding the task vectors: in one pass over the inputs (the
    base read once for every site), magnitudes are recomputed chunk by chunk, counted above a sampled
    bracket, and only the entries inside the bracket are kept for the exact selection."""
    n = base.numel()
    if density >= 1:
        return [_Cut(None) for _ in sites]
    if density <= 0 or n == 0:
        return [_Cut(None, zero=True) for _ in sites]
    k = max(1, int(density * n))
    if n <= 1 << 20:
        cuts = []
        for src in sites:
            magnitude = _magnitudes(base, src)
            cuts.append(_cut_from(magnitude, kth_largest(magnitude, k), k))
        return cuts
    # In ascending order, so that gathering the sample from a memory-mapped input faults its pages in
    # file order instead of at random.
    index = torch.randint(n, (1 << 16,), generator=torch.Generator().manual_seed(0)).sort().values
    base_sample = base[index].float()
    brackets = [_bracket(src[index].float().sub_(base_sample).abs_(), n, k) for src in sites]
    above = [0 for _ in sites]
    # The bracket holds about 2% of the entries. They are copied into one buffer per site as they are
    # found: kept as a list of per-chunk pieces, each piece pinned the heap above the temporaries of the
    # indexing that made it, and the process held ~200 MB more for the embedding's 17 MB of pieces.
    bands = [_Band(n // 32 + CHUNK) for _ in sites]
    size = min(n, CHUNK)
    magnitude_full, base_full, scratch_full = (torch.empty(size) for _ in range(3))
    inside_full = torch.empty(size, dtype=torch.bool)
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        size = end - start
        base_f = base_full[:size].copy_(base[start:end])
        scratch, inside = scratch_full[:size], inside_full[:size]
        for i, (src, (lo, hi)) in enumerate(zip(sites, brackets, strict=True)):
            # Copied to fp32 before subtracting, as the merge pass computes its deltas: a mixed-dtype sub
            # would round fp64 inputs after subtracting, and the cut would not match the deltas it trims.
            magnitude = magnitude_full[:size].copy_(src[start:end]).sub_(base_f).abs_()
            # Float 0/1 outputs and one bool mask: torch's bool-producing kernels are the slow ones here.
            above[i] += int(torch.gt(magnitude, hi, out=scratch).sum())
            clamped = torch.clamp(magnitude, lo, hi, out=scratch)
            bands[i].add(magnitude[torch.eq(clamped, magnitude, out=inside)])
    return [
        _cut_in_band(base, src, band.values(), k, count)
        for src, band, count in zip(sites, bands, above, strict=True)
    ]


class _Band:
    """A growing fp32 buffer the entries inside a bracket are appended to."""

    def __init__(self, capacity: int):
        self.data, self.size = torch.empty(capacity), 0

    def add(self, values: torch.Tensor) -> None:
        end = self.size + values.numel()
        if end > self.data.numel():
            grown = torch.empty(2 * end)
            grown[: self.size].copy_(self.data[: self.size])
            self.data = grown
        self.data[self.size : end].copy_(values)
        self.size = end

    def values(self) -> torch.Tensor:
        return self.data[: self.size]


def _bracket(sample: torch.Tensor, n: int, k: int) -> tuple[float, float]:
    """Values of the sample around the k-th largest of n (its quantiles q -/+ 0.01, from one sort):
    most likely, the k-th largest of the whole lies between them."""
    ordered = sample.sort().values
    last = ordered.numel() - 1
    q = (n - k + 1) / n
    lo = ordered[math.floor(max(0.0, q - 0.01) * last)]
    hi = ordered[math.ceil(min(1.0, q + 0.01) * last)]
    return float(lo), float(hi)


def _cut_in_band(base: torch.Tensor, src: torch.Tensor, inside: torch.Tensor, k: int, above: int) -> _Cut:
    n = base.numel()
    if above < k <= above + inside.numel():
        threshold = torch.kthvalue(inside, inside.numel() - (k - above) + 1).values
        return _Cut(float(threshold), _missing(float(threshold), k, above + int((inside > threshold).sum())))
    # The bracket missed (rare): select over the whole task vector.
    magnitude = _magnitudes(base, src)
    return _cut_from(magnitude, torch.kthvalue(magnitude, n - k + 1).values, k)


def _magnitudes(base: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """|src - base| in fp32, as a new tensor (src.float() is src itself when it is fp32)."""
    if src.dtype == torch.float32:
        return (src - base).abs_()
    return src.float().sub_(base.float()).abs_()


def _cut_from(magnitude: torch.Tensor, threshold: torch.Tensor, k: int) -> _Cut:
    return _Cut(float(threshold), _missing(float(threshold), k, int((magnitude > threshold).sum())))


def _missing(threshold: float, k: int, above: int) -> int:
    # Entries of magnitude 0 at the cut change nothing whether kept or not.
    return max(0, k - above) if threshold > 0 else 0


def _bernoulli(delta: torch.Tensor, params: Params, generator) -> torch.Tensor:
    """Keep each entry with probability `density`; rescale as `rescale` says."""
    density = float(params["density"])
    if density >= 1:
        return delta
    mask = torch.bernoulli(torch.full_like(delta, density), generator=generator)
    rescale = params["rescale"]
    if rescale == "density":
        return delta.mul_(mask).div_(density)
    before = delta.abs().sum()
    masked = delta.mul_(mask)
    after = masked.abs().sum()
    if before < 1e-7 or after < 1e-7:
        return masked
    return masked.mul_(before / after)
