"""Loading and validating a fedtune config: the JSON schemas in workflow/schemas are the single source
of truth for keys, types and defaults; this module adds the checks a schema cannot express (files that
must exist, a template that must format) and the merging of per-site train overrides."""

from __future__ import annotations

import copy
import functools
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry
from referencing.jsonschema import DRAFT202012

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "workflow" / "schemas"
MAIN_SCHEMA = "config.schema.yaml"


class ConfigError(ValueError):
    """A user error in the config: the message names the file and the key to fix."""


def _load_yaml(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


@functools.cache
def _registry() -> Registry:
    resources = []
    for path in sorted(SCHEMA_DIR.glob("*.schema.yaml")):
        # Section schemas carry no $schema of their own, so that $ref keeps the default-filling validator.
        resources.append((path.name, DRAFT202012.create_resource(_load_yaml(path))))
    return Registry().with_resources(resources)


def _with_defaults(validator_class):
    """A validator that fills in `default` values while it validates (the jsonschema FAQ recipe),
    following $ref into the other schema files."""
    validate_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, subschema in properties.items():
                if "default" in subschema and name not in instance:
                    instance[name] = copy.deepcopy(subschema["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return jsonschema.validators.extend(validator_class, {"properties": set_defaults})


_DefaultFilling = _with_defaults(jsonschema.Draft202012Validator)


@functools.cache
def _validator(schema_name: str):
    return _DefaultFilling(schema(schema_name), registry=_registry())


def schema(name: str = MAIN_SCHEMA) -> dict:
    """A schema file by name, or a part of one by reference ("config.schema.yaml#/$defs/dataset")."""
    if "#" in name:
        return {"$ref": name}
    return _load_yaml(SCHEMA_DIR / name)


def _key_path(error: jsonschema.ValidationError, prefix: str) -> str:
    parts = [prefix] if prefix else []
    parts += [str(p) for p in error.absolute_path]
    return ".".join(parts) or "(top level)"


def _explain(error: jsonschema.ValidationError) -> str:
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        return f"{error.message}; allowed keys: {', '.join(allowed)}"
    if error.validator == "pattern" and error.schema.get("pattern") == "\\{text\\}":
        return f"{error.instance!r} does not contain the placeholder {{text}}"
    return error.message


def validate_section(data: Any, schema_name: str, *, source: str, prefix: str = "") -> Any:
    """Validate `data` against one schema file, filling defaults in place; raise ConfigError naming
    `source` (a file or a CLI option) and the key path of the first problem."""
    validator = _validator(schema_name)
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(list(e.absolute_path)), e.message))
    if errors:
        err = errors[0]
        # The deepest cause names the key that is wrong, not the oneOf/anyOf that wraps it.
        while err.context:
            err = sorted(err.context, key=lambda e: -len(list(e.absolute_path)))[0]
        raise ConfigError(f"{source}: {_key_path(err, prefix)}: {_explain(err)}")
    return data


def deep_merge(base: Mapping, override: Mapping) -> dict:
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def site_train_options(config: Mapping, site: str, *, source: str = "config") -> dict:
    """The train section with the site's overrides merged over it, validated."""
    options = deep_merge(config.get("train", {}), config["sites"][site].get("train", {}))
    return validate_section(options, "train.schema.yaml", source=source, prefix=f"sites.{site}.train")


def _check_template(template: str, where: str, source: str) -> None:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"{source}: {where}: {template!r} is not a valid format string: {e}") from None
    extra = fields - {"text"}
    if extra:
        raise ConfigError(
            f"{source}: {where}: {template!r} uses {sorted(extra)}; only {{text}} is filled in "
            "(write literal braces as {{ and }})"
        )


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def check_config(config: dict, *, source: str = "config", base_dir: Path | None = None) -> dict:
    """Schema validation plus the checks a schema cannot express. Returns the config with defaults."""
    validate_section(config, MAIN_SCHEMA, source=source)
    base_dir = Path(base_dir or ".")
    model = config["model"]
    if config["task"] == "sequence-classification" and model["num_labels"] is None:
        raise ConfigError(f"{source}: model.num_labels: required for task sequence-classification")
    if model["source"] == "local":
        path = base_dir / model["path"]
        if not (path / "config.json").is_file():
            raise ConfigError(f"{source}: model.path: {path} holds no config.json (a save_pretrained folder)")
    for name, site in config["sites"].items():
        _check_template(site["prompt_template"], f"sites.{name}.prompt_template", source)
        dataset = site["dataset"]
        if dataset["source"] == "local":
            for split, files in dataset["data_files"].items():
                for file in _as_list(files):
                    if not (base_dir / file).is_file():
                        raise ConfigError(
                            f"{source}: sites.{name}.dataset.data_files.{split}: file not found: {file}"
                        )
        site_train_options(config, name, source=source)
    if isinstance(config["aggregate"]["weights"], dict):
        weights = config["aggregate"]["weights"]
        unknown = sorted(set(weights) - set(config["sites"]))
        missing = sorted(set(config["sites"]) - set(weights))
        if unknown or missing:
            raise ConfigError(
                f"{source}: aggregate.weights: must name every site once; unknown: {unknown}, missing: {missing}"
            )
        if sum(weights.values()) <= 0:
            raise ConfigError(f"{source}: aggregate.weights: the weights sum to zero")
    architecture = model["architecture"]
    max_positions = architecture.get("max_position_embeddings", architecture.get("n_positions"))
    if max_positions is not None and config["tokenize"]["block_size"] > max_positions:
        raise ConfigError(
            f"{source}: tokenize.block_size: {config['tokenize']['block_size']} exceeds "
            f"model.architecture.max_position_embeddings ({max_positions})"
        )
    from fedtune.sweep import sweep_points  # here, not at the top: fedtune.sweep imports this module

    sweep_points(config, source=source)
    return config


def load_config(path: str | Path, *, base_dir: Path | None = None) -> dict:
    path = Path(path)
    try:
        config = _load_yaml(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys to values")
    return check_config(config, source=str(path), base_dir=base_dir)
