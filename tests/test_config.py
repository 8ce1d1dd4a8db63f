"""The config schema: the demo and example configs pass with defaults filled in; each kind of mistake
fails at load time with the file and the key named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from fedtune.core.options import ConfigError
from fedtune.run.config import check_config, load_config
from fedtune.train.options import site_train_options

ROOT = Path(__file__).resolve().parent.parent


# The demo as the tests know it, on generated text (sites alpha and beta); config/config.yaml runs the
# same settings on real text.
DEMO = ROOT / "tests" / "support" / "demo-generated.yaml"


def demo() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_the_demo_runs_on_real_text_with_the_tested_settings():
    """`make demo` (config/config.yaml) differs from the tests' demo only in its sites (real text, one
    language per site, shipped in data/real with its licence), in its federation strategy (the default,
    where the tests' generated-text demo keeps the FedAdam settings chosen on its own text, and the vocab
    rows merged as then, which its exact figures rest on, docs/federation.md), in its rounds and in the
    embedding and head rows' lr factor."""
    real = load_config(ROOT / "config" / "config.yaml", base_dir=ROOT)
    tested = load_config(DEMO, base_dir=ROOT)
    strategy = {key: real["aggregate"][key] for key in ("server_optimizer", "vocab_rows", "vocab_step")}
    # and in how its 64 steps are cut: 8 rounds of 8 where the generated text ran 6 of 10.
    assert (real["federation"]["rounds"], real["train"]["max_steps"]) == (8, 8)
    assert (tested["federation"]["rounds"], tested["train"]["max_steps"]) == (6, 10)
    # and in the embedding and head rows' lr factor (16, from the benchmark's tuning half).
    cut = {
        "federation": {"rounds": 8},
        "train": {"max_steps": 8, "embedding_lr_factor": 16},
        "aggregate": strategy,
    }
    assert {k: v for k, v in real.items() if k != "sites"} == {
        k: {**v, **cut[k]} if k in cut else v for k, v in tested.items() if k != "sites"
    }
    default = real["aggregate"]["server_optimizer"]
    assert "aggregate" not in yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    # The default strategy is plain FedAvg: sgd at lr 1, every row with the sites' weights.
    assert (default["name"], default["lr"]) == ("sgd", 1.0)
    assert real["aggregate"]["vocab_rows"] == tested["aggregate"]["vocab_rows"] == "weights"
    assert list(real["sites"]) == ["it", "cs"]
    for name, site in real["sites"].items():
        files = site["dataset"]["data_files"]
        assert files == {
            split: f"data/real/libreoffice-help-{name}/{split}.jsonl" for split in ("train", "test")
        }
    readme = (ROOT / "data" / "real" / "README.md").read_text()
    assert "MPL-2.0" in readme and "scripts/real-text" in readme
    assert (ROOT / "data" / "real" / "LICENSE.MPL-2.0").read_text().startswith("Mozilla Public License")


def test_demo_config_is_valid_and_defaults_are_filled():
    config = load_config(DEMO, base_dir=ROOT)
    assert config["results"] == "results"
    assert config["tokenize"]["add_bos"] is True
    assert config["sites"]["alpha"]["dataset"]["max_documents"] is None
    assert config["aggregate"]["weights"] == "tokens"
    assert config["federation"]["rounds"] == 6 and config["federation"]["lr_schedule"] == "continue"
    assert config["aggregate"]["server_optimizer"]["tau"] == 0.001  # a default inside a section
    assert config["aggregate"]["server_optimizer"]["betas"] == [0.95, 0.99]  # the demo's own
    assert config["model"]["trust_remote_code"] is False
    # Defaults reach into the section schemas that live in their own files.
    assert config["train"]["backend"] == "fsdp"
    assert config["evaluate"]["batch_size"] == 8


