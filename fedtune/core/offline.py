"""Keep compute-node stages off the network: only `download` may reach the Hugging Face hub."""

import os

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def enforce() -> None:
    """Set the offline switches. Call before importing huggingface_hub, datasets or transformers:
    they read these variables once, at import."""
    for name in OFFLINE_VARIABLES:
        os.environ[name] = "1"
