"""Server optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2), one
tensor at a time.

The round's pseudo-gradient is Delta = sum_i w_i (site_i - start) (or, for merge methods other than
fedavg, the merged task vector), and the new global model is x = start + update:

- sgd:        update = lr * Delta                        (lr 1 is FedAvg)
- fedavgm:    m = momentum * m + Delta; update = lr * m
- nesterov:   m = momentum * m + Delta; update = lr * (Delta + momentum * m): DiLoCo's outer step
  (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023: outer
  SGD with Nesterov momentum 0.9 at lr 0.7), which is torch.optim.SGD(nesterov=True, dampening 0)
  applied to the pseudo-gradient start - mean (its first buffer is the first gradient, here m = Delta)
- fedadagrad: m = b1 m + (1 - b1) Delta; v = v + Delta^2
- fedyogi:    m as above; v = v - (1 - b2) Delta^2 sign(v - Delta^2)
- fedadam:    m as above; v = b2 v + (1 - b2) Delta^2
  and for the three adaptive ones update = lr * m / (sqrt(v) + tau).
- fedexp:     update = lr * eta * Delta, eta from the sites' updates of this tensor (`fedexp_scale`):
  FedExP's extrapolation (Jhunjhunwala, Wang and Joshi, "FedExP: Speeding Up Federated Averaging via
  Extrapolation", ICLR 2023), per tensor, since the merge streams one tensor at a time.

m and v start at zero, as in Flower (flwr/server/strategy/fedopt.py and its subclasses, which create
them with np.zeros_like in the first round); the paper asks for v_{-1} >= tau^2, and tau in the
denominator keeps the first update finite either way. Two other choices of Flower are not copied, so
that each rule is exactly the paper's: Flower's FedAdam multiplies lr by the bias correction
sqrt(1 - b2^(t+1)) / (1 - b1^(t+1)), and its FedAdagrad fixes b1 = 0 (set betas: [0, ...] for that).
The state (m, v) is kept in fp32.

The registry (name, parameters with their defaults, the step function here by name, state slots, and
whether it steps low-rank factors) is fedtune.aggregate.options.SERVER_OPTIMIZERS; the options
(ServerOptimizerOptions) are checked once, against aggregate.schema.yaml, when they are made, so nothing
here checks them again."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from fedtune.aggregate.options import ServerOptimizerOptions, resolve

# step(options, delta, state, out) -> update; see `step` below.
Step = Callable[[ServerOptimizerOptions, torch.Tensor, dict, dict], torch.Tensor]


def sgd(options, delta, state, out):
    return delta.mul_(options.lr)


def fedexp_scale(spread: float, merged: float, sites: int) -> float:
    """FedExP's server step for one tensor: eta = sum_i w_i ||Delta_i||^2 / (2 ||Delta||^2), where
    Delta = sum_i w_i Delta_i is the merged update, clipped to [1, sites]. Where the sites' updates
    agree eta is 1 (FedAvg); where they are orthogonal, M equal sites give eta = M / 2: the mean has
    shrunk each update by the disagreement, and the step restores its length. The paper adds epsilon to
    the denominator against updates that cancel; a bound of the number of sites does that here without
    a scale-dependent constant (per tensor, the norms differ by orders of magnitude)."""
    if merged <= 0.0 or spread <= 0.0:
        return 1.0
    return min(max(spread / (2.0 * merged), 1.0), float(sites))


def fedavgm(options, delta, state, out):
    m = out["m"]
    _decay(m, state.get("m"), options.momentum).add_(delta)
    return m * options.lr


def nesterov(options, delta, state, out):
    m = out["m"]
    _decay(m, state.get("m"), options.momentum).add_(delta)
    return delta.add_(m, alpha=options.momentum).mul_(options.lr)


def fedadam(options, delta, state, out):
    m = _first_moment(options, delta, state, out)
    _, b2 = options.betas
    v = _decay(out["v"], state.get("v"), b2).addcmul_(delta, delta, value=1 - b2)
    return _adaptive_update(options, m, v, delta)


def fedadagrad(options, delta, state, out):
    m = _first_moment(options, delta, state, out)
    v = _copy(out["v"], state.get("v")).addcmul_(delta, delta)
    return _adaptive_update(options, m, v, delta)


def fedyogi(options, delta, state, out):
    m = _first_moment(options, delta, state, out)
    _, b2 = options.betas
    v = _copy(out["v"], state.get("v"))
    square = delta.mul_(delta)  # delta is not needed any more
    v.sub_(square.mul_(torch.sign(v - square)), alpha=1 - b2)
    return _adaptive_update(options, m, v, delta)


def slots(options: ServerOptimizerOptions) -> tuple[str, ...]:
    """Names of the state tensors the configured optimizer keeps per model tensor."""
    return options.slots


def step(
    options: ServerOptimizerOptions,
    delta: torch.Tensor,
    state: dict[str, torch.Tensor | None],
    out: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The update for one tensor, from its pseudo-gradient `delta` (fp32, overwritten). `state` holds
    the previous m and v (None in the first round: zeros); the new ones are written into `out` (fp32
    buffers of the same length). Returns the update (a new tensor, or `delta` reused)."""
    return _step_function(options.entry.step)(options, delta, state, out)


@functools.cache
def _step_function(function: str) -> Step:
    return resolve(function, __name__)


def _first_moment(options, delta, state, out) -> torch.Tensor:
    """m = b1 m + (1 - b1) delta, into out["m"]."""
    b1, _ = options.betas
    return _decay(out["m"], state.get("m"), b1).add_(delta, alpha=1 - b1)


def _adaptive_update(options, m: torch.Tensor, v: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """lr * m / (sqrt(v) + tau), written into `free` (delta's memory, not needed any more)."""
    update = torch.sqrt(v, out=free).add_(options.tau)
    return torch.div(m, update, out=update).mul_(options.lr)


def _decay(out: torch.Tensor, old: torch.Tensor | None, factor: float) -> torch.Tensor:
    """out = factor * old (zeros when there is none)."""
    if old is None:
        return out.zero_()
    return torch.mul(old, factor, out=out)


def _copy(out: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """out = old (zeros when there is none)."""
    return out.zero_() if old is None else out.copy_(old)
