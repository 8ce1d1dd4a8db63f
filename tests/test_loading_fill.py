"""fedtune.train.loading.fill_from_rank0 on two gloo processes: FSDP2 shards of uneven size (rows not divisible
by the ranks), tensors broadcast over many chunks and rows larger than a chunk, filled from a bf16
checkpoint, equal the checkpoint's tensors cast to fp32 exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from tests.train_runs import free_port

# 101 rows in the embedding and head: 51 on rank 0, 50 on rank 1.
CONFIG = dict(
    vocab_size=101,
    hidden_size=24,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)


def _fill(rank: int, world: int, port: int, model_dir: str, out: str, chunk_bytes: int) -> None:
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from fedtune.train import loading

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        loading.FILL_CHUNK_BYTES = chunk_bytes
        model = loading.empty_model(model_dir, task="causal-lm", verify=False)
        buffers = {name: value.clone() for name, value in model.named_buffers()}
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        model.to_empty(device="cpu")
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.to_local().fill_(float("nan"))  # nothing may stay as it was
        loading.fill_from_rank0(model, model_dir, SimpleNamespace(rank=rank, device=torch.device("cpu")))
        shard = model.model.embed_tokens.weight.to_local()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, out)
            torch.save(shard.shape, out + ".shape")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk_bytes", [200, 16 << 20], ids=["rows-over-chunks", "default"])
def test_shards_equal_the_checkpoint(tmp_path, chunk_bytes):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    out = tmp_path / "filled.safetensors"
    # 200 bytes: two fp32 embedding rows (96 bytes each) per chunk; a down_proj row (288 bytes) is
    # more than a chunk and grows the buffer.
    mp.spawn(_fill, args=(2, free_port(), str(model_dir), str(out), chunk_bytes), nprocs=2, join=True)
    filled = load_file(out)
    expected = {k: v.float() for k, v in model.state_dict().items()}
    assert set(filled) == set(expected)
    for name, value in expected.items():
        assert torch.equal(filled[name], value), name
    assert list(torch.load(str(out) + ".shape")) == [51, 24]  # uneven shards: rank 0 holds 51 rows
