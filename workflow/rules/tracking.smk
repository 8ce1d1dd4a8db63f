# Experiment tracking (fedtune.tracking): the stage CLIs' options from the config's tracking section.


def tracking_args():
    """`--tracking JSON --run NAME` for a stage CLI (dir resolved: tracking.dir or <run>/tracking), or
    nothing when tracking is off. Params use it through a function: the JSON's braces are no wildcards.
    """
    options = config["tracking"]
    if options["backend"] == "none":
        return ""
    resolved = dict(options, dir=options["dir"] or run_path("tracking"))
    return f"--tracking {shlex.quote(to_json(resolved))} --run {shlex.quote(config['run'])}"
