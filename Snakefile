# fedtune: federated fine-tuning of an LLM across HPC sites.
# Stages: download -> tokenize -> train -> aggregate -> evaluate -> report (docs/design.md).
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/tokenize.smk"


rule all:
    default_target: True
    input:
        get_final_output(),
