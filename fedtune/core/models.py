"""Building, saving and loading models and tokenizers in the Hugging Face format.

Every stage loads weights through `load_model` (`load_causal_lm` for language models), which reads
safetensors only unless the config explicitly allows pickle checkpoints, and never runs remote code unless
the config says so. The task decides the model class: a causal LM (AutoModelForCausalLM) or a
sequence classifier (AutoModelForSequenceClassification: the same body with a classification head)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from fedtune.core.checksums import sha256_file
from fedtune.core.options import CAUSAL_LM, CLASSIFICATION, TASKS, UserError, torch_dtype

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# Written beside the weights by the stage that wrote them, checked by every stage that reads them.
CHECKSUMS = "fedtune-checksums.json"


def auto_class(task: str):
    """The transformers Auto class that builds and loads models of `task`."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if task not in TASKS:
        raise ModelError(f"task: {task!r} is not one of {TASKS}")
    return AutoModelForCausalLM if task == CAUSAL_LM else AutoModelForSequenceClassification


class ModelError(UserError):
    """A model folder that cannot be used: the message names the folder and what is wrong."""


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048, min_frequency: int = 2):
    """A byte-level BPE tokenizer trained on `texts`, wrapped as a transformers fast tokenizer.
    It adds no special tokens by itself: the tokenize stage places BOS and EOS explicitly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def build_model(
    architecture: dict,
    tokenizer,
    *,
    dtype: str = "float32",
    seed: int = 0,
    task: str = CAUSAL_LM,
    num_labels: int | None = None,
):
    """A freshly initialised model of `task` whose vocabulary and special tokens match `tokenizer`."""
    from transformers import AutoConfig

    settings = dict(architecture)
    model_type = settings.pop("model_type", "llama")
    if task == CLASSIFICATION:
        settings["num_labels"] = _num_labels(num_labels)
    try:
        config = AutoConfig.for_model(
            model_type,
            **settings,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    except ValueError as e:
        raise ModelError(f"model.architecture.model_type: {model_type!r}: {e}") from None
    torch.manual_seed(seed)
    model = auto_class(task).from_config(config)
    return model.to(torch_dtype(dtype))


def _num_labels(num_labels: int | None) -> int:
    if num_labels is None or num_labels < 2:
        raise ModelError(f"model.num_labels: {num_labels!r}; {CLASSIFICATION} needs 2 or more classes")
    return num_labels


def classification_head(model_dir_or_name, tokenizer, *, num_labels: int, seed: int, **load_kwargs):
    """A pretrained body (any checkpoint: a causal or masked LM, or a classifier) with a classification
    head of `num_labels` classes; a new head is initialised from `seed`, so every rank and every rerun
    starts from the same one. Models that pool the last non-padding token (Llama, GPT-2, OPT) need a
    padding id: the tokenizer's, else its EOS, as is usual for these models."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"{model_dir_or_name}: the tokenizer has neither a padding nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)
    model = auto_class(CLASSIFICATION).from_pretrained(
        model_dir_or_name, num_labels=_num_labels(num_labels), **load_kwargs
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def save_model(model, tokenizer, out_dir: str | Path, *, max_shard_size: str = "5GB") -> None:
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out_dir)
    record_checksums(out_dir)
    # save_pretrained writes weights with mode 0600; the rest of the group (aggregation on a login node,
    # a colleague's evaluation) must be able to read them.
    for path in out_dir.iterdir():
        path.chmod(0o644)


def record_checksums(model_dir: str | Path, digests: dict[str, str] | None = None) -> dict:
    """Write the size and sha256 of each weight file; `digests` saves hashing files the writer
    already hashed while writing them."""
    model_dir = Path(model_dir)
    digests = digests or {}
    record = {
        path.name: {"bytes": path.stat().st_size, "sha256": digests.get(path.name) or sha256_file(path)}
        for path in weight_files(model_dir)
    }
    (model_dir / CHECKSUMS).write_text(json.dumps(record, indent=2) + "\n")
    return record


