"""How a site's text becomes blocks (config.schema.yaml#/$defs/tokenize): TokenizeOptions, what
`python -m fedtune.tokenize shard --options` reads. Torch-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedtune.core.options import CAUSAL_LM, TASKS, ConfigError, _Options, check_template


@dataclass(frozen=True)
class TokenizeOptions(_Options):
    """How one site's text becomes blocks: the tokenize section (config.schema.yaml#/$defs/tokenize), with
    the site's prompt template and columns and the run's task (`python -m fedtune.tokenize shard`)."""

    SCHEMA = "config.schema.yaml#/$defs/tokenize"
    SITE_KEYS = ("task", "template", "text_field", "label_field")

    block_size: int
    mode: str
    shards: int
    add_bos: bool
    task: str = CAUSAL_LM
    template: str = "{text}"
    text_field: str = "text"
    label_field: str = "label"

    @classmethod
    def from_mapping(cls, data: Mapping, *, source: str = "--options", prefix: str = "") -> TokenizeOptions:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {prefix or 'options'}: expected a mapping, got {data!r}")
        section = {k: v for k, v in data.items() if k not in cls.SITE_KEYS}
        site = {k: v for k, v in data.items() if k in cls.SITE_KEYS}
        options = cls(**cls._validated(section, source, prefix), **site)
        options.check(f"{source}: {prefix + '.' if prefix else ''}")
        return options

    def check(self, where: str) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"{where}task: {self.task!r} is not one of {', '.join(TASKS)}")
        for key in ("text_field", "label_field"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ConfigError(f"{where}{key}: {getattr(self, key)!r} is not a column name")
        check_template(self.template, f"{where}template")

    def for_site(self, template: str, dataset: Any) -> TokenizeOptions:
        """These options with a site's prompt template and its dataset's columns (a DatasetOptions)."""
        return dataclasses.replace(
            self, template=template, text_field=dataset.text_field, label_field=dataset.label_field
        )
