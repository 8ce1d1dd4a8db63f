# plan: where jobs run and what the run asks for, at the end of a dry run (fedtune.report.plan).
# Included last, when every rule is defined.

# Rules that run in the controller on the login node (localrule, and the downloads unless the profile
# makes them Slurm jobs) take none of the profile's Slurm defaults: a dry run would list them with a
# partition and a time limit they never get (a fetch may wait for days). None drops a resource.
SLURM_ONLY = (
    "slurm_account",
    "slurm_partition",
    "slurm_extra",
    "runtime",
    "qos",
    "constraint",
    "gres",
    "nodes",
    "tasks",
    "cpus_per_task",
)
# Snakemake keeps the rules marked local (localrule: True) in this set; it has no public reader.
LOGIN_NODE_RULES = set(workflow._localrules)
for _rule in workflow.rules:
    if _rule.name in LOGIN_NODE_RULES or _rule.norun:
        for _name in SLURM_ONLY:
            if _name in _rule.resources:
                _rule.resources[_name] = None


if not workflow.remote_exec:
    import atexit

    from fedtune.report.plan import print_dry_run_summary

    # Snakemake runs no onstart/onsuccess handler in a dry run; the planned DAG is there at exit.
    atexit.register(
        print_dry_run_summary, workflow, RUN, base_model_dir(), LOGIN_NODE_RULES
    )
