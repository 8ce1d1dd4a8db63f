"""Server optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2), one
tensor at a time.

The round's pseudo-gradient is Delta = sum_i w_i (site_i - start) (or, for merge methods other than
fedavg, the merged task vector), and the new global model is x = start + update:

- sgd:        update = lr * Delta                        (lr 1 is FedAvg)
- fedavgm:    m = momentum * m + Delta; update = lr * m
- fedadagrad: m = b1 m + (1 - b1) Delta; v = v + Delta^2
- fedyogi:    m as above; v = v - (1 - b2) Delta^2 sign(v - Delta^2)
- fedadam:    m as above; v = b2 v + (1 - b2) Delta^2
  and for the three adaptive ones update = lr * m / (sqrt(v) + tau).

m and v start at zero, as in Flower (flwr/server/strategy/fedopt.py and its subclasses, which create
them with np.zeros_like in the first round); the paper asks for v_{-1} >= tau^2, and tau in the
denominator keeps the first update finite either way. Two other choices of Flower are not copied, so
that each rule is exactly the paper's: Flower's FedAdam multiplies lr by the bias correction
sqrt(1 - b2^(t+1)) / (1 - b1^(t+1)), and its FedAdagrad fixes b1 = 0 (set betas: [0, ...] for that).
The state (m, v) is kept in fp32."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAMES = ("sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
SLOTS = {"sgd": (), "fedavgm": ("m",), "fedadam": ("m", "v"), "fedyogi": ("m", "v"), "fedadagrad": ("m", "v")}


@dataclass(frozen=True)
class ServerOptimizer:
    name: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.99)
    tau: float = 1e-3

    @classmethod
    def from_dict(cls, options: dict | None) -> ServerOptimizer:
        options = dict(options or {})
        unknown = sorted(set(options) - {"name", "lr", "momentum", "betas", "tau"})
        if unknown:
            raise ValueError(f"server optimizer: unknown keys {unknown}")
        if "betas" in options:
            options["betas"] = tuple(float(b) for b in options["betas"])
        optimizer = cls(**options)
        optimizer.check()
        return optimizer

    def check(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"server optimizer: {self.name!r} is not one of {', '.join(NAMES)}")
        if not self.lr > 0:
            raise ValueError(f"server optimizer: lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"server optimizer: momentum must be in [0, 1), got {self.momentum}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"server optimizer: betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not self.tau > 0:
            raise ValueError(f"server optimizer: tau must be positive, got {self.tau}")

    @property
    def slots(self) -> tuple[str, ...]:
        """Names of the state tensors kept per model tensor."""
        return SLOTS[self.name]

    @property
    def plain(self) -> bool:
        """True when the update is the pseudo-gradient itself (x = start + Delta)."""
        return self.name == "sgd" and self.lr == 1.0

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "lr": self.lr,
            "momentum": self.momentum,
            "betas": list(self.betas),
            "tau": self.tau,
        }


def step(
    optimizer: ServerOptimizer,
    delta: torch.Tensor,
    state: dict[str, torch.Tensor | None],
    out: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The update for one tensor, from its pseudo-gradient `delta` (fp32). `state` holds the previous
    m and v (None in the first round: zeros); the new ones are written into `out` (fp32 buffers of the
    same length). Returns the update (a new tensor, or `delta` scaled in place for sgd)."""
    name = optimizer.name
    if name == "sgd":
        return delta.mul_(optimizer.lr)
    m = out["m"]
    if name == "fedavgm":
        _decay(m, state.get("m"), optimizer.momentum).add_(delta)
        return m * optimizer.lr
    b1, b2 = optimizer.betas
    _decay(m, state.get("m"), b1).add_(delta, alpha=1 - b1)
    v_old = state.get("v")
    v = out["v"]
    if name == "fedadam":
        _decay(v, v_old, b2).addcmul_(delta, delta, value=1 - b2)
    elif name == "fedadagrad":
        v.zero_() if v_old is None else v.copy_(v_old)
        v.addcmul_(delta, delta)
    else:  # fedyogi
        v.zero_() if v_old is None else v.copy_(v_old)
        square = delta.mul_(delta)  # delta is not needed any more
        sign = torch.sign(v - square)
        v.sub_(square.mul_(sign), alpha=1 - b2)
    # delta's memory is free now: the update goes there.
    update = torch.sqrt(v, out=delta).add_(optimizer.tau)
    return torch.div(m, update, out=update).mul_(optimizer.lr)


def _decay(out: torch.Tensor, old: torch.Tensor | None, factor: float) -> torch.Tensor:
    """out = factor * old (zeros when there is none)."""
    if old is None:
        return out.zero_()
    return torch.mul(old, factor, out=out)
