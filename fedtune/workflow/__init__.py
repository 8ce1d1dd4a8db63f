"""The Snakemake workflow's policy (workflow/rules/*.smk wire files to CLIs): layout, commands, resources."""
