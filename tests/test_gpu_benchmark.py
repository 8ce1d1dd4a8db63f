"""benchmarks/gpu_training.py: its FLOPs formula and peak table, and its --smoke mode end to end on CPU
(every run: the HF Trainer, fedtune's FSDP2 with and without fedtune.train.speed, the QLoRA run's adapter,
DeepSpeed ZeRO-2/3), with docs/scaling.md's memory formula beside each FSDP2 run's peak."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_training  # noqa: E402


def test_peak_table_prefers_the_specific_name():
    assert gpu_training.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_training.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_training.peak_tflops("NVIDIA H200") == 989.0
    assert gpu_training.peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
    assert gpu_training.peak_tflops("Tesla V100-SXM2-32GB") == 125.0
    assert gpu_training.peak_tflops("some CPU") is None


@pytest.mark.parametrize("name", ["smoke", "1b", "2.7b"])
def test_flops_count_every_matmul_parameter(name):
    """N of 6N is every parameter but the input embedding and the norms: checked against a real model."""
    import torch

    architecture = gpu_training.ARCHITECTURES[name]
    with torch.device("meta"):
        model = gpu_training.build_model({"architecture": architecture, "seq": 2048, "seed": 0})
    total = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    embedding = model.get_input_embeddings().weight.numel()
    flops = gpu_training.flops_per_token(architecture, 2048)
    assert flops["matmul_params"] == total - norms - embedding
    layers, d = architecture["num_hidden_layers"], architecture["hidden_size"]
    assert flops["total"] == 6 * flops["matmul_params"] + 12 * layers * 2048 * d
    assert flops["total_causal"] == 6 * flops["matmul_params"] + 6 * layers * 2049 * d
    if name == "1b":
        assert 1.0e9 < total < 1.2e9
    if name == "2.7b":  # Sheared-LLaMA-2.7B: 2.70B parameters
        assert 2.6e9 < total < 2.8e9


# Every backend and code path once: the micro-batch variants of issue 41 differ from these only in their
# numbers, except the per-run checkpointing (fsdp_fast_mb4_ac) and a Trainer at another micro batch; the
# optimizer offload builds DeepSpeed's CPU Adam, minutes on this machine (tests/test_deepspeed*.py train it).
SMOKE_RUNS = [
    n for n in gpu_training.RUNS if n not in gpu_training.MICRO_FACTOR and n != "deepspeed_zero3_offload"
]
SMOKE_RUNS += ["fsdp_fast_mb2", "fsdp_fast_mb4_ac", "hf_trainer_mb2"]


def test_smoke_run_reports_every_backend(tmp_path):
    out = tmp_path / "report.json"
    peak = 0.1  # TFLOPS, so that the MFU column is computed on CPU
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_training.py"), "--smoke", "--peak-tflops", str(peak),
         "--checkpoint-every", "2", "--out", str(out), "--runs", ",".join(SMOKE_RUNS), "--budget-s", "560",
         # Micro batch 2 x 4: the micro-batch variants (x2, x4) then see the same rows per step.
         "--accumulation", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["runs"]) == SMOKE_RUNS
    settings = report["settings"]
    assert settings["tokens_per_step"] == settings["micro_batch"] * settings["accumulation"] * settings["seq"]
    flops = settings["flops_per_token"]["total"]
    for name, row in report["runs"].items():
        assert set(gpu_training.COLUMNS) <= set(row), name
        assert row["tokens_per_s"] > 0 and row["steps"] == settings["steps"], name
        if name == "qlora":
            # An adapter's run: no MFU (the frozen base has no weight gradients), a small trainable part.
            assert row["mfu"] is None and 0 < row["trainable_params"] < 0.5 * report["settings"]["parameters"]
        else:
            assert row["mfu"] == pytest.approx(
                row["tokens_per_s"] * flops / (peak * 1e12), rel=1e-3, abs=1e-4
            )
            assert 0 < row["mfu_causal"] < row["mfu"]
        # The memory formula is set beside FSDP2's full-sharding runs only.
        assert ("plan_mem_mb" in row) == (name in ("fsdp", "fsdp_fast", "fsdp_fast_mb2")), name
        assert 50 < row["peak_mem_mb"] < 8000, name
        # Random tokens and a random model: the loss starts near ln(vocabulary).
        assert abs(row["first_loss"] - math.log(settings["architecture"]["vocab_size"])) < 0.3, name
        assert row["final_loss"] < row["first_loss"], name
    # Same weights, same rows: every backend and the Trainer see the same first loss (fp32).
    firsts = [row["first_loss"] for row in report["runs"].values()]
    assert max(firsts) - min(firsts) < 1e-4, firsts
    assert report["ratio_to_hf_trainer"]["fsdp"] == pytest.approx(
        report["runs"]["fsdp"]["tokens_per_s"] / report["runs"]["hf_trainer"]["tokens_per_s"], rel=1e-2
    )
    assert "| fsdp_fast |" in result.stderr
    # The runs use the train stage's options: fsdp_fast checkpoints every 2nd layer, the others every one.
    assert report["runs"]["fsdp_fast"]["options"]["gradient_checkpointing"] == 2
    # QLoRA's 4-bit base needs CUDA: on CPU the same adapter trains over the unquantized base.
    assert report["runs"]["qlora"]["options"]["adapter"]["quantize"] == "none"
    assert report["runs"]["qlora"]["options"]["sharding"] == "none"
    assert report["runs"]["fsdp"]["options"]["gradient_checkpointing"] is True
    # A run's own speed options win over the shared ones; a Trainer is compared at its own micro batch.
    assert report["runs"]["fsdp_fast_mb4_ac"]["options"]["gradient_checkpointing"] == 4
    assert report["runs"]["fsdp_fast_mb4_ac"]["options"]["micro_batch"] == 4 * settings["micro_batch"]
    assert report["ratio_to_hf_trainer"]["fsdp_fast_mb2"] == pytest.approx(
        report["runs"]["fsdp_fast_mb2"]["tokens_per_s"] / report["runs"]["hf_trainer_mb2"]["tokens_per_s"],
        rel=1e-2,
    )
    assert "fsdp_fast_mb4_ac" not in report["ratio_to_hf_trainer"]  # no Trainer at micro batch 4 here
    assert report["runs"]["deepspeed_zero3"]["options"]["zero_stage"] == 3
