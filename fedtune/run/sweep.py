"""The scaling sweep (config `sweep`, fedtune/schemas/sweep.schema.yaml): one site's training at each value
of an axis (a device count or a train key), each point its own folder."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedtune.core.options import ConfigError, schema, validate_section
from fedtune.train.options import TrainOptions, train_run_keys

DEVICES_AXIS = "devices"


@dataclass(frozen=True)
class SweepPoint:
    """One value of a scaling sweep: its folder label and the swept site's train options with it."""

    label: str
    value: Any
    options: TrainOptions


def sweep_label(axis: str, value) -> str:
    """A folder name for one value: `devices-4`, `precision-fp16`, `gradient_checkpointing-true`."""
    text = json.dumps(value) if isinstance(value, bool) else str(value)
    return f"{axis}-{re.sub(r'[^A-Za-z0-9._-]+', '_', text)}"


def _device_options(base: dict, value, where: str) -> dict:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {value!r} is not a device count (a whole number, at least 1)")
    per_node = base["processes_per_node"]
    nodes = -(-value // per_node)
    # A partly filled last node would give a different world size than asked for.
    if nodes > 1 and value % per_node:
        raise ConfigError(
            f"{where}: {value} devices do not fill whole nodes of {per_node} (the site's processes_per_node); "
            f"use a multiple of {per_node}"
        )
    if nodes > 1 and base["launcher"] == "local":
        raise ConfigError(
            f"{where}: {value} devices need {nodes} nodes of {per_node}, but the site's launcher is local "
            "(one machine); set train.launcher to torchrun or srun"
        )
    options = {**base, "nodes": nodes, "processes_per_node": min(value, per_node)}
    if base["gpus_per_node"]:
        options["gpus_per_node"] = min(value, base["gpus_per_node"])
    return options


def sweep_points(config: Mapping, site: str, base: TrainOptions, source: str) -> tuple[SweepPoint, ...]:
    """The sweep's values in the order given, each the swept site's options with the axis set."""
    sweep = config["sweep"]
    axis = sweep["axis"]
    train_keys = schema("train.schema.yaml")["properties"]
    if axis != DEVICES_AXIS and axis not in train_keys:
        raise ConfigError(
            f"{source}: sweep.axis: {axis!r} is neither devices nor a train key ({', '.join(train_keys)})"
        )
    points: dict[str, SweepPoint] = {}
    for i, value in enumerate(sweep["values"]):
        where = f"{source}: sweep.values[{i}]"
        if axis == DEVICES_AXIS:
            values = _device_options(base.to_dict(), value, where)
        else:
            values = {**base.to_dict(), axis: value}
        section = {k: v for k, v in values.items() if k not in TrainOptions.RUN_KEYS}
        validate_section(section, TrainOptions.SCHEMA, source=source, prefix=f"sweep.values[{i}]")
        options = dataclasses.replace(
            TrainOptions.from_valid(values), **train_run_keys(config, federated=False)
        )
        options.check(f"{where} ({axis} {value!r}): ")
        label = sweep_label(axis, value)
        if label in points:
            raise ConfigError(f"{where}: {value!r} gives the folder name {label} of an earlier value")
        points[label] = SweepPoint(label, value, options)
    return tuple(points.values())
