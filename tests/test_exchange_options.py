"""federation.exchange as ExchangeOptions: checked by the schema's choices and limits, its defaults the
schema's, its JSON form unchanged."""

from __future__ import annotations

import pytest

from fedtune.core.exchange_options import ExchangeOptions
from fedtune.core.options import ConfigError, schema


def test_the_defaults_are_the_schemas():
    properties = schema()["properties"]["federation"]["properties"]["exchange"]["properties"]
    assert ExchangeOptions().to_dict() == {key: value["default"] for key, value in properties.items()}


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"dtype": "int3"}, "federation.exchange.dtype"),
        ({"scale": "column"}, "federation.exchange.scale"),
        ({"block_size": 4}, "federation.exchange.block_size"),
        ({"block_size": 65537}, "federation.exchange.block_size"),
        ({"block_size": True}, "federation.exchange.block_size"),
        ({"codec": "zstd"}, "federation.exchange"),
    ],
)
def test_the_schema_refuses_what_it_does_not_allow(options, key):
    with pytest.raises(ConfigError, match=f"--options: {key}"):
        ExchangeOptions.from_mapping(options)


def test_the_json_form_round_trips_and_keeps_its_text():
    options = ExchangeOptions(dtype="int8", scale="row", block_size=65536)
    assert (
        options.to_json() == '{"block_size": 65536, "dtype": "int8", "error_feedback": true, "scale": "row"}'
    )
    assert ExchangeOptions.from_json(options.to_json()) == options
