"""Hub tokens come from the environment only, and never reach a log: anything the download stage
prints passes through `redact`."""

from __future__ import annotations

import os
import re

TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_TOKEN")
# The shape of Hugging Face user access tokens, for tokens that did not come from our environment.
TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{20,}")
MASK = "hf_***"


def redact(text: str) -> str:
    for name in TOKEN_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= 8:
            text = text.replace(value, MASK)
    return TOKEN_PATTERN.sub(MASK, text)
