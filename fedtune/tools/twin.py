"""Scaled-down twins of the example configs: the same workflow, on CPU, in minutes, with nothing downloaded.

    scripts/twin config/examples/opt125m-yelp.yaml --assets twins/assets --out twins/opt125m-yelp.yaml
    snakemake --profile profiles/local --configfile twins/opt125m-yelp.yaml

A twin is the example config with only sizes and locations changed, so it runs through the same code
path: the hub models it names are replaced by tiny, randomly initialised models of the same class with a
tokenizer of the same kind (written with save_pretrained, as a hub snapshot is), its hub datasets by
local dataset folders with the same configs, splits and columns (`datasets.load_dataset(folder, config)`
reads them as it reads the hub), and every site trains here on CPU with the example's backend, sharding,
ZeRO stage and offload flags. Each change is listed, with its reason, in a comment at the top of the twin.
Everything is seeded: the same example gives the same assets and the same twin. It runs from a checkout
of the repository (the example configs name its files), as `python -m fedtune.tools.twin` or scripts/twin."""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import random
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from fedtune.core import cli
from fedtune.core.atomic import atomic_dir, write_text
from fedtune.core.options import ConfigError, deep_merge, torch_dtype, validate_section
from fedtune.run.config import check_config, load_config

# The repository (this file is fedtune/tools/twin.py): example configs name files from there.
ROOT = Path(__file__).resolve().parents[2]

# Sizes of every twin: blocks of 64 tokens and about ten optimizer steps per site, the most that keeps
# the six example twins within minutes on two cores (each job's imports alone take seconds). The dataset
# sizes below are set per dataset so that its example's epochs come to about that many steps.
BLOCK_SIZE = 64
MAX_POSITIONS = 256
PROCESSES = 2
MAX_MICRO_BATCH = 4
TOKENIZE_SHARDS = 1
MAX_STEPS = 12
# More than one round, so that a round starts from the aggregate of the one before; a third adds minutes.
MAX_ROUNDS = 2
TEST_DOCUMENTS = 48
LOCAL_DOCUMENTS = TEST_DOCUMENTS  # per split, of a local dataset (the repository's own files)
EVAL_DOCUMENTS = 24
# A tiny random model learns little in a dozen steps at a pretrained 7B model's fine-tuning rate.
LR = 0.003


# ---------------------------------------------------------------------------------------------- text
# Every dataset's text comes from its own small vocabulary, so a model fine-tuned on it visibly beats the
# base model there, and labels follow the words of the text, so a classifier can beat chance.


def _rng(*parts) -> random.Random:
    # crc32, not hash(): str hashes change with every interpreter (PYTHONHASHSEED).
    return random.Random(zlib.crc32("/".join(map(str, parts)).encode()))


IT = {
    "citta": ["Roma", "Milano", "Napoli", "Torino", "Bologna", "Firenze", "Genova", "Bari", "Verona"],
    "soggetto": ["Il comune", "La scuola", "Il museo", "La biblioteca", "Il mercato", "La squadra"],
    "verbo": ["organizza", "presenta", "apre", "rinnova", "ospita", "annuncia", "propone"],
    "oggetto": ["una mostra", "un concerto", "un corso gratuito", "una festa", "un incontro", "una gara"],
    "tempo": ["sabato", "domenica", "questa settimana", "il mese prossimo", "in primavera", "ogni lunedì"],
    "coda": ["Ingresso libero.", "Informazioni sul sito.", "Prenotazione obbligatoria.", "Vi aspettiamo!"],
}

CS = {
    "mesto": ["Praha", "Brno", "Ostrava", "Plzeň", "Olomouc", "Liberec", "Zlín", "Pardubice"],
    "podmet": ["Městský úřad", "Knihovna", "Muzeum", "Divadlo", "Škola", "Sportovní klub"],
    "sloveso": ["pořádá", "otevírá", "připravuje", "nabízí", "zve na", "oznamuje"],
    "predmet": ["výstavu", "koncert", "kurz zdarma", "slavnost", "setkání", "závod"],
    "cas": ["v sobotu", "v neděli", "tento týden", "příští měsíc", "na jaře", "každé pondělí"],
    "konec": ["Vstup volný.", "Více informací na webu.", "Nutná rezervace.", "Těšíme se na vás!"],
}


