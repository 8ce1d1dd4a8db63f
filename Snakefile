# fedtune: federated fine-tuning of an LLM across HPC sites.
# Stages: download -> tokenize -> train -> aggregate -> evaluate -> report (docs/design.md).
from snakemake.utils import min_version

min_version("9.0")


# The demo config, unless the user names one: Snakemake would otherwise merge the two.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/download.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/exchange.smk"
include: "workflow/rules/sweep.smk"
include: "workflow/rules/transfer.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/adapters.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/plan.smk"


rule all:
    default_target: True
    input:
        # A function: called while the DAG is built, it also prints the Slurm jobs per round.
        get_final_output,