def schema_properties():
    """(file#path, property schema, required?) for every property of every schema file."""
    from fedtune.core.options import SCHEMAS

    def walk(node, where):
        required = set(node.get("required", ()))
        for name, sub in node.get("properties", {}).items():
            yield f"{where}.{name}", sub, name in required
            yield from walk(sub, f"{where}.{name}")
        for name, sub in node.get("$defs", {}).items():
            yield from walk(sub, f"{where}#{name}")

    for path in sorted(
        (p for p in SCHEMAS.iterdir() if p.name.endswith(".schema.yaml")), key=lambda p: p.name
    ):
        yield from walk(yaml.safe_load(path.read_text()), path.name)


# Keys that only make sense for one source have no default: an if/then on the source requires them.
CONDITIONAL = {
    "config.schema.yaml#model.name",
    "config.schema.yaml#model.path",
    "config.schema.yaml#dataset.name",
    "config.schema.yaml#dataset.data_files",
    "config.schema.yaml#dataset.data_files.train",
    "config.schema.yaml#dataset.data_files.test",
}


def test_every_schema_key_is_documented_with_a_default():
    undocumented = [
        where for where, sub, _ in schema_properties() if "description" not in sub and "$ref" not in sub
    ]
    no_default = [
        where
        for where, sub, required in schema_properties()
        if "default" not in sub and not required and where not in CONDITIONAL
    ]
    assert undocumented == []
    assert no_default == []


def test_site_train_override_merges_over_the_train_section():
    config = demo()
    config["sites"]["beta"]["train"] = {"backend": "deepspeed", "zero_stage": 3, "nodes": 2, "micro_batch": 4}
    check_config(config, base_dir=ROOT)
    beta = site_train_options(config, "beta")
    alpha = site_train_options(config, "alpha")
    assert (beta.backend, beta.zero_stage, beta.nodes) == ("deepspeed", 3, 2)
    assert beta.max_steps == alpha.max_steps == config["train"]["max_steps"]
    assert alpha.backend == "fsdp"


def edit(path: str, value):
    """A config edit: set `value` at the dotted `path` (None deletes the key)."""

    def apply(config):
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            del node[last]
        else:
            node[last] = value

    return apply


BAD = [
    ("unknown top-level key", edit("learning_rate", 0.1), "learning_rate"),
    ("unknown nested key", edit("tokenize.blocksize", 64), "blocksize"),
    ("wrong type", edit("tokenize.block_size", "big"), "tokenize.block_size"),
    ("block size below minimum", edit("tokenize.block_size", 2), "tokenize.block_size"),
    ("unknown mode", edit("tokenize.mode", "chunks"), "tokenize.mode"),
    ("missing data file", edit("sites.alpha.dataset.data_files.train", "data/nope.jsonl"), "data/nope.jsonl"),
    (
        "data files of no known format",
        edit("sites.alpha.dataset.data_files.test", "data/test.xml"),
        "sites.alpha.dataset.data_files: cannot tell one format from the suffixes ['.jsonl', '.xml']",
    ),
    ("template without {text}", edit("sites.alpha.prompt_template", "Write:"), "sites.alpha.prompt_template"),
    (
        "template with another field",
        edit("sites.beta.prompt_template", "{lang}: {text}"),
        "sites.beta.prompt_template",
    ),
    (
        "template with a broken brace",
        edit("sites.beta.prompt_template", "{text} {"),
        "sites.beta.prompt_template",
    ),
    (
        "site name not an identifier",
        edit("sites.bad name", {"dataset": {"source": "hf", "name": "x"}}),
        "bad name",
    ),
    (
        "site name with a shell character",
        edit("sites.a;rm", {"dataset": {"source": "hf", "name": "x"}}),
        "a;rm",
    ),
    (
        "site named like the merged model",
        edit("sites.aggregate", {"dataset": {"source": "hf", "name": "x"}}),
        "aggregate",
    ),
    ("run name with a slash", edit("run", "../elsewhere"), "run"),
    ("dataset source unknown", edit("sites.alpha.dataset.source", "ftp"), "sites.alpha.dataset.source"),
    ("hf dataset without name", edit("sites.alpha.dataset", {"source": "hf"}), "sites.alpha.dataset"),
    ("hf model without name", edit("model", {"source": "hf"}), "model"),
    ("local model folder missing", edit("model", {"source": "local", "path": "no/such/model"}), "model.path"),
    ("unknown train backend", edit("train.backend", "horovod"), "train.backend"),
    (
        "unknown sharding in a site override",
        edit("sites.beta.train", {"sharding": "half"}),
        "sites.beta.train.sharding",
    ),
    ("block size above max positions", edit("tokenize.block_size", 512), "maximum positions"),
    ("negative aggregation weight", edit("aggregate.weights", {"alpha": -1, "beta": 1}), "aggregate.weights"),
    ("weights summing to zero", edit("aggregate.weights", {"alpha": 0, "beta": 0}), "sum to zero"),
    ("weights naming an unknown site", edit("aggregate.weights", {"alpha": 1, "gamma": 1}), "gamma"),
    ("zero rounds", edit("federation.rounds", 0), "federation.rounds"),
    ("a wait that is no duration", edit("federation.wait", "3 weeks"), "federation.wait"),
    (
        "an unknown transfer mode",
        edit("federation.remotes", {"karolina": {"path": "me@k:/run", "transfer": "pigeon"}}),
        "federation.remotes.karolina",
    ),
    ("no sites", edit("sites", {}), "sites"),
    (
        "classification without num_labels",
        edit("task", "sequence-classification"),
        "model.num_labels: required",
    ),
    ("one label class", edit("model.num_labels", 1), "model.num_labels"),
    ("unknown task", edit("task", "translation"), "task"),
]