def web_document(words: dict, rng: random.Random, place_key: str, order: list[str]) -> str:
    sentences = []
    for _ in range(rng.randint(2, 4)):
        picked = [rng.choice(words[key]) for key in order[:-1]]
        sentences.append(f"{' '.join(picked)} a {rng.choice(words[place_key])}.")
    return " ".join(sentences) + " " + rng.choice(words[order[-1]])


def italian_web(rng: random.Random, index: int) -> dict:
    text = web_document(IT, rng, "citta", ["soggetto", "verbo", "oggetto", "tempo", "coda"])
    return _web_row(text, rng, index, "it")


def czech_web(rng: random.Random, index: int) -> dict:
    text = web_document(CS, rng, "mesto", ["podmet", "sloveso", "predmet", "cas", "konec"])
    return _web_row(text, rng, index, "cz")


def _web_row(text: str, rng: random.Random, index: int, tld: str) -> dict:
    day = rng.randint(1, 28)
    return {
        "text": text,
        "timestamp": f"2019-{rng.randint(1, 12):02d}-{day:02d}T{rng.randint(0, 23):02d}:00:00Z",
        "url": f"https://www.example-{index % 17}.{tld}/news/{index}",
    }


WIKI = {
    "name": ["Valkyria", "Tower", "Kingdom", "River", "Harbour", "Cathedral", "Railway", "Battle", "Comet"],
    "place": ["Lincoln", "Ohio", "Bavaria", "Kent", "Ontario", "Galicia", "Victoria", "Munster"],
    "section": ["History", "Design", "Reception", "Legacy", "Geography", "Construction"],
    "verb": ["was built", "was founded", "was released", "was destroyed", "was restored", "was named"],
    "by": ["the council", "the company", "the army", "the church", "local engineers", "the government"],
}


def wiki_article(rng: random.Random) -> list[str]:
    """One article as wikitext rows: heading lines, paragraphs, and the empty rows between them."""
    title = f"{rng.choice(WIKI['name'])} of {rng.choice(WIKI['place'])}"
    rows = ["", f" = {title} = \n", ""]
    for section in rng.sample(WIKI["section"], rng.randint(1, 3)):
        rows += [f" = = {section} = = \n", ""]
        sentences = [
            f"The {title} {rng.choice(WIKI['verb'])} in {rng.randint(1700, 2010)} by {rng.choice(WIKI['by'])} ."
            for _ in range(rng.randint(2, 4))
        ]
        rows += [" " + " ".join(sentences) + " \n", ""]
    return rows


YELP = {
    # The star rating follows the words: a classifier (or a language model) can learn it from the text.
    "food": ["pizza", "tacos", "ramen", "burger", "pasta", "sushi", "salad", "steak", "curry"],
    "stars": [
        ["awful", "cold", "rude", "disgusting", "never again"],
        ["bland", "slow", "overpriced", "disappointing", "meh"],
        ["okay", "average", "decent", "fine", "nothing special"],
        ["good", "tasty", "friendly", "fresh", "would return"],
        ["amazing", "perfect", "delicious", "outstanding", "best in town"],
    ],
    "names": ["1 star", "2 star", "3 stars", "4 stars", "5 stars"],
}


def yelp_review(rng: random.Random, index: int) -> dict:
    label = rng.randrange(5)
    words = YELP["stars"][label]
    sentences = [
        f"The {rng.choice(YELP['food'])} was {rng.choice(words)} and the service was {rng.choice(words)}.",
        f"Overall {rng.choice(words)}.",
    ]
    rng.shuffle(sentences)
    return {"label": label, "text": " ".join(sentences)}


IMDB = {
    "film": ["this movie", "the film", "this picture", "the sequel", "this thriller", "the remake"],
    "part": ["acting", "plot", "score", "ending", "dialogue", "camera work", "cast"],
    "sentiment": [
        ["dull", "tedious", "awful", "a mess", "painful", "boring"],
        ["brilliant", "moving", "superb", "a delight", "gripping", "wonderful"],
    ],
}


