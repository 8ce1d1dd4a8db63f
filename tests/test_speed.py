"""fedtune.train.speed: the wrapping logic of each GPU speed option, on CPU (compilation itself is not run)."""

from __future__ import annotations

import pytest
import torch

from fedtune.train import speed
from tests.conftest import TINY_ARCHITECTURE


def tiny_model(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    architecture = {k: v for k, v in TINY_ARCHITECTURE.items() if k != "model_type"}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**architecture, "num_hidden_layers": layers}, vocab_size=128))


def test_compile_layers_compiles_each_decoder_layer_in_place():
    model = tiny_model()
    names = list(model.state_dict())
    assert speed.compiled_layers(model) == 0
    assert speed.compile_layers(model, dynamic=False) == 4
    assert speed.compiled_layers(model) == 4
    # Only the layers, and no parameter renamed (a torch.compile wrapper would add `_orig_mod.`).
    assert getattr(model, "_compiled_call_impl", None) is None
    assert getattr(model.model.embed_tokens, "_compiled_call_impl", None) is None
    assert list(model.state_dict()) == names


@pytest.mark.parametrize("transformers_api", ["every_n_layers", "per_layer_switch"])
def test_selective_checkpointing_recomputes_every_nth_layer_with_equal_gradients(
    monkeypatch, transformers_api
):
    from transformers import PreTrainedModel
    from transformers.models.llama import modeling_llama

    if transformers_api == "per_layer_switch":
        # transformers 5.17 (the GPU image of issue 41) has no activation_checkpointing_enable.
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")

    ids = torch.randint(128, (2, 16), generator=torch.Generator().manual_seed(1))
    # Module hooks do not fire in the recomputation: count calls of the MLP's forward itself.
    calls = []
    forward = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(
        modeling_llama.LlamaMLP, "forward", lambda self, x: calls.append(self) or forward(self, x)
    )

    def gradients(every):
        model = tiny_model()
        model.train()
        chosen = speed.selective_checkpointing(model, every=every) if every else []
        index = {id(layer.mlp): i for i, layer in enumerate(speed.decoder_layers(model))}
        calls.clear()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        recomputed = [index[id(mlp)] for mlp in calls]
        return chosen, recomputed, {n: p.grad.clone() for n, p in model.named_parameters()}

    _, plain_calls, plain = gradients(0)
    chosen, calls, grads = gradients(2)
    assert chosen == [0, 2]
    # A checkpointed layer runs its forward twice (once more in backward), the others once.
    assert sorted(calls) == sorted(plain_calls + [0, 2])
    assert speed.selective_checkpointing(tiny_model(), every=1) == [0, 1, 2, 3]
    for name, grad in plain.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_selective_checkpointing_refuses_zero():
    with pytest.raises(ValueError, match="every=0"):
        speed.selective_checkpointing(tiny_model(), every=0)


def test_adamw_fused_only_on_cuda():
    assert speed.adamw_implementation(torch.device("cuda", 0)) == {"fused": True}
    assert speed.adamw_implementation(torch.device("cpu")) == {"foreach": True}
    model = tiny_model(1)
    torch.optim.AdamW(model.parameters(), **speed.adamw_implementation(torch.device("cpu")))


def test_pin_batch_leaves_cpu_batches_alone():
    ids = torch.arange(6).reshape(2, 3)
    out_ids, out_none = speed.pin_batch(torch.device("cpu"), ids, None)
    assert out_ids is ids and out_none is None
