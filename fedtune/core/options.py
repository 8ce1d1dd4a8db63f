"""What every stage's options module builds on: the schemas (fedtune/schemas, the single source of truth
for keys, types and defaults) and their default-filling validation, the user errors, the rules a schema
cannot express that several stages call, and `_Options`, the frozen options objects' JSON form (the
rule -> CLI boundary).

The stages' options live beside them (fedtune/<stage>/options.py); fedtune.run.config composes them
into the run's config. This module sits below both, so it imports nothing from fedtune and no torch at
import time (Snakemake's start-up stays fast)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.resources
import json
import math
import string
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
import yaml
from referencing import Registry
from referencing.jsonschema import DRAFT202012

# Shipped inside the package (an installed fedtune validates configs too); workflow/schemas links here.
SCHEMAS = importlib.resources.files("fedtune") / "schemas"
MAIN_SCHEMA = "config.schema.yaml"

# The two tasks (config `task`); every stage names them through these.
CAUSAL_LM = "causal-lm"
CLASSIFICATION = "sequence-classification"
TASKS = (CAUSAL_LM, CLASSIFICATION)

# Weight dtypes by name, and the low-precision dtype of each training precision.
DTYPES = ("float32", "bfloat16", "float16")
PRECISION_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}

# config.json keys that hold a model's longest sequence, by architecture family.
MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


class UserError(ValueError):
    """A mistake the user can fix (a config key, an option, a file): one line that names it. Every
    stage's own error class derives from it, so a CLI reports them all alike (exit code 2)."""


class ConfigError(UserError):
    """A user error in the config: the message names the file and the key to fix."""


def torch_dtype(name: str):
    """The torch dtype of a name in DTYPES (imports torch: call it from stage code only)."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype: {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


# ---------------------------------------------------------------------------------------------------
# Schema validation


def _load_yaml(path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@functools.cache
def _registry() -> Registry:
    resources = []
    for path in sorted(
        (p for p in SCHEMAS.iterdir() if p.name.endswith(".schema.yaml")), key=lambda p: p.name
    ):
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
    return _load_yaml(SCHEMAS / name)


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
    if error.validator == "type" and isinstance(error.instance, str) and _number_text(error.instance):
        # YAML 1.1 (PyYAML, Snakemake) reads 3e-3 as a string: a float needs a dot and a signed exponent.
        number = float(error.instance)
        wanted = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        floats = "number" in wanted and "e" in error.instance.lower()
        forms = [_decimal(number)] + ([_yaml_float(number)] if floats else [])
        return (
            f"{error.instance!r} is a string, not a number (YAML reads e-notation as a number only with a dot "
            f"and a signed exponent): write {' or '.join(forms)}"
        )
    if error.validator == "not" and set(error.schema.get("not", {})) == {"enum"}:
        # sites' propertyNames: a site name that is also a folder or a model of the run (config.schema.yaml).
        why = RESERVED_SITE_NAMES.get(error.instance)
        if why:
            return f"{error.instance!r} is reserved as a site's name: {why}; name the site otherwise"
    return error.message


def _number_text(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return text.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")


def _decimal(number: float) -> str:
    """The number written out without an exponent: 0.003, 1000."""
    from decimal import Decimal

    return str(int(number)) if number.is_integer() else format(Decimal(repr(number)), "f")


def _yaml_float(number: float) -> str:
    """The e-notation YAML 1.1 reads as a float: 3.0e-3."""
    mantissa, exponent = f"{number:e}".split("e")
    mantissa = mantissa.rstrip("0")
    return f"{mantissa}{'0' if mantissa.endswith('.') else ''}e{int(exponent):+d}"


# Why each reserved site name is reserved (config.schema.yaml's sites.propertyNames lists the same names;
# tests/test_first_hour.py checks they agree): a site's name is a folder of the run folder and a model's
# name in the report, beside these.
RESERVED_SITE_NAMES = {
    "aggregate": "it names the merged model (round-<r>/aggregate/, the report's aggregate row)",
    "base": "it names the base model (model/base, eval/base/, the report's base row)",
    "pooled": "it names the pooled baseline (pooled/, pooled/eval/<site>.json, the report's pooled row)",
    "compare": "round-<r>/compare/ holds the models of aggregate.compare beside the sites' round-<r>/<site>/",
    "eval": "round-<r>/eval/ holds the round's scores beside the sites' round-<r>/<site>/",
    "tasks": "eval/tasks/ and round-<r>/eval/tasks/ hold the downstream task scores beside each model's",
}


def validate_section(data: Any, schema_name: str, *, source: str, prefix: str = "") -> Any:
    """Validate `data` against one schema file, filling defaults in place; raise ConfigError naming
    `source` (a file or a CLI option) and the key path of the first problem."""
    _check_finite(data, source, [prefix] if prefix else [])
    validator = _validator(schema_name)
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(list(e.absolute_path)), e.message))
    if errors:
        err = errors[0]
        # The deepest cause names the key that is wrong, not the oneOf/anyOf that wraps it.
        while err.context:
            err = sorted(err.context, key=lambda e: -len(list(e.absolute_path)))[0]
        raise ConfigError(f"{source}: {_key_path(err, prefix)}: {_explain(err)}")
    return data


def _check_finite(value: Any, source: str, path: list[str]) -> None:
    """Refuse NaN and infinities wherever the config holds a number (YAML's .nan and .inf, JSON's NaN and
    Infinity): JSON Schema compares them without complaint (NaN is below no minimum), and a NaN learning
    rate trains silently. One walk over every value, before the schema's checks."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {'.'.join(path) or '(top level)'}: {value!r} is not a finite number")
    if isinstance(value, Mapping):
        for key, item in value.items():
            _check_finite(item, source, [*path, str(key)])
    elif isinstance(value, (list, tuple)):
        for k, item in enumerate(value):
            _check_finite(item, source, [*path, str(k)])


