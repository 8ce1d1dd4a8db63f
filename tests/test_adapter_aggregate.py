"""fedtune.aggregate.adapters against peft itself: sites train tiny LoRA adapters (random B, since peft
starts B at zero), and the aggregate, loaded with PeftModel.from_pretrained and merged, must give the
weighted mean of the sites' updates (exact) or mean(B) mean(A) (average_factors); the merged full model
must load with transformers and hold base + that update. Also fedtune.aggregate.adapter_size's byte counts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import TINY_ARCHITECTURE

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from fedtune.aggregate.adapter_size import adapter_bytes, model_bytes, transfer_bytes  # noqa: E402
from fedtune.aggregate.adapters import (  # noqa: E402
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterAggregateError,
    AdapterAggregateJob,
    aggregate_adapters,
    main,
)
from fedtune.aggregate.options import AggregateOptions  # noqa: E402
from fedtune.core.options import ConfigError  # noqa: E402


def opts(sites=None, weights=None, **section) -> AggregateOptions:
    """The aggregate section aggregate_adapters reads: plain FedAvg (sgd at lr 1) and uniform weights
    unless given; `weights` as a list is one per adapter in `sites`' order (a list of folders names each
    site by its folder)."""
    if isinstance(weights, list):
        weights = {str(site): weight for site, weight in zip(sites, weights, strict=True)}
    section = {"server_optimizer": {"name": "sgd"}, "weights": weights or "uniform", **section}
    return AggregateOptions.from_mapping(section)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def llama_config(**extra) -> LlamaConfig:
    # Fewer key-value heads than heads, so that k/v_proj differ in shape from q/o_proj.
    return LlamaConfig(**{**TINY_ARCHITECTURE, "num_key_value_heads": 2, "vocab_size": 128, **extra})


def save_base(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_base(LlamaForCausalLM(llama_config()), tmp_path_factory.mktemp("llama") / "base")


def train_adapter(base_cls, base: Path, out: Path, seed: int, **lora) -> Path:
    """A site's adapter: peft's LoRA on the base with random factors (B too), saved by peft."""
    model = base_cls.from_pretrained(base)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(out)
    return out


def site_updates(folder: Path) -> dict[str, torch.Tensor]:
    """Base weight name -> s B A of one saved adapter, in fp32, as (out x in)."""
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    updates = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace("lora_A", "lora_B")]
            r = a.shape[0]
            s = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
            updates[f"{module}.weight"] = s * b.double() @ a.double()
    return updates


def expected_mean(folders, weights) -> dict[str, torch.Tensor]:
    total = sum(weights)
    updates = [site_updates(f) for f in folders]
    return {
        name: sum(w / total * u[name] for w, u in zip(weights, updates, strict=True)) for name in updates[0]
    }


def peft_merged(base_cls, base: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """What peft makes of an adapter folder: loaded on the base and merged into it."""
    model = peft.PeftModel.from_pretrained(base_cls.from_pretrained(base), adapter)
    return {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def base_state(base_cls, base: Path) -> dict[str, torch.Tensor]:
    return base_cls.from_pretrained(base).state_dict()


# ---------------------------------------------------------------------------------------------------
# exact


def test_exact_is_the_mean_of_the_updates_for_sites_of_different_ranks(llama_base, tmp_path):
    sites = [
        train_adapter(
            LlamaForCausalLM, llama_base, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=ATTENTION
        ),
        train_adapter(
            LlamaForCausalLM, llama_base, tmp_path / "b", 2, r=8, lora_alpha=32, target_modules=ATTENTION
        ),
        train_adapter(
            LlamaForCausalLM,
            llama_base,
            tmp_path / "c",
            3,
            r=2,
            lora_alpha=4,
            use_rslora=True,
            target_modules=ATTENTION,
        ),
    ]
    weights = [1.0, 3.0, 2.0]
    out = tmp_path / "aggregate"
    options = json.dumps(
        {"adapter_merge": "exact", "weights": {s.name: w for s, w in zip(sites, weights, strict=True)}}
    )
    argv = ["--adapters", *(f"{s.name}={s}" for s in sites), "--options", options]
    assert main([*argv, "--out", str(out), "--merge-into", str(llama_base)]) == 0

    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (14, 14, False)
    record = json.loads((out / "aggregate.json").read_text())
    assert record["mode"] == "exact" and [i["r"] for i in record["inputs"]] == [[4], [8], [2]]
    assert record["weights"]["normalised"] == {"a": 1 / 6, "b": 3 / 6, "c": 2 / 6}
    assert record["bytes_written"] == record["output"]["bytes"] + record["merged"]["bytes"]

    want = expected_mean(sites, weights)
    base = base_state(LlamaForCausalLM, llama_base)
    loaded = peft_merged(LlamaForCausalLM, llama_base, out)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").state_dict()
    assert len(want) == 2 * len(ATTENTION)
    for name, tensor in base.items():
        if name in want:
            assert rel_error(loaded[name] - base[name], want[name]) < 1e-6, name
            assert rel_error(merged[name] - base[name], want[name]) < 1e-6, name
        else:
            assert torch.equal(loaded[name], tensor) and torch.equal(merged[name], tensor), name
    assert (out / "merged" / "fedtune-checksums.json").is_file()


def test_exact_follows_rank_and_alpha_patterns_and_pads_the_smaller_sums(llama_base, tmp_path):
    targets = ["q_proj", "v_proj"]
    patterned = {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {r"layers\.1\.self_attn\.q_proj": 2}}
    sites = [
        train_adapter(
            LlamaForCausalLM, llama_base, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=targets
        ),
        train_adapter(
            LlamaForCausalLM,
            llama_base,
            tmp_path / "b",
            2,
            r=4,
            lora_alpha=16,
            target_modules=targets,
            **patterned,
        ),
    ]
    record = aggregate_adapters(AdapterAggregateJob(sites, tmp_path / "out"), opts(sites, [1, 1]))
    # q_proj sums to rank 8, v_proj to 6: v_proj is padded with zeros up to the adapter's r.
    assert (record["output"]["r"], record["output"]["padded_modules"]) == (8, 2)
    base = base_state(LlamaForCausalLM, llama_base)
    loaded = peft_merged(LlamaForCausalLM, llama_base, tmp_path / "out")
    # site_updates reads neither pattern, so the expectation is built from peft's own merge of each site.
    merged_sites = [peft_merged(LlamaForCausalLM, llama_base, s) for s in sites]
    for name in (f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in targets):
        site_deltas = [merged[name] - base[name] for merged in merged_sites]
        assert rel_error(loaded[name] - base[name], (site_deltas[0] + site_deltas[1]) / 2) < 1e-6, name


# ---------------------------------------------------------------------------------------------------
# average_factors


def test_average_factors_is_mean_b_times_mean_a_and_not_the_mean_of_updates(llama_base, tmp_path):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    sites = [train_adapter(LlamaForCausalLM, llama_base, tmp_path / s, k, **lora) for k, s in enumerate("ab")]
    weights = [1.0, 3.0]
    out = aggregate_adapters(
        AdapterAggregateJob(sites, tmp_path / "avg"), opts(sites, weights, adapter_merge="average_factors")
    )["output"]
    config = json.loads((tmp_path / "avg" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], out["r"]) == (4, 8, 4)

    tensors = [load_file(s / ADAPTER_WEIGHTS) for s in sites]
    base = base_state(LlamaForCausalLM, llama_base)
    loaded = peft_merged(LlamaForCausalLM, llama_base, tmp_path / "avg")
    exact = expected_mean(sites, weights)
    for name, want_exact in exact.items():
        a_key = "base_model.model." + name.removesuffix(".weight") + ".lora_A.weight"
        b_key = a_key.replace("lora_A", "lora_B")
        mean_a = sum(w / 4 * t[a_key].double() for w, t in zip(weights, tensors, strict=True))
        mean_b = sum(w / 4 * t[b_key].double() for w, t in zip(weights, tensors, strict=True))
        by_hand = 8 / 4 * mean_b @ mean_a
        delta = loaded[name] - base[name]
        assert rel_error(delta, by_hand) < 1e-6, name
        # The cross terms B_1 A_2 and B_2 A_1 of independent sites are as large as the updates themselves.
        assert rel_error(delta, want_exact) > 0.3, name


# ---------------------------------------------------------------------------------------------------
# modules_to_save, GPT-2


def test_modules_to_save_are_averaged_in_the_adapter_and_replace_the_base_head(tmp_path):
    torch.manual_seed(0)
    config = llama_config(num_labels=3, pad_token_id=0)
    base = save_base(LlamaForSequenceClassification(config), tmp_path / "base")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "task_type": "SEQ_CLS"}
    sites = [
        train_adapter(LlamaForSequenceClassification, base, tmp_path / s, k, **lora)
        for k, s in enumerate("ab")
    ]
    weights = [1.0, 4.0]
    for mode in ("exact", "average_factors"):
        out = tmp_path / mode
        aggregate_adapters(
            AdapterAggregateJob(sites, out, merge_into=base), opts(sites, weights, adapter_merge=mode)
        )
        heads = [load_file(s / ADAPTER_WEIGHTS)["base_model.model.score.weight"] for s in sites]
        mean = 0.2 * heads[0] + 0.8 * heads[1]
        assert torch.allclose(
            load_file(out / ADAPTER_WEIGHTS)["base_model.model.score.weight"], mean, atol=1e-7
        )
        loaded = peft_merged(LlamaForSequenceClassification, base, out)
        merged = AutoModelForSequenceClassification.from_pretrained(out / "merged").state_dict()
        assert torch.allclose(loaded["score.weight"], mean, atol=1e-7)
        assert torch.allclose(merged["score.weight"], mean, atol=1e-7)
        name = "model.layers.1.self_attn.q_proj.weight"
        assert rel_error(merged[name], loaded[name]) < 1e-6


def test_gpt2_fan_in_fan_out_layers_merge_transposed(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    base = save_base(GPT2LMHeadModel(config), tmp_path / "base")
    sites = [
        train_adapter(
            GPT2LMHeadModel,
            base,
            tmp_path / "a",
            1,
            r=2,
            target_modules=["c_attn", "c_fc"],
            fan_in_fan_out=True,
        ),
        train_adapter(
            GPT2LMHeadModel,
            base,
            tmp_path / "b",
            2,
            r=6,
            target_modules=["c_attn", "c_fc"],
            fan_in_fan_out=True,
        ),
    ]
    # A small shard size makes the merged model a sharded one, with an index, as large models are.
    options = opts(sites, [2, 1], max_shard_size="40000B")
    record = aggregate_adapters(AdapterAggregateJob(sites, tmp_path / "out", merge_into=base), options)
    assert record["merged"]["adapted_tensors"] == 4 and len(record["merged"]["files"]) > 1
    assert (tmp_path / "out" / "merged" / "model.safetensors.index.json").is_file()
    want = expected_mean(sites, [2, 1])
    before = base_state(GPT2LMHeadModel, base)
    loaded = peft_merged(GPT2LMHeadModel, base, tmp_path / "out")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged").state_dict()
    for name, update in want.items():
        # Conv1D stores (in, out): the update B A (out x in) lands transposed.
        assert before[name].shape == update.T.shape
        assert rel_error(loaded[name] - before[name], update.T) < 1e-6, name
        assert rel_error(merged[name] - before[name], update.T) < 1e-6, name


# ---------------------------------------------------------------------------------------------------
# Errors: named before any output exists


@pytest.fixture(scope="module")
def two_ranks(llama_base, tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("two-ranks")
    return (
        train_adapter(
            LlamaForCausalLM, llama_base, folder / "r4", 1, r=4, lora_alpha=8, target_modules=["q_proj"]
        ),
        train_adapter(
            LlamaForCausalLM, llama_base, folder / "r8", 2, r=8, lora_alpha=8, target_modules=["q_proj"]
        ),
    )


def test_average_factors_refuses_unequal_ranks_naming_folders_and_ranks(two_ranks, tmp_path):
    with pytest.raises(AdapterAggregateError) as error:
        aggregate_adapters(
            AdapterAggregateJob(two_ranks, tmp_path / "out"), opts(adapter_merge="average_factors")
        )
    message = str(error.value)
    assert (
        "r=4" in message
        and "r=8" in message
        and str(two_ranks[0]) in message
        and str(two_ranks[1]) in message
    )
    assert "--mode exact" in message
    assert not (tmp_path / "out").exists()


def test_mismatched_target_modules_are_refused(llama_base, two_ranks, tmp_path):
    other = train_adapter(
        LlamaForCausalLM, llama_base, tmp_path / "v", 3, r=4, lora_alpha=8, target_modules=["v_proj"]
    )
    for mode in ("exact", "average_factors"):
        with pytest.raises(AdapterAggregateError, match="target modules differ.*v_proj"):
            aggregate_adapters(
                AdapterAggregateJob([two_ranks[0], other], tmp_path / "out"), opts(adapter_merge=mode)
            )
    assert not (tmp_path / "out").exists()


def test_weights_must_match_the_adapters(two_ranks, tmp_path):
    three = {**opts(two_ranks, [1, 2]).weights, "elsewhere": 3}
    with pytest.raises(AdapterAggregateError, match=r"must name every site once; unknown: \['elsewhere'\]"):
        aggregate_adapters(AdapterAggregateJob(two_ranks, tmp_path / "out"), opts(weights=three))
    with pytest.raises(ConfigError, match=r"aggregate.weights.*: -2 is less than the minimum of 0"):
        opts(two_ranks, [1, -2])
    with pytest.raises(AdapterAggregateError, match="sum to zero"):
        aggregate_adapters(AdapterAggregateJob(two_ranks, tmp_path / "out"), opts(two_ranks, [0, 0]))


def test_missing_files_and_cli_exit_code(two_ranks, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ADAPTER_CONFIG).write_text((two_ranks[0] / ADAPTER_CONFIG).read_text())
    code = main(
        ["--adapters", str(two_ranks[0]), str(broken), "--out", str(tmp_path / "out"), "--options", "{}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"adapter {broken}: {ADAPTER_WEIGHTS} missing" in err
    assert (
        main(
            [
                "--adapters",
                str(two_ranks[0]),
                str(tmp_path / "nowhere"),
                "--out",
                str(tmp_path / "o"),
                "--options",
                "{}",
            ]
        )
        == 2
    )
    assert "folder not found" in capsys.readouterr().err
    with pytest.raises(AdapterAggregateError, match="--merge-into .*model folder not found"):
        aggregate_adapters(
            AdapterAggregateJob(two_ranks, tmp_path / "out", merge_into=tmp_path / "nowhere"), opts()
        )
    (broken / ADAPTER_WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(AdapterAggregateError, match=f"{broken / ADAPTER_WEIGHTS}: not a safetensors file"):
        aggregate_adapters(AdapterAggregateJob([two_ranks[0], broken], tmp_path / "out"), opts())
    with pytest.raises(AdapterAggregateError, match="same adapter folder"):
        aggregate_adapters(AdapterAggregateJob([two_ranks[0], two_ranks[0]], tmp_path / "out"), opts())
    assert not (tmp_path / "out").exists()


def test_config_that_contradicts_the_weights_and_dora_are_refused(two_ranks, tmp_path):
    import shutil

    for change, pattern in (
        ({"r": 16}, "rank 4 .* r = 16"),
        ({"use_dora": True}, "use_dora = True is not supported"),
    ):
        site = tmp_path / "edited"
        shutil.copytree(two_ranks[0], site, dirs_exist_ok=True)
        config = json.loads((site / ADAPTER_CONFIG).read_text())
        (site / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
        with pytest.raises(AdapterAggregateError, match=pattern):
            aggregate_adapters(AdapterAggregateJob([site, two_ranks[1]], tmp_path / "out"), opts())


def test_adapters_that_do_not_fit_the_base_are_refused_before_writing(two_ranks, tmp_path):
    torch.manual_seed(0)
    wider = save_base(
        LlamaForCausalLM(llama_config(hidden_size=32, intermediate_size=64)), tmp_path / "wider"
    )
    with pytest.raises(
        AdapterAggregateError, match=r"(?s)do not fit the base model.*q_proj.weight: \[32, 32\] in the base"
    ):
        aggregate_adapters(AdapterAggregateJob(two_ranks, tmp_path / "out", merge_into=wider), opts())
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------
# Bytes moved

LLAMA_2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def test_transfer_bytes_of_llama_2_7b():
    sizes = transfer_bytes(LLAMA_2_7B, {"r": 16, "target_modules": ATTENTION}, adapter_dtype="bfloat16")
    # Four (4096 x 4096) projections a layer, each r (in + out) numbers of 2 bytes.
    assert sizes["adapter_bytes"] == 4 * 32 * 16 * (4096 + 4096) * 2 == 33_554_432
    assert sizes["parameters"] == 6_738_415_616  # Llama-2-7B's published count
    assert sizes["model_bytes"] == 2 * 6_738_415_616
    assert sizes["ratio"] < 0.01 and round(100 * sizes["ratio"], 2) == 0.25
    # peft keeps adapters in fp32 by default: twice the bytes.
    assert adapter_bytes(LLAMA_2_7B, 16, ATTENTION) == 2 * 33_554_432
    # Grouped-query attention: k/v_proj shrink with the key-value heads.
    gqa = {**LLAMA_2_7B, "num_key_value_heads": 8}
    assert adapter_bytes(gqa, 16, ["k_proj"], "bfloat16") == 32 * 16 * (4096 + 1024) * 2
    assert model_bytes(LLAMA_2_7B, "float32") == 4 * 6_738_415_616
    # No target_modules: peft's default for Llama, q_proj and v_proj.
    assert transfer_bytes(LLAMA_2_7B, {"r": 16})["adapter_bytes"] == 2 * 32 * 16 * 8192 * 4


def test_transfer_bytes_counts_what_tiny_peft_adapters_hold(two_ranks, llama_base):
    config = json.loads((llama_base / "config.json").read_text())
    adapter = json.loads((two_ranks[1] / ADAPTER_CONFIG).read_text())
    tensors = load_file(two_ranks[1] / ADAPTER_WEIGHTS)
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert transfer_bytes(config, adapter)["adapter_bytes"] == stored
    model = LlamaForCausalLM(llama_config())
    assert transfer_bytes(config, adapter)["parameters"] == sum(p.numel() for p in model.parameters())


def test_output_dtype_and_record(two_ranks, tmp_path):
    sites = {"north": two_ranks[0], "south": two_ranks[1]}
    record = aggregate_adapters(
        AdapterAggregateJob(sites, tmp_path / "out"), opts(sites, [3, 1], dtype="bfloat16")
    )
    tensors = load_file(tmp_path / "out" / ADAPTER_WEIGHTS)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (12, 64)
    assert record["weights"] == {
        "source": "explicit",
        "raw": {"north": 3.0, "south": 1.0},
        "normalised": {"north": 0.75, "south": 0.25},
    }
    assert [i["site"] for i in record["inputs"]] == ["north", "south"]
    assert record["bytes_read"] == sum(i["bytes"] for i in record["inputs"])
    assert record["merged"] is None and record["output"]["r"] == 12
    assert json.loads((tmp_path / "out" / "fedtune-checksums.json").read_text())[ADAPTER_WEIGHTS]["sha256"]


# The workflow's two calls: the aggregating cluster combines the sites' adapters (weights by the tokens
# their manifests record), and every cluster merges that adapter into the round's start model itself.


def manifest(path: Path, site: str, tokens: int) -> str:
    path.write_text(json.dumps({"site": site, "splits": {"train": {"tokens_kept": tokens}}}))
    return f"{site}={path}"


def test_cli_weights_by_tokens_and_merge_gives_what_merge_into_gives(two_ranks, llama_base, tmp_path):
    import shutil

    from fedtune.core.checksums import sha256_file
    from fedtune.core.models import record_checksums

    low, high = two_ranks
    # A base as fedtune writes one, with its checksum record: the merge verifies the bytes it reads.
    llama_base = Path(shutil.copytree(llama_base, tmp_path / "base"))
    record_checksums(llama_base, {"model.safetensors": sha256_file(llama_base / "model.safetensors")})
    manifests = [manifest(tmp_path / "a.json", "a", 1000), manifest(tmp_path / "b.json", "b", 3000)]
    out = tmp_path / "aggregate"
    code = main(["--adapters", f"a={low}", f"b={high}", "--options", '{"weights": "tokens"}', "--manifest",
                 *manifests, "--out", str(out), "--merge-into", str(llama_base)])  # fmt: skip
    assert code == 0
    record = json.loads((out / "aggregate.json").read_text())
    assert record["weights"]["normalised"] == {"a": 0.25, "b": 0.75}
    expected = expected_mean([low, high], [0.25, 0.75])

    merged = tmp_path / "merged"
    assert (
        main(["--merge", str(out), "--base", str(llama_base), "--out", str(merged), "--options", "{}"]) == 0
    )
    got = load_file(merged / "model.safetensors")
    # Bit for bit what the aggregating run merged: every cluster starts the next round from the same weights.
    reference = load_file(out / "merged" / "model.safetensors")
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in got)
    base = base_state(LlamaForCausalLM, llama_base)
    for name, update in expected.items():
        assert rel_error(got[name] - base[name], update) < 1e-6, name
    assert AutoModelForCausalLM.from_pretrained(merged) is not None


def test_cli_refuses_tokens_without_manifests_and_merge_without_base(two_ranks, tmp_path, capsys):
    low, high = two_ranks
    tokens = '{"weights": "tokens"}'
    code = main(["--adapters", f"a={low}", f"b={high}", "--options", tokens, "--out", str(tmp_path / "o")])
    assert code == 2 and "weights tokens needs --manifest SITE=PATH for every site" in capsys.readouterr().err
    assert main(["--merge", str(low), "--out", str(tmp_path / "m"), "--options", "{}"]) == 2
    assert "--merge needs --base" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "m").exists()


# ---------------------------------------------------------------------------------------------------
# server optimizers on the merged low-rank update


@pytest.mark.parametrize(
    "server",
    [
        {"name": "sgd", "lr": 1.7},
        {"name": "fedavgm", "lr": 1.3, "momentum": 0.6},
        {"name": "nesterov", "lr": 0.7, "momentum": 0.9},
    ],
)
def test_server_optimizer_over_adapters_is_exactly_its_rule_on_the_dense_updates(
    server, llama_base, tmp_path
):
    """Two rounds: the merged model of each round is base + the optimizer's update computed by hand on
    the dense mean updates (fedavgm: m1 = D1, m2 = momentum m1 + D2; update lr m; nesterov: the same m,
    update lr (D + momentum m), DiLoCo's outer step), and the momentum's rank grows by the round's rank."""
    weights = [1.0, 3.0]
    options = json.dumps(
        {"adapter_merge": "exact", "weights": {"a": 1.0, "b": 3.0}, "server_optimizer": server}
    )
    momentum = None
    state_in = []
    for round_ in (1, 2):
        sites = [
            train_adapter(
                LlamaForCausalLM,
                llama_base,
                tmp_path / f"r{round_}" / name,
                seed + 10 * round_,
                r=r,
                lora_alpha=2 * r,
                target_modules=ATTENTION,
            )  # fmt: skip
            for name, seed, r in (("a", 1, 4), ("b", 2, 2))
        ]
        out, state = tmp_path / f"aggregate-{round_}", tmp_path / f"state-{round_}"
        argv = ["--adapters", *(f"{s.name}={s}" for s in sites), "--options", options]
        assert main([*argv, *state_in, "--server-state-out", str(state), "--out", str(out),
                     "--merge-into", str(llama_base)]) == 0  # fmt: skip
        state_in = ["--server-state-in", str(state)]
        mean = expected_mean(sites, weights)
        if server["name"] == "sgd":
            want = {n: server["lr"] * d for n, d in mean.items()}
        else:
            momentum = (
                mean
                if momentum is None
                else {n: server["momentum"] * momentum[n] + d for n, d in mean.items()}
            )
            if server["name"] == "nesterov":
                want = {n: server["lr"] * (d + server["momentum"] * momentum[n]) for n, d in mean.items()}
            else:
                want = {n: server["lr"] * m for n, m in momentum.items()}
        base = base_state(LlamaForCausalLM, llama_base)
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").state_dict()
        loaded = peft_merged(LlamaForCausalLM, llama_base, out)
        for name, update in want.items():
            assert rel_error(merged[name] - base[name], update) < 1e-6, (round_, name)
            assert rel_error(loaded[name] - base[name], update) < 1e-6, (round_, name)
        record = json.loads((state / "state.json").read_text())
        assert record["optimizer"]["name"] == server["name"]
        if server["name"] != "sgd":
            assert record["rank"] == 6 * round_  # the sites' ranks 4 + 2, stacked once per round
        else:
            assert record["rank"] is None and not (state / "momentum.safetensors").exists()


def test_adapter_server_state_of_another_optimizer_or_adaptive_optimizers_are_refused(
    two_ranks, tmp_path, capsys
):
    sgd = json.dumps({"weights": "uniform", "server_optimizer": {"name": "sgd", "lr": 2.0}})
    argv = ["--adapters", *(f"{s.name}={s}" for s in two_ranks)]
    assert (
        main(
            [
                *argv,
                "--options",
                sgd,
                "--out",
                str(tmp_path / "a1"),
                "--server-state-out",
                str(tmp_path / "s1"),
            ]
        )
        == 0
    )
    fedavgm = json.dumps({"adapter_merge": "exact", "server_optimizer": {"name": "fedavgm"}})
    with pytest.raises(AdapterAggregateError, match="written by server optimizer 'sgd', not 'fedavgm'"):
        aggregate_adapters(
            AdapterAggregateJob(two_ranks, tmp_path / "a2", server_state_in=tmp_path / "s1"),
            AggregateOptions.from_json(fedavgm),
        )
    adam = opts(server_optimizer={"name": "fedadam"})
    with pytest.raises(
        AdapterAggregateError, match="fedadam keeps per-coordinate state that is not low-rank"
    ):
        aggregate_adapters(AdapterAggregateJob(two_ranks, tmp_path / "a3"), adam)
    assert not (tmp_path / "a2").exists() and not (tmp_path / "a3").exists()


def test_fedavgm_steps_the_tensors_adapters_train_whole_from_the_start_model(tmp_path):
    """modules_to_save under fedavgm: the head is start + lr m, m = momentum m_prev + (mean - start),
    over two rounds; without --start it is refused."""
    torch.manual_seed(0)
    config = llama_config(num_labels=3, pad_token_id=0)
    base = save_base(LlamaForSequenceClassification(config), tmp_path / "base")
    start = load_file(base / "model.safetensors")["score.weight"].float()
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "task_type": "SEQ_CLS"}
    server = {"name": "fedavgm", "lr": 1.5}
    momentum, state_in = None, None
    for round_ in (1, 2):
        sites = [
            train_adapter(
                LlamaForSequenceClassification, base, tmp_path / f"r{round_}{s}", k + 5 * round_, **lora
            )
            for k, s in enumerate("ab")
        ]
        if round_ == 1:
            with pytest.raises(AdapterAggregateError, match="--start is needed"):
                aggregate_adapters(
                    AdapterAggregateJob(
                        sites, tmp_path / "refused", server_state_out=tmp_path / "refused-state"
                    ),
                    opts(server_optimizer=server),
                )
            assert not (tmp_path / "refused").exists() and not (tmp_path / "refused-state").exists()
        out, state = tmp_path / f"out{round_}", tmp_path / f"state{round_}"
        aggregate_adapters(
            AdapterAggregateJob(
                sites, out, merge_into=base, server_state_in=state_in, server_state_out=state, start=base
            ),
            opts(sites, [1.0, 4.0], server_optimizer=server),
        )
        state_in = state
        heads = [load_file(s / ADAPTER_WEIGHTS)["base_model.model.score.weight"] for s in sites]
        delta = 0.2 * heads[0] + 0.8 * heads[1] - start
        momentum = delta if momentum is None else 0.5 * momentum + delta
        merged = AutoModelForSequenceClassification.from_pretrained(out / "merged").state_dict()
        assert torch.allclose(merged["score.weight"], start + 1.5 * momentum, atol=1e-6), round_
