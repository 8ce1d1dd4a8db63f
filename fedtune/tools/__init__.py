"""The user's tools around a run, run from a checkout of the repository: `python -m fedtune.tools.twin`
(scripts/twin: a scaled-down twin of an example config), `python -m fedtune.tools.rehearsal`
(scripts/rehearse: the two-cluster run on one machine, over `fedtune.tools.local_sshd`)."""
