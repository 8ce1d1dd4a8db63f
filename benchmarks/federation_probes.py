"""Probes of the federation benchmark that are no pipeline setting (docs/federation.md, "The vocab rows'
step, fourth pass"): benchmarks/federation_bench.py's CLI, with its merge or its base config patched by
environment variables. Tuning half only; each probe's figures are in the rows marked * there (the
shared-step, Nesterov and sum rows with PROBE_ROW_STEP=1, the step before this pass).

    PROBE_ROW_STEP=3 python benchmarks/federation_probes.py run --half tuning --strategies \\
        --candidate '{}' --label step3 --out /tmp/probe

- PROBE_ROW_STEP: the vocab rows' step (`M`: the number of sites) in place of aggregate.vocab_step;
- PROBE_ROW_ONLY: a substring of the vocab tensors' names (lm_head, embed_tokens): the step applies to
  that tensor only, after the server optimizer (the same for sgd and fedavgm, which are linear);
- PROBE_ROWS=sum: each site that trained a token adds its whole row update (times the step);
- PROBE_SHARED_STEP: the update of every tensor not merged by rows times this;
- PROBE_NESTEROV=1: fedavgm's update lr (momentum m + delta);
- PROBE_TIE=1, PROBE_LR=x: the scratch regime with tied embeddings, or another site (and pooled) lr;
  use a --cache of their own, since the pooled model's cache key does not name them;
- PROBE_POOLED_VOCAB_LR=k: the pooled model's embeddings and LM head at k x the lr (its own --cache);
- the set `eight` (8 sites of tuning-half text) is added to the tuning half.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import federation_bench as fb  # noqa: E402

ENV = os.environ
ROW_STEP = ENV.get("PROBE_ROW_STEP")
ROW_ONLY = ENV.get("PROBE_ROW_ONLY", "")
ROWS_SUM = ENV.get("PROBE_ROWS") == "sum"
SHARED_STEP = float(ENV.get("PROBE_SHARED_STEP", "1"))
NESTEROV = ENV.get("PROBE_NESTEROV") == "1"
POOLED_VOCAB_LR = float(ENV.get("PROBE_POOLED_VOCAB_LR", "1"))

fb.sets.TUNING["eight"] = fb.sets._sites(
    "help-de:300 help-fr:300 help-es:300 help-pl:150 help-nl:100 help-ru:300 help-sv:200 help-en-us:100"
)


class Probe:
    """federation_bench.merge's changes: the vocab rows' table and each tensor's update."""

    row_step = 1.0

    def rows(self, table, counts, step):
        new_step = step
        if ROW_STEP is not None:
            new_step = len(counts) if ROW_STEP == "M" else float(ROW_STEP)
        self.row_step = new_step
        scale = 1.0 if ROW_ONLY else new_step  # with ROW_ONLY the step follows, tensor by tensor
        if ROWS_SUM:
            c = torch.from_numpy(np.stack(counts)).float()
            return torch.where(c.sum(0, keepdim=True) > 0, (c > 0).float(), table / step) * scale
        return table / step * scale

    def update(self, name, update, delta, state, by_row, optimizer):
        if NESTEROV and optimizer.name == "fedavgm":
            update = optimizer.lr * (optimizer.momentum * state["m"] + delta)
        if not by_row and SHARED_STEP != 1:
            update = update * SHARED_STEP
        if by_row and ROW_ONLY and ROW_ONLY in name:
            update = update * self.row_step
        return update


fb.MERGE_PROBE = Probe()
_regime_config = fb.regime_config


def regime_config(*args, **kwargs):
    config = _regime_config(*args, **kwargs)
    if ENV.get("PROBE_TIE") == "1":
        config["model"]["architecture"]["tie_word_embeddings"] = True
    if ENV.get("PROBE_LR"):
        config["train"]["lr"] = float(ENV["PROBE_LR"])
    return config


fb.regime_config = regime_config

if POOLED_VOCAB_LR != 1:
    _AdamW = torch.optim.AdamW
    _VOCAB: list = []

    class _VocabAdamW(_AdamW):
        """The pooled model's embeddings and LM head at POOLED_VOCAB_LR x the lr the schedule sets."""

        def __init__(self, params, **kwargs):
            params, ids = list(params), {id(p) for p in _VOCAB}
            groups = [
                {"params": [p for p in params if id(p) not in ids], "scale": 1.0},
                {"params": [p for p in params if id(p) in ids], "scale": POOLED_VOCAB_LR},
            ]
            super().__init__(groups, **kwargs)

        def step(self, closure=None):
            for group in self.param_groups:
                group["lr"] *= group["scale"]
            result = super().step(closure)
            for group in self.param_groups:
                group["lr"] /= group["scale"]
            return result

    _pooled = fb.Bench.pooled

    def pooled(self):
        _VOCAB[:] = [self.model.get_input_embeddings().weight, self.model.get_output_embeddings().weight]
        torch.optim.AdamW = _VocabAdamW
        try:
            return _pooled(self)
        finally:
            torch.optim.AdamW = _AdamW

    fb.Bench.pooled = pooled

if __name__ == "__main__":
    raise SystemExit(fb.main())