def deep_merge(base: Mapping, override: Mapping) -> dict:
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: not valid JSON: {e}") from None


# ---------------------------------------------------------------------------------------------------
# Rules a schema cannot express, each written once; the stages call these.


def check_template(template: str, where: str) -> None:
    """A prompt template is a format string whose only field is {text}."""
    if "{text}" not in template:
        raise ConfigError(f"{where}: {template!r} does not contain {{text}}")
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ConfigError(f"{where}: {template!r} is not a valid format string: {e}") from None
    extra = fields - {"text"}
    if extra:
        raise ConfigError(
            f"{where}: {template!r} uses {sorted(extra)}; only {{text}} is filled in "
            "(write literal braces as {{ and }})"
        )


def max_positions(model_config: Mapping) -> int | None:
    """The longest sequence a model takes, from its config.json values or an `architecture` section."""
    for key in MAX_POSITION_KEYS:
        if isinstance(model_config.get(key), int):
            return model_config[key]
    return None


def check_fits(length: int, model_config: Mapping, where: str, origin: str) -> None:
    """A block or window of `length` tokens must fit the model's position embeddings; `origin` says
    where the model's config came from."""
    limit = max_positions(model_config)
    if limit is not None and length > limit:
        raise ConfigError(f"{where}: {length} exceeds the model's maximum positions ({limit}) in {origin}")


def label_problem(values, num_labels: int) -> str | None:
    """Why a label column cannot be a classifier's targets (classes 0..num_labels-1), or None."""
    import numpy as np

    values = np.asarray(values)
    if not len(values):
        return None
    if not np.issubdtype(values.dtype, np.integer):
        return (
            f"holds {values.dtype} values, not class numbers (first: {values[:3].tolist()}); "
            f"map them to 0..{num_labels - 1} first"
        )
    bad = np.flatnonzero((values < 0) | (values >= num_labels))
    if len(bad):
        return (
            f"row {int(bad[0])} has label {int(values[bad[0]])}, outside 0..{num_labels - 1} "
            f"(the model has {num_labels} classes)"
        )
    return None


def check_weights(weights: Mapping[str, float], sites: Sequence[str], where: str) -> None:
    """Explicit aggregation weights name every site once and do not sum to zero."""
    unknown = sorted(set(weights) - set(sites))
    missing = sorted(set(sites) - set(weights))
    if unknown or missing:
        raise ConfigError(f"{where}: must name every site once; unknown: {unknown}, missing: {missing}")
    if sum(weights.values()) <= 0:
        raise ConfigError(f"{where}: the weights sum to zero")


def check_global_batch(global_batch: int, micro_batch: int, world_size: int, where: str) -> None:
    """Gradient accumulation must be whole: global_batch = micro_batch x world size x accumulation."""
    unit = micro_batch * world_size
    if global_batch % unit:
        below = max(unit, global_batch // unit * unit)
        raise ConfigError(
            f"{where}: {global_batch} must be a multiple of micro_batch ({micro_batch}) "
            f"x world size ({world_size}) = {unit}, so that gradient accumulation steps are whole; "
            f"use global_batch {below} or {below + unit}, or change micro_batch"
        )


# ---------------------------------------------------------------------------------------------------
# Typed options


def freeze(value):
    """A JSON value that cannot change: mappings become read-only views, lists tuples (all the way down)."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def thaw(value):
    """Plain JSON values (dicts, lists) of an options object or a frozen value, nested ones included: the
    JSON form, and what a library that wants a dict gets (transformers' configs, a JSON record)."""
    if isinstance(value, _Options):
        return {f.name: thaw(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(item) for item in value]
    return value


class _Options:
    """The JSON form shared by the options objects: the rule -> CLI boundary."""

    SCHEMA: str = ""
    PREFIX: str = ""  # where the section stands in a config, for messages
    # Keys without a schema default: absent from a section, None in the object and null in the JSON form.
    UNSET: tuple[str, ...] = ()

    def to_json(self) -> str:
        return json.dumps(thaw(self), separators=(",", ":"))

    def to_dict(self) -> dict:
        """The JSON form as plain values (lists, not tuples), as the config file writes them."""
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, text: str, *, source: str = "--options"):
        return cls.from_mapping(parse_json(text, source), source=source)

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--options", prefix: str | None = None):
        """From a section as a config or --options writes it: checked by the schema, defaults filled in."""
        return cls.from_valid(cls._validated(data, source, cls.PREFIX if prefix is None else prefix))

    @classmethod
    def from_valid(cls, values: Mapping):
        """From values the schema has checked and filled in already (UNSET keys None)."""
        return cls(**values)

    @classmethod
    def _validated(cls, data: Mapping, source: str, prefix: str) -> dict:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {prefix or 'options'}: expected a mapping, got {data!r}")
        data = {key: value for key, value in data.items() if not (key in cls.UNSET and value is None)}
        values = validate_section(thaw(data), cls.SCHEMA, source=source, prefix=prefix)
        return {**dict.fromkeys(cls.UNSET), **values}
