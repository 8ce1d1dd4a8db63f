"""Compressed exchange (federation.exchange): bytes per round per mode, and the merge's speed.

    .venv/bin/python benchmarks/exchange.py bytes [--demo-model results/demo/model/base]
    .venv/bin/python benchmarks/exchange.py speed [--layers 11] [--workdir /tmp/fedtune-exchange-bench]

bytes: what one site sends per round in each mode, from the model's tensor shapes times the bytes per
value of each part, scales and the update's header included (`fedtune.core.exchange.part_shapes`, the
same function the writer plans its file with), for the demo (its downloaded base model), SmolLM2-135M
and Llama-2-7B (their configs' shapes, a model built on the meta device: nothing is downloaded). A round
moves this once per site to the aggregating cluster, and the aggregate once per other cluster back, as
an update against the previous aggregate of the same shapes, so the same bytes ("round, up and down":
one remote site and one other cluster; full: the model in its dtype both ways).

speed: benchmarks/aggregate.py's two synthetic fp16 checkpoints (1.375 GB each) and a third as the
round's start; each site's update is compressed (int8, block 64; the site's side, timed), then, each
from a cold page cache: the I/O floor of the uncompressed merge (reading both sites, writing the
output with fsync), the uncompressed merge, and the merge of the two updates (reading the updates and
the start model, decoding each tensor inside the stream). Prints one JSON object."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(HERE))

MODES = {
    "bf16": {"dtype": "bf16"},
    "fp16": {"dtype": "fp16"},
    "int8 (row)": {"dtype": "int8", "scale": "row"},
    "int8 (block 64)": {"dtype": "int8"},
    "int4 (block 64)": {"dtype": "int4"},
}

# config.json of the hub models (huggingface.co/<name>/blob/main/config.json, read 2026-11-28): the
# sizes that decide the tensors' shapes.
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
LLAMA2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def shapes_of(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors save_pretrained writes for a config (tied weights once), from a meta-device model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(config)
    model_type = values.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    seen, shapes = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        shapes[name] = tuple(tensor.shape)
    return shapes


def mode_bytes(shapes: dict[str, tuple[int, ...]], model_dtype, options: dict) -> int:
    import torch

    from fedtune.core.exchange import Encoding, TensorEntry, UpdateHeader, encoding_for, part_shapes
    from fedtune.core.exchange_options import ExchangeOptions
    from fedtune.core.safetensors_stream import ST_NAMES

    exchange = ExchangeOptions(**options)
    entries, names, data = {}, {}, 0
    for name, shape in shapes.items():
        encoding: Encoding = encoding_for(exchange, model_dtype)
        entries[name] = TensorEntry(ST_NAMES[model_dtype], shape, encoding)
        for suffix, (dtype, numel) in part_shapes(encoding, shape, model_dtype).items():
            data += dtype.itemsize * numel
            names[name + suffix] = {"dtype": ST_NAMES[dtype], "shape": [numel], "data_offsets": [0, 0]}
    start = {"identity": "0" * 64, "files": {"model.safetensors": "0" * 64}}
    header = UpdateHeader(json.loads(exchange.to_json()), start, entries).to_json()
    # The safetensors header: the table of parts plus the metadata (offsets written out: ~30 bytes each).
    header_bytes = len(json.dumps(names)) + 30 * len(names) + len(header)
    del torch
    return data + header_bytes + 8


def bytes_table(demo_model: Path | None) -> dict:
    import torch

    from fedtune.core.safetensors_stream import ST_DTYPES, read_weights

    models = {}
    if demo_model is not None:
        folder = read_weights("demo", demo_model)
        shapes = {name: info.shape for name, info in folder.tensors.items()}
        dtype = ST_DTYPES[next(iter(folder.tensors.values())).dtype]
        models["demo (config/config.yaml)"] = (shapes, dtype)
    models["SmolLM2-135M (smollm2-it-cs, float32)"] = (shapes_of(SMOLLM2_135M), torch.float32)
    models["Llama-2-7B (llama2-it-cs, bfloat16)"] = (shapes_of(LLAMA2_7B), torch.bfloat16)
    table = {}
    for label, (shapes, dtype) in models.items():
        params = sum(torch.Size(s).numel() for s in shapes.values())
        full = params * dtype.itemsize
        bf16 = params * 2
        row = {"parameters": params, "full model": full}
        for mode, options in MODES.items():
            row[mode] = mode_bytes(shapes, dtype, options)
        row["ratios to bf16"] = {mode: round(row[mode] / bf16, 4) for mode in MODES}
        # The aggregate's update has the model's shapes and encodings: a site's size, back the other way.
        row["round, up and down"] = {"full model": 2 * full, **{mode: 2 * row[mode] for mode in MODES}}
        table[label] = row
    return table


def speed(layers: int, workdir: Path) -> dict:
    import aggregate as bench

    from fedtune.core.exchange_options import ExchangeOptions
    from fedtune.core.models import record_checksums
    from fedtune.core.updates import CompressJob, compress

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    shard = 10**9
    sites = [workdir / f"site-{i}" for i in range(2)]
    start = workdir / "start"
    for i, folder in enumerate([*sites, start]):
        bench.make_checkpoint(folder, layers, i, shard)
        record_checksums(folder)
    updates, compress_s = [], []
    for i, site in enumerate(sites):
        out = workdir / f"update-{i}"
        files = [*site.glob("*.safetensors"), *start.glob("*.safetensors")]
        bench.drop_cache(files)
        started = time.perf_counter()
        compress(CompressJob(site, start, out), ExchangeOptions(dtype="int8"))
        compress_s.append(round(time.perf_counter() - started, 2))
        updates.append(out)
    out_bytes = sum(p.stat().st_size for p in sites[0].glob("*.safetensors"))
    inputs = [p for s in sites for p in s.glob("*.safetensors")]
    python = sys.executable
    results = {"compress_s": compress_s}
    results["update_bytes"] = [sum(p.stat().st_size for p in u.glob("*.safetensors")) for u in updates]
    results["site_bytes"] = out_bytes
    bench.drop_cache(inputs)
    results["floor"] = bench.floor(inputs, out_bytes, workdir / "floor.bin")
    options = bench.options_json("1GB")
    merge = [python, "-m", "fedtune.aggregate", "--options", options]
    bench.drop_cache(inputs)
    results["merge"] = bench.run_measured(
        [*merge, "--out", str(workdir / "out-full"), "--model", *(f"s{i}={s}" for i, s in enumerate(sites))],
        workdir / "full.log",
    )
    compressed_inputs = [*(p for u in updates for p in u.glob("*.safetensors")), *start.glob("*.safetensors")]
    bench.drop_cache(compressed_inputs)
    results["floor_compressed_inputs"] = bench.floor(compressed_inputs, out_bytes, workdir / "floor.bin")
    bench.drop_cache(compressed_inputs)
    results["merge_int8"] = bench.run_measured(
        [
            *merge,
            "--out",
            str(workdir / "out-int8"),
            "--start",
            str(start),
            "--model",
            *(f"s{i}={u}" for i, u in enumerate(updates)),
        ],
        workdir / "int8.log",
    )
    shutil.rmtree(workdir)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sizes = commands.add_parser("bytes")
    sizes.add_argument("--demo-model", type=Path, default=None, help="the demo's model/base folder")
    timing = commands.add_parser("speed")
    timing.add_argument("--layers", type=int, default=11)
    timing.add_argument("--workdir", type=Path, default=Path("/tmp/fedtune-exchange-bench"))
    args = parser.parse_args()
    if args.command == "bytes":
        result = bytes_table(args.demo_model)
    else:
        result = speed(args.layers, args.workdir)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