def imdb_review(rng: random.Random, label: int) -> dict:
    words = IMDB["sentiment"][label]
    sentences = [
        f"I watched {rng.choice(IMDB['film'])} last night.",
        *(f"The {rng.choice(IMDB['part'])} was {rng.choice(words)}." for _ in range(rng.randint(2, 3))),
    ]
    return {"text": " ".join(sentences) + "<br /><br />" + f"Simply {rng.choice(words)}.", "label": label}


# ------------------------------------------------------------------------------------------ datasets


@dataclass(frozen=True)
class DatasetRecipe:
    """A hub dataset's layout: its configs (the first is the default), splits and columns."""

    configs: tuple[str, ...]
    splits: dict[str, int]  # split -> documents
    make: Callable[[str, int], list[dict]]  # (split, documents) -> rows
    labels: tuple[str, ...] = ()  # ClassLabel names of the `label` column
    # The repository's own data files, for an example that names them in dataset.data_files (a
    # script-based data set): split -> paths inside the repository; each split's rows are dealt over its
    # files (json lines, gzipped as on the hub).
    layout: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _rows(make_row: Callable[[random.Random, int], dict], name: str) -> Callable[[str, int], list[dict]]:
    def make(split: str, count: int) -> list[dict]:
        rng = _rng(name, split)
        return [make_row(rng, i) for i in range(count)]

    return make


def _wikitext(split: str, count: int) -> list[dict]:
    rng, rows = _rng("wikitext", split), []
    while len(rows) < count:
        rows += [{"text": row} for row in wiki_article(rng)]
    return rows[:count]