@pytest.mark.parametrize("mistake, change, named", BAD, ids=[b[0] for b in BAD])
def test_bad_config_fails_naming_the_key(mistake, change, named, tmp_path):
    config = demo()
    change(config)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as error:
        load_config(path, base_dir=ROOT)
    message = str(error.value)
    assert str(path) in message
    assert named in message, message


def test_config_file_problems_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broken\.yaml:2:1: not valid YAML: expected ',' or '\]'"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(scalar)


def test_validation_does_not_change_a_valid_config_twice():
    config = demo()
    once = check_config(copy.deepcopy(config), base_dir=ROOT)
    twice = check_config(copy.deepcopy(once), base_dir=ROOT)
    assert once == twice


def test_options_objects_have_exactly_the_schema_keys():
    """A key added to a section schema but not to its object (or the reverse) fails here, not in a job."""
    import dataclasses

    from fedtune.core.options import schema
    from fedtune.core.tracking_options import TrackingOptions
    from fedtune.download.options import BpeOptions, DatasetOptions, ModelOptions
    from fedtune.evaluate.options import EvaluateOptions
    from fedtune.train.options import TrainOptions

    definitions = schema()["$defs"]
    sections = {
        TrainOptions: schema(TrainOptions.SCHEMA),
        EvaluateOptions: schema(EvaluateOptions.SCHEMA),
        TrackingOptions: schema(TrackingOptions.SCHEMA),
        ModelOptions: definitions["model"],
        BpeOptions: definitions["model"]["properties"]["tokenizer"],
        DatasetOptions: definitions["dataset"],
    }
    for cls, section in sections.items():
        # TrainOptions also carries what a job reads of the run (RUN_KEYS), which no section sets.
        fields = {f.name for f in dataclasses.fields(cls)} - set(getattr(cls, "RUN_KEYS", ()))
        assert fields == set(section["properties"]), cls.__name__
    # The keys without a default are exactly the ones the object holds as None when a section leaves
    # them out.
    for cls, name in ((ModelOptions, "model"), (DatasetOptions, "dataset")):
        unset = {key for key, sub in definitions[name]["properties"].items() if "default" not in sub}
        assert unset - {"source"} == set(cls.UNSET), cls.__name__


def example_configs() -> list[Path]:
    return [DEMO, ROOT / "config" / "config.yaml", *sorted((ROOT / "config" / "examples").glob("*.yaml"))]


