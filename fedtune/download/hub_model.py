"""A hub model (`model.source: hf`) fetched as files, never loaded: the download stage runs on login nodes,
where loading a 7B model whole (14-28 GB, minutes of CPU) is forbidden or killed (ULHPC's access-node
rules; Leonardo stops a login process after 10 minutes of CPU time, and its lrd_all_serial jobs get
30,800 MB).

`huggingface_hub.snapshot_download` puts the safetensors, config and tokenizer files of the pinned
revision into the hub cache (HF_HOME, on scratch: scripts/clusters/_common.sh), and they are linked (or
copied, file by file) into the base-model folder. They are checked without loading a weight: the
config parses and names a causal LM, every safetensors header parses, the index and the shards agree,
and each file is as long as its header says (a truncated download is refused by name); the tokenizer
loads (it is small). The weights keep the checkpoint's dtype: training loads them in float32 and the
evaluations in model.dtype (fedtune.train.loading, fedtune.evaluate.scores), so the conversion happens there.
Peak memory: benchmarks/hub_download.py (README there)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from fedtune.core.options import UserError
from fedtune.download.options import ModelOptions

# What save_pretrained folders on the hub hold besides weights: config, generation settings and every
# tokenizer file format (tokenizer.json, sentencepiece *.model, BPE vocab/merges, chat templates).
MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
]
SAFETENSORS = ["*.safetensors", "*.safetensors.index.json"]
PICKLES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
ST_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class HubModelError(UserError):
    """A hub model whose files cannot serve: the message names the model, revision and file."""


def patterns(allow_pickle: bool) -> list[str]:
    return MODEL_FILES + SAFETENSORS + (PICKLES if allow_pickle else [])


def snapshot(name: str, revision: str | None, allow_pickle: bool = False) -> Path:
    """The folder holding the model's files at `revision`: a local folder as it is, else the hub cache's
    snapshot (downloaded there first unless HF_HUB_OFFLINE is set and it is cached already)."""
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=patterns(allow_pickle)))
    except LocalEntryNotFoundError as error:
        raise HubModelError(offline_message(name, revision, error, constants.HF_HUB_CACHE)) from error


def offline_message(name: str, revision: str | None, error: BaseException, cache: str) -> str:
    """One line for a hub model that is neither cached here nor reachable: the model, why (HF_HUB_OFFLINE,
    or the connection's own error: this machine is offline), and what to do."""
    import os

    label = f"{name}@{revision}" if revision else name
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        why = "HF_HUB_OFFLINE is set, so this machine does not go online"
    else:
        cause = error.__cause__ or error.__context__
        detail = " ".join(str(cause or error).split())
        why = f"this machine cannot reach the hub, it is offline ({detail[:160]})"
    return (
        f"model.name: {label} is not in the Hugging Face cache here ({cache}), and {why}: run the download "
        f"where the internet is reachable (a login node), or fetch it there with `hf download {name}` and "
        "copy the cache (HF_HOME) here"
    )


def link_files(source: Path, dest: Path, allow_pickle: bool = False) -> list[str]:
    """Hard-link (across file systems: copy, streamed) the model's files from source into dest."""
    from fnmatch import fnmatch

    names = []
    for path in sorted(source.iterdir()):
        if not path.is_file() or not any(fnmatch(path.name, p) for p in patterns(allow_pickle)):
            continue
        target = dest / path.name
        try:
            target.hardlink_to(path.resolve())
        except OSError:
            shutil.copyfile(path, target)
        target.chmod(0o644)
        names.append(path.name)
    return names


def check_files(folder: Path, label: str) -> dict:
    """Refuse a folder whose config or safetensors cannot serve, reading only config.json and the
    headers; returns {dtype: tensor count} of the weights."""
    from fedtune.core.safetensors_stream import WeightsError, read_weights

    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise HubModelError(f"{label}: config.json unreadable: {error}") from error
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS

    # What AutoModelForCausalLM would load (GPT-2's class is GPT2LMHeadModel, not …ForCausalLM).
    architectures = config.get("architectures") or []
    if config.get("model_type") not in CAUSAL_LMS and not set(architectures) & set(CAUSAL_LMS.values()):
        raise HubModelError(
            f"{label}: config.json (model_type {config.get('model_type')!r}, architectures {architectures}) "
            "is no causal language model that transformers' AutoModelForCausalLM loads"
        )
    try:
        weights = read_weights("base", folder, label=label)
    except (WeightsError, ValueError, KeyError) as error:
        raise HubModelError(f"{label}: {error}") from error
    ends: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    for info in weights.tensors.values():
        ends[info.file] = max(ends.get(info.file, 0), info.offset + info.nbytes)
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + 1
    for name, end in ends.items():
        size = (folder / name).stat().st_size
        if size < end:
            raise HubModelError(
                f"{label}: {name} is {size} bytes, but its header places data up to byte {end}: "
                "truncated download; delete it from the hub cache (HF_HOME) and download again"
            )
    return dtypes


def fetch(options: ModelOptions, dest: Path) -> dict:
    """The hub model of the model section into dest as files; returns what fedtune-source.json records
    about it."""
    from fedtune.core import models

    name, revision, allow_pickle = options.name, options.revision, options.allow_pickle
    label = f"{name}@{revision}" if revision else name
    source = snapshot(name, revision, allow_pickle)
    files = link_files(source, dest, allow_pickle)
    if models.weight_files(dest):
        dtypes = check_files(dest, label)
    else:
        models.check_model_dir(dest, allow_pickle=allow_pickle)  # pickle only: named unless allowed
        dtypes = {}
    wanted = ST_NAMES.get(options.dtype)
    floats = {d for d in dtypes if d in ST_NAMES.values()}
    if wanted and floats and floats != {wanted}:
        # Training loads in float32 and the evaluations in model.dtype, whatever the files hold; the
        # aggregation's start model of round 1 is this folder, and must match the sites' dtype.
        print(
            f"note: {label} stores {', '.join(sorted(floats))} weights, model.dtype is {options.dtype}: "
            "they are converted where they are loaded, not here",
            flush=True,
        )
    models.load_tokenizer(dest, trust_remote_code=options.trust_remote_code)
    models.record_checksums(dest)
    # The hub cache keeps a revision's files under snapshots/<commit>: what a branch resolved to.
    commit = source.name if is_commit(source.name) else None
    return {"files": files, "checkpoint_dtypes": dtypes, "snapshot": source.name, "commit": commit}


def is_commit(revision: str | None) -> bool:
    """A full commit id (40 hex digits): the one kind of revision the hub never moves."""
    return bool(revision) and re.fullmatch(r"[0-9a-f]{40}", revision) is not None


def cached_commit(name: str, revision: str) -> str | None:
    """The commit a branch or tag pointed to when this machine's hub cache last fetched it (its
    refs/<revision> file), read offline; None when the cache has no such ref."""
    from huggingface_hub.constants import HF_HUB_CACHE

    ref = Path(HF_HUB_CACHE) / ("models--" + name.replace("/", "--")) / "refs" / revision
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if is_commit(commit) else None


def revision_advice(options: ModelOptions, base_dir: Path) -> str | None:
    """For the dry run: a hub model named by a branch or tag (model.revision `main`, the default) is
    whatever the hub holds when each cluster's download runs, so two clusters may fine-tune different
    weights. Says so and recommends a commit: the one this run's base model was downloaded at, else the
    one the local hub cache resolved, else where to look it up. None for a commit or another source."""
    if options.source != "hf" or is_commit(options.revision) or Path(options.name).is_dir():
        return None
    revision = options.revision or "main"
    recorded = None
    try:
        recorded = json.loads((base_dir / "fedtune-source.json").read_text()).get("commit")
    except (OSError, ValueError):
        pass
    if recorded:
        where = f"{recorded} (what {base_dir} was downloaded at)"
    elif commit := cached_commit(options.name, revision):
        where = f"{commit} (what {revision} pointed to in this machine's hub cache)"
    else:
        where = f"the commit id that https://huggingface.co/{options.name}/commits/{revision} lists first"
    return (
        f"fedtune: warning: model.revision {revision!r} is a branch or tag, not a commit: each cluster "
        f"downloads what it points to when its download runs, and the hub may move it in between "
        f"(the aggregation then refuses the differing site). Pin a commit in the config: "
        f"model.revision: {where}"
    )