def verify_checksums(model_dir: str | Path, digests: dict[str, str] | None = None) -> None:
    """Raise ModelError naming the first weight file whose size or sha256 differs from what its writer
    recorded. `digests` are sha256 the reader computed anyway; others are computed here. A folder
    without a record (a model from the hub) passes."""
    model_dir = Path(model_dir)
    record_path = model_dir / CHECKSUMS
    if not record_path.is_file():
        return
    digests = digests or {}
    for name, expected in json.loads(record_path.read_text()).items():
        path = model_dir / name
        if not path.is_file():
            raise ModelError(f"{path}: missing (listed in {record_path})")
        if path.stat().st_size != expected["bytes"]:
            raise ModelError(
                f"{path}: {path.stat().st_size} bytes, but {expected['bytes']} were written: truncated or "
                "corrupted; rerun the job that wrote it"
            )
        if (digests.get(name) or sha256_file(path)) != expected["sha256"]:
            raise ModelError(f"{path}: sha256 differs from the one recorded when it was written: corrupted")


def weight_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    return sorted(model_dir.glob("*.safetensors"))


def check_model_dir(model_dir: str | Path, *, allow_pickle: bool = False) -> Path:
    """Raise ModelError unless `model_dir` is a complete save_pretrained folder with loadable weights."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: model folder not found")
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir}: no config.json (not a save_pretrained folder)")
    if not weight_files(model_dir):
        pickles = sorted(p.name for p in model_dir.glob("*.bin"))
        if pickles and not allow_pickle:
            raise ModelError(
                f"{model_dir}: only pickle weights ({', '.join(pickles)}); fedtune loads safetensors. "
                "Convert them, or set model.allow_pickle: true if you trust their source"
            )
        if not pickles:
            raise ModelError(f"{model_dir}: no weights (*.safetensors)")
    if (model_dir / "model.safetensors.index.json").is_file():
        # transformers opens whatever files the index names: plain files of this folder only.
        from fedtune.core.safetensors_stream import read_index

        read_index(model_dir, f"the model {model_dir}")
    return model_dir


def model_task(model_dir: str | Path) -> str:
    """The task a saved model was built for, from the architectures its config.json names."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    return (
        CLASSIFICATION if any(a.endswith("ForSequenceClassification") for a in architectures) else CAUSAL_LM
    )


def check_loadable(model_dir: str | Path, *, task: str, allow_pickle: bool = False, verify: bool = True):
    """A saved model folder fit to load for `task`: weights present (safetensors unless pickle is
    allowed), made for this task, and (with `verify`) the weights' sizes and checksums as recorded."""
    check_model_dir(model_dir, allow_pickle=allow_pickle)
    saved = model_task(model_dir)
    if saved != task:
        raise ModelError(
            f"{model_dir}: a {saved} model (config.json architectures), but the task is {task}; "
            "the base model is made for the configured task by the download stage: rerun it"
        )
    if verify:
        verify_checksums(model_dir)


def load_model(
    model_dir: str | Path,
    *,
    task: str = CAUSAL_LM,
    dtype: str | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    revision: str | None = None,
    verify: bool = True,
):
    """A model of `task` from a save_pretrained folder or (download stage only) a hub id. `verify=False`
    skips hashing the weights, for a process whose folder another process (or an earlier load of its
    own) has already verified. A folder saved for the other task is refused: loading a classifier as
    a language model (or the reverse) would silently drop or invent a head."""
    if Path(model_dir).exists():
        check_loadable(model_dir, task=task, allow_pickle=allow_pickle, verify=verify)
    kwargs = {"dtype": torch_dtype(dtype)} if dtype else {}
    return auto_class(task).from_pretrained(
        model_dir,
        use_safetensors=not allow_pickle,
        trust_remote_code=trust_remote_code,
        revision=revision,
        **kwargs,
    )


def load_causal_lm(model_dir: str | Path, **kwargs):
    return load_model(model_dir, task=CAUSAL_LM, **kwargs)


def load_tokenizer(model_dir: str | Path, *, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code, revision=revision
        )
    except OSError as error:
        # A folder without a tokenizer, or a hub name with the network off: the user names another.
        raise ModelError(f"{model_dir}: no tokenizer could be loaded: {error}") from None
    if not tokenizer.is_fast:
        raise ModelError(f"{model_dir}: fedtune needs a fast (Rust) tokenizer; tokenizer.json is missing")
    return tokenizer


def gguf_model_config(path: str | Path) -> dict | None:
    """The config.json values a GGUF file's header gives (architecture sizes, vocabulary, tied
    embeddings), read without loading any tensor: what a dry run sizes a GGUF base model by. None where
    the file or the gguf package is missing."""
    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        return load_gguf_checkpoint(str(path))["config"]
    except (ImportError, OSError, ValueError):
        return None