@pytest.mark.parametrize("path", example_configs(), ids=lambda path: path.stem)
def test_model_and_dataset_options_round_trip_through_their_json_form(path):
    """The download stage gets the model and each dataset as JSON (--options): the same object comes back,
    for the demo and every example config."""
    from fedtune.core.options import MAIN_SCHEMA, validate_section
    from fedtune.download.options import DatasetOptions, ModelOptions

    config = validate_section(yaml.safe_load(path.read_text()), MAIN_SCHEMA, source=str(path))
    model = ModelOptions.from_mapping(config["model"])
    assert ModelOptions.from_json(model.to_json()) == model
    assert model.to_dict() == {**dict.fromkeys(ModelOptions.UNSET), **config["model"]}
    for site in config["sites"].values():
        dataset = DatasetOptions.from_mapping(site["dataset"])
        assert DatasetOptions.from_json(dataset.to_json()) == dataset
        files = site["dataset"].get("data_files")
        # Each split's files as a tuple, whether the config names one file or a list.
        as_tuple = lambda v: (v,) if isinstance(v, str) else tuple(v)  # noqa: E731
        assert dataset.data_files == (files and {k: as_tuple(v) for k, v in files.items()})


def test_the_run_config_holds_the_model_and_datasets_as_frozen_options():
    import dataclasses

    from fedtune.core.options import thaw
    from fedtune.download.options import DatasetOptions, ModelOptions
    from fedtune.run.config import build_run_config

    run = build_run_config(demo(), base_dir=ROOT)
    assert isinstance(run.model, ModelOptions) and run.model.source == "init" and run.model.name is None
    assert run.model.tokenizer.vocab_size == demo()["model"]["tokenizer"]["vocab_size"]
    assert ModelOptions.from_json(run.model.to_json()) == run.model
    assert run.aggregate.dtype == run.model.dtype
    for name, site in run.sites.items():
        assert isinstance(site.dataset, DatasetOptions) and site.dataset.source == "local"
        assert DatasetOptions.from_json(site.dataset.to_json()) == site.dataset
        assert site.tokenize.text_field == site.dataset.text_field, name
    # Frozen all the way down: no field and no nested value can be set.
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model.dtype = "float16"
    with pytest.raises(TypeError):
        run.model.architecture["hidden_size"] = 8
    with pytest.raises(TypeError):
        run.sites["alpha"].dataset.data_files["train"] = ("other.jsonl",)
    architecture = thaw(run.model.architecture)
    architecture["hidden_size"] = 8  # a copy
    assert run.model.architecture["hidden_size"] == demo()["model"]["architecture"]["hidden_size"]


def test_the_json_form_fills_defaults_and_names_what_it_refuses():
    from fedtune.download.options import DatasetOptions, ModelOptions

    model = ModelOptions.from_json('{"source": "hf", "name": "org/model"}')
    assert (model.revision, model.dtype, model.path, model.allow_pickle) == ("main", "float32", None, False)
    assert model.tokenizer.vocab_size == 2048 and dict(model.architecture) == {"model_type": "llama"}
    with pytest.raises(ConfigError, match="--options: model: 'name' is a required property"):
        ModelOptions.from_json('{"source": "hf"}')
    with pytest.raises(ConfigError, match="--options: model.dtype"):
        ModelOptions.from_json('{"source": "hf", "name": "m", "dtype": "int8"}')
    dataset = DatasetOptions.from_json('{"source": "local", "data_files": {"train": "a.jsonl"}}')
    assert dataset.data_files == {"train": ("a.jsonl",)} and dataset.splits == {
        "train": "train",
        "test": "test",
    }
    with pytest.raises(ConfigError, match="--options: dataset: 'data_files' is a required property"):
        DatasetOptions.from_json('{"source": "local"}')


def test_model_rules_that_need_the_task_are_checked_when_the_config_loads():
    from fedtune.core.options import CLASSIFICATION
    from fedtune.run.config import build_run_config

    config = demo()
    config["task"] = CLASSIFICATION
    config["model"] = {"source": "gguf", "path": "model.gguf", "num_labels": 2}
    with pytest.raises(ConfigError, match="cfg: model.source: gguf: task sequence-classification is not"):
        build_run_config(config, source="cfg", base_dir=ROOT)
    config["model"] = {"source": "gguf", "path": "no/such.gguf"}
    config["task"] = "causal-lm"
    with pytest.raises(ConfigError, match="cfg: model.path: GGUF file not found: .*no/such.gguf"):
        build_run_config(config, source="cfg", base_dir=ROOT)


