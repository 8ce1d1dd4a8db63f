"""DeepSpeed never steps on a NaN gradient whose loss is finite (issue 47): the weights stay bit for bit
those of the step before, and the run stops as the FSDP one does, naming the step and the norm. ZeRO-0 in
fp32 steps torch's AdamW and computes no norm: fedtune's backend computes it and skips the step (before,
the NaN step was taken and the run stopped one step later, on a NaN loss). DeepSpeed's own optimizers
(ZeRO-1/2/3, ZeRO-0's bf16 wrapper) skip such a step themselves: held to it here, and deepspeed_extra that
turns their check off is refused."""

from __future__ import annotations

import os
import re

import pytest

from tests.test_train_resume import POISON_MICRO_BATCH
from tests.train_runs import ROOT, env, errors, launch, train_args

pytest_plugins = ["tests.train_fixtures"]

# Loaded by every Python process of the run (sitecustomize on PYTHONPATH): the gradients of one micro batch
# of step 3 become NaN while its loss stays finite, and each backend step prints whether it changed the
# weights this rank holds (the optimizer's fp32 master weights and the module's own, or its ZeRO-3 part).
HOOK = (
    POISON_MICRO_BATCH
    + """
_step = backends.DeepSpeedBackend.step
_steps = [0]


def _weights(backend):
    tensors = [p for g in backend.engine.basic_optimizer.param_groups for p in g["params"]]
    tensors += [getattr(p, "ds_tensor", p) for p in backend.engine.module.parameters()]
    return [t.detach().clone() for t in tensors]


def step(self, lr):
    before = _weights(self)
    try:
        return _step(self, lr)
    finally:
        _steps[0] += 1
        after = _weights(self)
        changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        finite = all(bool(torch.isfinite(t).all()) for t in after)
        print(f"backend step {_steps[0]}: weights changed {changed}, finite {finite}", flush=True)


backends.DeepSpeedBackend.step = step
"""
)

CASES = {
    "zero0": {"zero_stage": 0},
    "zero3": {"zero_stage": 3},
    "zero0-bf16": {"zero_stage": 0, "precision": "bf16"},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_deepspeed_does_not_step_on_a_nan_gradient_whose_loss_is_finite(
    tiny_model_dir, site_manifest, tmp_path, options
):
    """Step 3's first micro batch poisoned (2 ranks x 2 micro batches a step: the 5th call on each rank):
    steps 1 and 2 change the weights, step 3 leaves them exactly as they were, and the run stops naming
    step 3 and the gradient norm."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    run_env = env(POISON_CALL="5", POISON_MODE="grad")
    run_env["PYTHONPATH"] = f"{hook}{os.pathsep}{ROOT}"
    run_dir = tmp_path / "run"
    options = {"backend": "deepspeed", "checkpoint_every": 1, **options}
    result = launch(train_args(tiny_model_dir, site_manifest, run_dir, options), env=run_env)
    assert result.returncode != 0, result.stdout[-3000:] + errors(result.stderr)
    message = re.search(
        r"step 3: the gradient norm is (nan|inf) \(lr [^)]*\); the optimizer did not step", result.stderr
    )
    assert message, errors(result.stderr)
    steps = re.findall(r"backend step (\d): weights changed (True|False), finite (True|False)", result.stdout)
    # Every rank: steps 1 and 2 trained, step 3 left every weight bit for bit as it was.
    assert sorted(steps) == sorted(
        [("1", "True", "True"), ("2", "True", "True"), ("3", "False", "True")] * 2
    ), result.stdout[-3000:]
    assert not re.search(r"^step 3/", result.stdout, re.M)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [
        "step-00000001",
        "step-00000002",
    ]
    assert not (run_dir / "model").exists()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"zero_optimization": {"compute_grad_norm": False}}, "zero_optimization.compute_grad_norm"),
        ({"bf16": {"check_grad_overflow": False}}, "bf16.check_grad_overflow"),
    ],
    ids=["compute_grad_norm", "check_grad_overflow"],
)
def test_deepspeed_extra_that_turns_off_the_gradient_check_is_refused(extra, named):
    import torch

    from fedtune.core.options import ConfigError
    from fedtune.train.backends import deepspeed_config
    from fedtune.train.options import TrainOptions

    options = TrainOptions.from_mapping(
        {
            "backend": "deepspeed",
            "precision": "bf16",
            "deepspeed_extra": extra,
            "micro_batch": 1,
            "global_batch": 2,
        }
    )
    with pytest.raises(
        ConfigError, match=rf"^deepspeed_extra: {named}: false would let DeepSpeed step on a NaN"
    ):
        deepspeed_config(options, 2, torch.device("cpu"))
    kept = TrainOptions.from_mapping({"backend": "deepspeed", "micro_batch": 1, "global_batch": 2})
    assert "compute_grad_norm" not in deepspeed_config(kept, 2, torch.device("cpu"))["zero_optimization"]
