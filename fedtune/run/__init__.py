"""The run as a whole, above the stages: its config composed from the stages' options (config), the
scaling sweep's and the pooled baseline's trainings (sweep, pooled), which model is scored where (scoring),
what crosses between clusters (crossings), and the start checks of a Snakemake start (start_checks)."""