def test_run_config_hands_out_each_sites_merged_options():
    from fedtune.run.config import build_run_config

    config = demo()
    config["sites"]["beta"]["train"] = {"lr": 0.01}
    run = build_run_config(config, base_dir=ROOT)
    assert run.sites["beta"].train.lr == 0.01 and run.sites["alpha"].train.lr == config["train"]["lr"]
    assert (
        run.run_dir == Path(config["results"]) / config["run"]
        and run.rounds == config["federation"]["rounds"]
    )
    assert run.evaluate.max_length == config["evaluate"]["max_length"]


def test_the_scoring_jobs_options_carry_the_runs_task_and_bos_choice():
    """RUN.evaluate is what a scoring job's --options holds: the evaluate section with the run's task and
    tokenize.add_bos, so the CLI needs no flag for them; the JSON form gives the same object back."""
    import dataclasses
    import json

    from fedtune.evaluate.options import EvaluateOptions
    from fedtune.run.config import build_run_config

    config = demo()
    config["tokenize"]["add_bos"] = False
    run = build_run_config(config, base_dir=ROOT)
    assert (run.evaluate.task, run.evaluate.add_bos) == ("causal-lm", False)
    sent = run.evaluate.perplexity_json()
    assert json.loads(sent)["add_bos"] is False and "tasks" not in json.loads(sent)
    # The downstream and workflow keys are left out, so they come back as their defaults.
    assert EvaluateOptions.from_json(sent) == dataclasses.replace(run.evaluate, tasks=(), cross_site=None)


def test_remotes_and_the_wait_become_objects():
    """federation.remotes.<c>: a plain path is pulled; {path, transfer: push} is sent to. federation.wait:
    seconds or a number with a unit, 3 days by default."""
    from fedtune.core.remotes import Remote
    from fedtune.run.config import build_run_config

    config = demo()
    run = build_run_config(config, base_dir=ROOT)
    assert run.wait_s == 3 * 86400 and run.remotes == {}
    config["federation"] = {
        "wait": "90m",
        "remotes": {"leonardo": "me@leo:/run", "karolina": {"path": "me@karo:/run", "transfer": "push"}},
    }
    run = build_run_config(config, base_dir=ROOT)
    assert run.wait_s == 5400
    assert run.remotes == {"leonardo": Remote("me@leo:/run"), "karolina": Remote("me@karo:/run", "push")}
    config["federation"]["wait"] = 45
    assert build_run_config(config, base_dir=ROOT).wait_s == 45


def test_each_train_job_gets_the_runs_keys_from_the_sections_that_own_them():
    """model.dtype and allow_pickle, federation.rounds and lr_schedule, and whether the aggregate reads
    token counts reach a site's training in its TrainOptions (they were flags the rule built); the
    pooled baseline and a sweep point are one training of their own."""
    from fedtune.run.config import build_run_config
    from tests.workflow_harness import demo_config

    config = demo_config()
    config["model"]["dtype"] = "bfloat16"
    config["federation"].update(rounds=3, lr_schedule="restart", pooled_baseline=True)
    config["aggregate"] = {"vocab_rows": "weights"}
    config["sweep"] = {"axis": "lr", "values": [0.01]}
    run = build_run_config(config)
    keys = ("dtype", "allow_pickle", "rounds", "lr_schedule", "token_counts")
    for site in run.sites.values():
        assert [getattr(site.train, k) for k in keys] == ["bfloat16", False, 3, "restart", False]
    for single in (run.pooled, run.sweep[0].options):
        assert [getattr(single, k) for k in keys] == ["bfloat16", False, 1, "continue", True]
    assert run.sweep[0].options.lr == 0.01