def _imdb(split: str, count: int) -> list[dict]:
    rng = _rng("imdb", split)
    if split == "unsupervised":
        return [dict(imdb_review(rng, rng.randrange(2)), label=-1) for _ in range(count)]
    # As on the hub, every negative review comes before every positive one: the first N are one class.
    return [imdb_review(rng, label) for label in (0, 1) for _ in range(count // 2)]


DATASETS = {
    "gsarti/clean_mc4_it": DatasetRecipe(
        ("tiny", "small", "medium"),
        {"train": 160, "validation": TEST_DOCUMENTS},
        _rows(italian_web, "clean_mc4_it"),
        # As on the hub (the folder clean-mc4-it/, 1024 train and 8 validation shards): two train shards
        # of the tiny config's 100, its one validation shard.
        layout=(
            ("train", tuple(f"clean-mc4-it/c4-it.tfrecord-{i:05d}-of-01024.json.gz" for i in range(2))),
            ("validation", ("clean-mc4-it/c4-it-validation.tfrecord-00000-of-00008.json.gz",)),
        ),
    ),
    "allenai/c4": DatasetRecipe(
        ("en", "cs"), {"train": 160, "validation": TEST_DOCUMENTS}, _rows(czech_web, "c4")
    ),
    # Wikitext rows are lines, half of them empty or headings; a paragraph row is a long document.
    "Salesforce/wikitext": DatasetRecipe(
        ("wikitext-2-raw-v1", "wikitext-103-raw-v1"),
        {"train": 150, "validation": 2 * TEST_DOCUMENTS, "test": 2 * TEST_DOCUMENTS},
        _wikitext,
    ),
    "Yelp/yelp_review_full": DatasetRecipe(
        ("yelp_review_full",),
        {"train": 100, "test": TEST_DOCUMENTS},
        _rows(yelp_review, "yelp"),
        labels=tuple(YELP["names"]),
    ),
    "stanfordnlp/imdb": DatasetRecipe(
        ("plain_text",),
        # More rows than the language-model twins: a new head on an encoder needs ~100 steps to learn.
        {"train": 480, "test": TEST_DOCUMENTS, "unsupervised": TEST_DOCUMENTS},
        _imdb,
        labels=("neg", "pos"),
    ),
}


def _slug(name: str) -> str:
    return name.replace("/", "--")


def _splits(name: str) -> dict[str, list[dict]]:
    recipe = DATASETS[name]
    return {split: recipe.make(split, count) for split, count in recipe.splits.items()}


def dataset_folder(assets: Path, name: str) -> Path:
    """Where the stand-in for hub dataset `name` lives: the folder name carries a digest of its rows.
    datasets caches a folder with a `configs:` header under the folder's name and config alone (not its
    path, files or mtimes), so a folder whose content changed under the same name would load stale rows
    from HF_HOME."""
    content = [_splits(name), DATASETS[name].layout]
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:12]
    return assets / "datasets" / f"{_slug(name)}-{digest}"


def build_dataset(name: str, assets: Path) -> Path:
    """A dataset folder that `datasets.load_dataset(folder, config)` reads like the hub dataset `name`:
    the same config names (a README `configs:` header maps each to its parquet files), splits and
    columns, with the label column a ClassLabel as on the hub."""
    from datasets import ClassLabel, Dataset, Features, Value

    recipe, out = DATASETS[name], dataset_folder(assets, name)
    if out.is_dir():
        return out  # its name is its content
    splits = _splits(name)
    header = {"configs": []}
    with atomic_dir(out) as tmp:
        for index, config in enumerate(recipe.configs):
            files = []
            for split, rows in splits.items():
                columns = {key: [row[key] for row in rows] for key in rows[0]}
                features = Features(
                    {
                        key: ClassLabel(names=list(recipe.labels)) if key == "label" else Value("string")
                        for key in columns
                    }
                )
                path = Path(config) / f"{split}-00000-of-00001.parquet"
                (tmp / config).mkdir(exist_ok=True)
                Dataset.from_dict(columns, features=features).to_parquet(str(tmp / path))
                files.append({"split": split, "path": str(path)})
            entry = {"config_name": config, "data_files": files}
            if index == 0:
                entry["default"] = True
            header["configs"].append(entry)
        readme = (
            f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n# Twin of {name}\n\nMade by scripts/twin.\n"
        )
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        for split, paths in recipe.layout:
            rows = splits[split]
            for index, path in enumerate(paths):
                (tmp / path).parent.mkdir(parents=True, exist_ok=True)
                lines = "".join(json.dumps(row) + "\n" for row in rows[index :: len(paths)])
                (tmp / path).write_bytes(gzip.compress(lines.encode(), mtime=0))
    return out


def corpus(name: str) -> list[str]:
    """The training text of a dataset, for training a stand-in tokenizer on."""
    recipe = DATASETS[name]
    return [row["text"] for row in recipe.make("train", recipe.splits["train"])]


# -------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelRecipe:
    """A hub model's class, tokenizer kind and dtype, with a tiny config of the same model type."""

    model_type: str
    architecture: str
    tokenizer: str  # llama (SentencePiece-style BPE, byte fallback) | gpt2 | opt (byte-level BPE) | bert
    dtype: str
    config: dict


TINY = {"num_hidden_layers": 2, "num_attention_heads": 4}
MODELS = {
    "meta-llama/Llama-2-7b-hf": ModelRecipe(
        "llama",
        "LlamaForCausalLM",
        "llama",
        "float16",
        {
            **TINY,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_key_value_heads": 4,
            "max_position_embeddings": MAX_POSITIONS,
            "tie_word_embeddings": False,
        },
    ),
    "facebook/opt-125m": ModelRecipe(
        "opt",
        "OPTForCausalLM",
        "opt",
        "float16",
        {
            **TINY,
            "hidden_size": 64,
            "ffn_dim": 128,
            "word_embed_proj_dim": 64,
            "max_position_embeddings": MAX_POSITIONS,
        },
    ),
    "openai-community/gpt2": ModelRecipe(
        "gpt2",
        "GPT2LMHeadModel",
        "gpt2",
        "float32",
        {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": MAX_POSITIONS},
    ),
    "distilbert/distilbert-base-uncased": ModelRecipe(
        "distilbert",
        "DistilBertForMaskedLM",
        "bert",
        "float32",
        {"n_layers": 2, "n_heads": 4, "dim": 64, "hidden_dim": 128, "max_position_embeddings": MAX_POSITIONS},
    ),
}
VOCAB_SIZE = 1000


def _bpe(texts: list[str], specials: list[str], pre_tokenizer, alphabet: list[str]) -> tuple[dict, list]:
    from tokenizers import Tokenizer, models, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    state = json.loads(tokenizer.to_str())["model"]
    return state["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]


def build_tokenizer(kind: str, texts: list[str], max_positions: int):
    """A tokenizer of the hub model's kind, trained on `texts`, as the class the hub model uses, with the
    hub model's special tokens (GPT-2: one <|endoftext|> for all, no pad; Llama-2: no pad; ...)."""
    import transformers
    from tokenizers import pre_tokenizers

    limit = {"model_max_length": max_positions}
    if kind == "llama":
        # Llama-2's layout: <unk> <s> </s>, then the 256 byte tokens that byte fallback maps unknown
        # characters to, then the pieces; "▁" marks a word start, as SentencePiece does.
        specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
        vocab, merges = _bpe(texts, specials, pre, [])
        return transformers.LlamaTokenizer(vocab=vocab, merges=merges, **limit)
    if kind in ("gpt2", "opt"):
        # GPT-2: <|endoftext|> is BOS, EOS and UNK, and there is no pad token. OPT reuses GPT-2's BPE
        # with <s> <pad> </s> <unk> first and </s> as BOS and EOS.
        specials = ["<|endoftext|>"] if kind == "gpt2" else ["<s>", "<pad>", "</s>", "<unk>"]
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
        vocab, merges = _bpe(texts, specials, pre, pre_tokenizers.ByteLevel.alphabet())
        if kind == "gpt2":
            return transformers.GPT2Tokenizer(vocab=vocab, merges=merges, **limit)
        specials = {"bos_token": "</s>", "eos_token": "</s>", "unk_token": "</s>", "pad_token": "<pad>"}
        return transformers.GPT2Tokenizer(vocab=vocab, merges=merges, **specials, **limit)
    if kind == "bert":
        from tokenizers import Tokenizer, models, normalizers, trainers

        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        # DistilBertTokenizer adds BERT's post-processor: [CLS] text [SEP].
        return transformers.DistilBertTokenizer(vocab=tokenizer.get_vocab(), do_lower_case=True, **limit)
    raise ValueError(f"unknown tokenizer kind {kind!r}")


def build_model(name: str, texts: list[str], out: Path) -> Path:
    """A tiny, randomly initialised model of `name`'s class with a tokenizer of its kind, saved in its
    dtype with save_pretrained (safetensors), as a hub snapshot is."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    recipe = MODELS[name]
    positions = recipe.config.get("max_position_embeddings", recipe.config.get("n_positions"))
    tokenizer = build_tokenizer(recipe.tokenizer, texts, positions)
    special = {f"{role}_token_id": getattr(tokenizer, f"{role}_token_id") for role in ("bos", "eos", "pad")}
    config = AutoConfig.for_model(recipe.model_type, vocab_size=len(tokenizer), **special, **recipe.config)
    torch.manual_seed(zlib.crc32(name.encode()))
    loader = {"ForCausalLM": AutoModelForCausalLM, "LMHeadModel": AutoModelForCausalLM}
    auto = next((cls for suffix, cls in loader.items() if recipe.architecture.endswith(suffix)), None)
    auto = auto or (AutoModelForMaskedLM if recipe.architecture.endswith("ForMaskedLM") else AutoModel)
    model = auto.from_config(config).to(torch_dtype(recipe.dtype))
    if type(model).__name__ != recipe.architecture:
        raise AssertionError(f"{name}: built {type(model).__name__}, the hub model is {recipe.architecture}")
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)
    return out


# --------------------------------------------------------------------------------------------- twins

# What the twin changes, by key pattern ("*" is one key), with the reason written into the twin. Any
# other difference from the example is a bug: tests/test_examples.py checks every twin against this.
RESIZED = {
    "run": "its own results folder, apart from a real run's",
    "cluster": "null: every site trains on this machine",
    "sites.*.cluster": "local: no cluster's environment file (scratch paths, accounts, modules) on this machine",
    "model.name": "a tiny local model of the same class and tokenizer kind",
    "model.architecture.*": "tiny sizes",
    "model.tokenizer.vocab_size": "a small vocabulary for a small corpus",
    "sites.*.dataset.name": "a local dataset folder with the hub dataset's configs, splits and columns",
    "sites.*.dataset.max_documents": "a few documents",
    "sites.*.dataset.data_files": "the repository's own files, by absolute path (the twin runs elsewhere)",
    "tokenize.block_size": "short blocks",
    "tokenize.shards": "few tokenize jobs",
    "evaluate.max_length": "the twin's block size",
    "evaluate.stride": "scaled with max_length",
    "evaluate.batch_size": "small batches",
    "evaluate.max_documents": "a few documents",
    "federation.remotes": "dropped: every site trains here",
    "federation.rounds": f"{MAX_ROUNDS} rounds at most: still a round that starts from the last one's aggregate",
    "sweep.values": "devices this machine has (CPU processes)",
    **{
        f"{where}.{key}": reason
        for where in ("train", "sites.*.train")
        for key, reason in {
            "device": "CPU",
            "launcher": "torchrun on this machine",
            "nodes": "one machine",
            "processes_per_node": f"{PROCESSES} CPU processes",
            "gpus_per_node": "no GPUs",
            "cpus_per_process": "one core each",
            "mem_mb": "a small job",
            "runtime": "a small job",
            "micro_batch": "small batches",
            "global_batch": "small batches, with gradient accumulation when the example has it",
            "max_steps": "a few steps",
            "warmup_steps": "scaled with the steps",
            "checkpoint_every": "scaled with the steps (still more than one checkpoint)",
            "lr": "a tiny random model needs a larger step than a pretrained one",
            "precision": "DeepSpeed has no fp16 on CPU (the CPU accelerator refuses it)",
        }.items()
    },
}

TRAIN_SIZES = {
    "device": "cpu",
    "launcher": "local",
    "nodes": 1,
    "processes_per_node": PROCESSES,
    "gpus_per_node": 0,
    "cpus_per_process": 1,
    "mem_mb": 4000,
    "runtime": 30,
}


def _scale_train(section: dict, merged: dict) -> None:
    """Resize one train section in place: the keys it sets, plus (for the top-level section) every
    resource key, since the defaults need not fit this machine either."""
    for key, value in TRAIN_SIZES.items():
        section[key] = value
    if "micro_batch" in section:
        section["micro_batch"] = min(section["micro_batch"], MAX_MICRO_BATCH)
    if "global_batch" in section or "micro_batch" in section:
        micro = min(merged["micro_batch"], MAX_MICRO_BATCH)
        accumulation = merged["global_batch"] // (
            merged["micro_batch"] * merged["nodes"] * merged["processes_per_node"]
        )
        # Keep gradient accumulation when the example accumulates: it is a code path of its own.
        section["global_batch"] = micro * PROCESSES * (2 if accumulation > 1 else 1)
    if section.get("max_steps") is not None:
        section["max_steps"] = MAX_STEPS
    if "warmup_steps" in section:
        section["warmup_steps"] = min(section["warmup_steps"], 3)
    if section.get("checkpoint_every"):
        section["checkpoint_every"] = 5
    if "lr" in section:
        # Raised to LR, never lowered: an example already at a from-scratch rate (demo-lora) keeps it.
        section["lr"] = max(section["lr"], LR)
    if merged["backend"] == "deepspeed" and merged["precision"] == "fp16":
        section["precision"] = "fp32"


def _documents(value: int | None, cap: int) -> int | None:
    return value if value is None else min(value, cap)


def twin_config(example: dict, assets: Path, *, source: str) -> dict:
    """The twin of a validated example config: sizes and locations changed, nothing else."""
    twin = copy.deepcopy(example)
    twin["run"] = f"{example['run']}-twin"
    twin["cluster"] = None
    model = twin["model"]
    if model["source"] == "hf":
        if model["name"] not in MODELS:
            raise ConfigError(
                f"{source}: model.name: {model['name']!r} has no tiny stand-in; known: {', '.join(MODELS)}"
            )
        model["name"] = str(assets / "models" / _slug(model["name"]))
    elif model["source"] == "init":
        architecture = model["architecture"]
        recipe = next((r for r in MODELS.values() if r.model_type == architecture.get("model_type")), None)
        if recipe is None:
            model_type = architecture.get("model_type")
            raise ConfigError(f"{source}: model.architecture.model_type: {model_type!r} has no tiny sizes")
        for key in architecture:
            if key in recipe.config:
                architecture[key] = recipe.config[key]
        if "vocab_size" in model.get("tokenizer", {}):
            model["tokenizer"]["vocab_size"] = VOCAB_SIZE
    else:
        raise ConfigError(f"{source}: model.source: local: a twin replaces hub models only")
    for name, site in twin["sites"].items():
        site["cluster"] = "local"
        dataset = site["dataset"]
        if dataset["source"] == "local":
            # The repository's own files (data/real, data/demo): kept, by a path the twin's folder reaches,
            # and cut to as many documents as a stand-in's test split: data/real's are long (500 of them
            # a site, about 2.6 kB each), more than a dozen steps train on, and evaluating all of them was
            # the longest part of demo-lora's twin.
            dataset["data_files"] = {
                split: [str(ROOT / f) for f in ([files] if isinstance(files, str) else files)]
                for split, files in dataset["data_files"].items()
            }
            dataset["max_documents"] = min(dataset.get("max_documents") or LOCAL_DOCUMENTS, LOCAL_DOCUMENTS)
            continue
        if dataset["source"] != "hf" or dataset["name"] not in DATASETS:
            raise ConfigError(
                f"{source}: sites.{name}.dataset.name: {dataset.get('name')!r} has no tiny stand-in; "
                f"known: {', '.join(DATASETS)}"
            )
        dataset["name"] = str(dataset_folder(assets, dataset["name"]))
        if "max_documents" in dataset:
            dataset["max_documents"] = _documents(dataset["max_documents"], 120)
    train = twin.setdefault("train", {})
    _scale_train(train, deep_merge(_defaults("train.schema.yaml"), example.get("train", {})))
    # The default (100 steps) would be a twin's longest part.
    train.setdefault("max_steps", MAX_STEPS)
    for name, site in twin["sites"].items():
        if site.get("train"):
            merged = deep_merge(_defaults("train.schema.yaml"), example.get("train", {}))
            merged = deep_merge(merged, example["sites"][name]["train"])
            override = site["train"]
            _scale_train(override, merged)
            for key in list(override):
                if key in TRAIN_SIZES and key not in example["sites"][name]["train"]:
                    del override[key]  # the top-level section already resizes it
    tokenize = twin.setdefault("tokenize", {})
    tokenize["block_size"] = min(example["tokenize"]["block_size"], BLOCK_SIZE)
    if "shards" in tokenize:
        tokenize["shards"] = min(tokenize["shards"], TOKENIZE_SHARDS)
    evaluate = twin.get("evaluate", {})
    if "max_length" in evaluate:
        ratio = (evaluate.get("stride") or evaluate["max_length"]) / evaluate["max_length"]
        evaluate["max_length"] = tokenize["block_size"]
        if evaluate.get("stride"):
            evaluate["stride"] = max(1, int(evaluate["max_length"] * ratio))
    if "batch_size" in evaluate:
        evaluate["batch_size"] = min(evaluate["batch_size"], 8)
    if evaluate.get("max_documents"):
        evaluate["max_documents"] = min(evaluate["max_documents"], EVAL_DOCUMENTS)
    if twin.get("federation", {}).get("remotes"):
        del twin["federation"]["remotes"]
    if twin.get("federation", {}).get("rounds", 1) > MAX_ROUNDS:
        twin["federation"]["rounds"] = MAX_ROUNDS
    sweep = twin.get("sweep")
    if sweep and sweep.get("axis", "devices") == "devices":
        sweep["values"] = [v for v in sweep["values"] if v <= PROCESSES] or [1]
    return twin


def _defaults(schema_name: str) -> dict:
    return validate_section({}, schema_name, source="schema")


def flatten(value, prefix: str = "") -> dict:
    """Nested mappings as {"a.b.c": leaf}; lists are leaves."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: value}


def differences(example: dict, twin: dict) -> dict[str, tuple]:
    """Every key path whose value differs, as {path: (example value, twin value)}; a missing key reads
    as the string "<unset>"."""
    a, b = flatten(example), flatten(twin)
    # A dropped mapping (federation.remotes) shows as the mapping's path, not as each of its keys.
    unset = "<unset>"
    diff = {path: (a.get(path, unset), b.get(path, unset)) for path in a.keys() | b.keys()}
    return {path: pair for path, pair in sorted(diff.items()) if pair[0] != pair[1]}


def allowed_by(path: str) -> str | None:
    """The RESIZED pattern that lets a twin change `path` (None: none does)."""
    from fnmatch import fnmatchcase

    parts = path.split(".")
    for pattern in RESIZED:
        wanted = pattern.split(".")
        # A pattern names a key; its sub-keys (federation.remotes.karolina) change with it.
        if len(parts) >= len(wanted) and all(fnmatchcase(p, w) for p, w in zip(parts, wanted, strict=False)):
            return pattern
    return None


def header(example_path: Path, example: dict, twin: dict, command: str) -> str:
    lines = [
        f"Scaled-down twin of {example_path}, made by",
        f"  {command}",
        "It runs the example's stages, backend, sharding and options on CPU in minutes; only these differ:",
    ]
    seen = set()
    for path, (before, after) in differences(example, twin).items():
        key = allowed_by(path)
        shown = ".".join(path.split(".")[: len(key.split("."))])
        if shown in seen:
            continue
        seen.add(shown)
        if shown != path:
            before, after = "...", "(dropped)" if after == "<unset>" else "..."
        lines.append(f"  {shown}: {json.dumps(before)} -> {json.dumps(after)}  ({RESIZED[key]})")
    return "".join(f"# {line}\n" for line in lines)


def make_twin(example_path: str | Path, assets: str | Path, out: str | Path) -> dict:
    """Build the stand-in models and datasets the example names into `assets` and write its twin
    config to `out`. Returns the twin config."""
    example_path, assets, out = Path(example_path), Path(assets).resolve(), Path(out)
    example = yaml.safe_load(example_path.read_text(encoding="utf-8"))
    # Validate a copy: the check fills in defaults, and the twin should keep the example's own keys.
    load_config(example_path, base_dir=ROOT)
    twin = twin_config(example, assets, source=str(example_path))
    unexplained = [path for path in differences(example, twin) if allowed_by(path) is None]
    if unexplained:
        raise AssertionError(f"{example_path}: the twin changes {unexplained}, which it may not")
    names = {
        site["dataset"]["name"] for site in example["sites"].values() if site["dataset"]["source"] == "hf"
    }
    for name in sorted(names):
        build_dataset(name, assets)
    if example["model"]["source"] == "hf":
        texts = [text for name in sorted(names) for text in corpus(name)]
        build_model(example["model"]["name"], texts, assets / "models" / _slug(example["model"]["name"]))
    command = f"scripts/twin {example_path} --assets {assets} --out {out}"
    text = header(example_path, example, twin, command) + yaml.safe_dump(
        twin, sort_keys=False, allow_unicode=True
    )
    check_config(yaml.safe_load(text), source=str(out))
    write_text(out, text)
    return twin


@cli.entry("fedtune.tools.twin")
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/twin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("example", help="an example config, e.g. config/examples/gpt2-wikitext.yaml")
    parser.add_argument("--assets", required=True, help="folder for the tiny models and datasets")
    parser.add_argument("--out", required=True, help="where to write the twin config")
    args = parser.parse_args(argv)
    try:
        make_twin(args.example, args.assets, args.out)
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}; run it with: snakemake --profile profiles/local --configfile {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
