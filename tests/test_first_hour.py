"""The first hour on one machine has no traps (issue 48, part 2): each mistake a newcomer made following
the README is refused at start with one line that says what to do, and the docs say what the code does.
The report's figures are checked in tests/test_report.py, test_cost.py and test_plan.py."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
import yaml

from fedtune.core.clusters import site_clusters
from fedtune.core.config_files import configfile_problem
from fedtune.core.options import RESERVED_SITE_NAMES, ConfigError
from fedtune.run.config import build_run_config
from fedtune.run.start_checks import cluster_profile_problem, placeholder_problem, profile_clusters

from .test_start_errors import printed, refused
from .workflow_harness import ROOT, VENV_BIN, demo_config, snakemake, write_config

LLAMA2 = ROOT / "config" / "examples" / "llama2-it-cs.yaml"
EXAMPLES = sorted((ROOT / "config" / "examples").glob("llama2-*.yaml"))


# 1. A cluster's config on profiles/local.


def test_the_cluster_profiles_are_those_that_set_a_cluster():
    """Each GPU cluster's file (scripts/clusters/<name>.sh) has its profile, profiles/<name>, which sets it."""
    assert profile_clusters(ROOT / "profiles") == {name: name for name in site_clusters()}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.stem)
def test_a_cluster_config_without_its_clusters_profile_names_the_twin(example):
    run = build_run_config(yaml.safe_load(example.read_text()), source=str(example), base_dir=ROOT)
    message = cluster_profile_problem(run, ROOT / "profiles", "config/examples/" + example.name)
    assert message is not None and "\n" not in message
    assert "sites.it.cluster: leonardo, sites.cs.cluster: karolina" in message, message
    assert "--profile profiles/karolina, --profile profiles/leonardo" in message, message
    assert (
        f"`scripts/twin config/examples/{example.name} --assets results/twins --out "
        f"results/twins/{example.stem}.yaml && snakemake --profile profiles/local --configfile "
        f"results/twins/{example.stem}.yaml`"
    ) in message, message


def test_a_config_of_this_machine_or_under_its_clusters_profile_passes():
    """The demo (sites on `local`), slurm-local's sites, and the example under its clusters' profiles."""
    demo = build_run_config(demo_config(), base_dir=ROOT)
    assert cluster_profile_problem(demo, ROOT / "profiles", "config.yaml") is None
    slurm_local = demo_config()
    for site in slurm_local["sites"].values():
        site["cluster"] = "slurm-local"
    run = build_run_config(slurm_local, base_dir=ROOT)
    assert cluster_profile_problem(run, ROOT / "profiles", "config.yaml") is None
    example = yaml.safe_load(LLAMA2.read_text())
    for cluster in ("leonardo", "karolina"):
        run = build_run_config({**copy.deepcopy(example), "cluster": cluster}, base_dir=ROOT)
        assert cluster_profile_problem(run, ROOT / "profiles", str(LLAMA2)) is None


def test_the_llama2_example_on_profiles_local_is_refused_at_its_dry_run(tmp_path):
    """It used to plan "271 jobs, all on this machine", and the real run failed 34 s in, at the hub."""
    (tmp_path / "config.yaml").write_text(LLAMA2.read_text())
    result = snakemake(tmp_path, "-n", "--quiet", "rules", check=False, timeout=180)
    output = printed(result)
    assert result.returncode != 0, output[-2000:]
    assert "but this run names no cluster" in output and "scripts/twin" in output, output[-2000:]
    assert "Building DAG" not in output and "jobs, all on this machine" not in output


# 2. scripts/rehearse installs nothing.


def test_the_rehearsal_without_sshd_says_what_to_install_and_installs_nothing(monkeypatch, capsys, tmp_path):
    from fedtune.tools import rehearsal

    monkeypatch.setattr(rehearsal, "find_sshd", lambda: None)

    def no_process(*args, **kwargs):
        raise AssertionError(f"the rehearsal ran {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "run", no_process)
    monkeypatch.setattr(subprocess, "Popen", no_process)
    assert rehearsal.main(["--out", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert "no sshd on this machine" in said and "sudo apt-get install openssh-server" in said, said
    assert "--dry-run` needs no sshd" in said


def test_the_rehearsal_never_calls_apt_get():
    """The one apt-get of the test harness (tests/ssh_harness.py, for CI) is not on the rehearsal's path:
    the rehearsal checks for sshd itself, first, and its sshd (fedtune.tools.local_sshd) installs nothing."""
    tools = ROOT / "fedtune" / "tools"
    for path in (tools / "rehearsal.py", tools / "local_sshd.py"):
        source = path.read_text()
        assert 'apt-get", "install' not in source and '["apt-get"' not in source, path
    source = (tools / "rehearsal.py").read_text()
    main = source[source.index("def main(") :]
    assert main.index("sshd = find_sshd()") < main.index("if sshd is None") < main.index("start_sshd(")


SNAKEMAKE_LOG = """\
Building DAG of jobs...
Job stats:
[Sat Nov 28 19:13:58 2026]
localrule download_data:
    output: results/rehearsal/data/it/raw
    log: results/rehearsal/logs/download_data/it.log
    jobid: 4
    reason: Missing output files: results/rehearsal/data/it/raw
    wildcards: site=it
    resources: tmpdir=/tmp
[Sat Nov 28 19:13:59 2026]
Finished jobid: 4 (Rule: download_data)
1 of 41 steps (2%) done
[Sat Nov 28 19:14:01 2026]
rule train:
    input: results/rehearsal/model/base
    jobid: 9
    wildcards: round=1, site=it
"""


def test_the_rehearsal_shows_each_controllers_progress():
    from fedtune.tools.rehearsal import progress

    assert progress("leo", "Building DAG of jobs...\n") is None
    assert progress("leo", SNAKEMAKE_LOG) == "leo: 1 of 41 jobs done; latest: train (round=1, site=it)"


def test_the_rehearsal_prints_a_line_whenever_a_controller_moves_on(tmp_path, capsys):
    from fedtune.tools.rehearsal import wait_showing_progress

    class Finished:
        def poll(self):
            return 0

    log = tmp_path / "controller.log"
    log.write_text(SNAKEMAKE_LOG)
    wait_showing_progress({"leo": Finished()}, {"leo": log, "karo": tmp_path / "none.log"}, every=0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].endswith("leo: 1 of 41 jobs done; latest: train (round=1, site=it)")


# 3. Raw or vague errors.


def test_a_target_after_configfile_is_refused_in_one_line(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text("run: demo\n")
    # A run no `make demo` before the tests has made: the check looks for the name from the working folder.
    target = "results/no-such-run/data/it/manifest.json"
    message = configfile_problem(["-n", "--configfile", str(config), target])
    assert message == (
        f"--configfile {target}: no such file; Snakemake reads every name after --configfile as a config "
        f"file: put targets before it, `snakemake ... {target} --configfile {config}`"
    )
    assert "put targets before it" in configfile_problem(
        ["--configfile", str(config), "results/no-such-run/report"]
    )


def test_a_configfile_that_is_not_there_is_refused_in_one_line(tmp_path):
    assert configfile_problem(["--configfile", str(tmp_path / "nope.yaml")]) == (
        f"--configfile {tmp_path / 'nope.yaml'}: no such file"
    )
    assert configfile_problem(["--configfile"]).startswith("--configfile names no file")
    assert configfile_problem(["--configfile", "--cores", "1"]).startswith("--configfile names no file")


@pytest.mark.parametrize("where", ["target after it", "missing file"])
def test_snakemake_says_it_in_one_line_not_a_traceback(where, tmp_path):
    """Both ended in a 27-line FileNotFoundError traceback of Snakemake's config loading."""
    write_config(tmp_path, demo_config())
    extra = ["results/demo/data/alpha/raw"] if where == "target after it" else []
    config = str(tmp_path / ("config.yaml" if extra else "absent.yaml"))
    command = [f"{VENV_BIN}/snakemake", "--snakefile", str(ROOT / "Snakefile"), "--directory", str(tmp_path),
               "--profile", str(ROOT / "profiles" / "local"), "-n", "--configfile", config, *extra]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, printed(result)[-2000:]
    assert "Traceback" not in printed(result), printed(result)[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --configfile ") and "no such file" in last, last
    assert ("put targets before it" in last) == bool(extra), last


@pytest.mark.parametrize(
    ("key", "text", "says"),
    [
        ("lr", "3e-3", "write 0.003 or 3.0e-3"),
        ("lr", "1e-4", "write 0.0001 or 1.0e-4"),
        ("max_steps", "1e3", "write 1000"),
    ],
)
def test_a_number_yaml_reads_as_a_string_says_how_to_write_it(key, text, says, tmp_path):
    """`lr: 3e-3` is a string to YAML 1.1; the message names the key and the two ways to write it."""
    config = demo_config()
    config["train"][key] = yaml.safe_load(f"{key}: {text}")[key]
    assert config["train"][key] == text  # YAML read a string
    message = refused(config)
    assert message.startswith(f"my.yaml: train.{key}: '{text}' is a string, not a number"), message
    assert message.endswith(says), message
    if key == "lr":
        written = says.removeprefix("write ").split(" or ")
        assert all(isinstance(yaml.safe_load(f"x: {w}")["x"], float) for w in written)


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE=1", "no network"])
def test_an_uncached_hub_model_offline_is_named_and_the_machine_called_offline(offline, tmp_path):
    """It failed with "ConnectError: Name or service not known", naming neither the model nor the cause."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(ROOT))
    if offline == "HF_HUB_OFFLINE=1":
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens: refused at once, as offline
    code = (
        "from fedtune.download.hub_model import snapshot\n"
        "try:\n    snapshot('someone/not-cached-model', 'main')\n"
        "except Exception as error:\n    print(type(error).__name__, error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    said = result.stdout.strip()
    assert said.startswith("HubModelError model.name: someone/not-cached-model@main is not in the Hugging Face "
                           f"cache here ({tmp_path / 'hf' / 'hub'})"), said  # fmt: skip
    assert ("HF_HUB_OFFLINE is set" if offline.startswith("HF") else "it is offline") in said, said
    assert "`hf download someone/not-cached-model`" in said and "\n" not in said


def test_the_docs_list_every_profile_a_path_takes():
    """A wrong profile name gets Snakemake's own message, printed before any fedtune code runs; docs/running.md
    lists the profiles instead, and the README this machine's two and `profiles/<cluster>` with a link there
    (a new cluster is listed once: docs/design.md, "Adding a cluster")."""
    profiles = sorted(path.parent.name for path in (ROOT / "profiles").glob("*/config.yaml"))
    for doc in ("README.md", "docs/running.md"):
        text = (ROOT / doc).read_text()
        listed = set(re.findall(r"`profiles/([\w-]+)`", text)) | set(re.findall(r"`([\w-]+)`", text))
        wanted = set(profiles)
        if doc == "README.md":
            assert "`profiles/<cluster>` for each cluster (listed in [docs/running.md]" in text
            wanted = {"local", "slurm-local"}
        assert wanted <= listed, (doc, wanted - listed)
        assert "no profile.yaml (or config.yaml) found" in text, doc


def test_the_examples_placeholder_remote_is_refused_where_it_would_be_used():
    """Leonardo's controller pushes into Karolina with federation.remotes.karolina.path: the unedited
    `me@...dd-00-00` used to fail only at the first push, after round 1's training."""
    config = yaml.safe_load(LLAMA2.read_text())
    leonardo = build_run_config({**copy.deepcopy(config), "cluster": "leonardo"}, base_dir=ROOT)
    message = placeholder_problem(leonardo, ["karolina"], "llama2-it-cs.yaml")
    assert message.startswith("llama2-it-cs.yaml: federation.remotes.karolina.path is 'me@"), message
    assert (
        "a placeholder, which leonardo logs into" in message and "README.md, Quick start, step 2" in message
    )
    # The push key's Host alias (push_path) names the same folder: editing path alone is refused, naming it.
    karolina = config["federation"]["remotes"]["karolina"]
    karolina["path"] = "jdoe@karolina.it4i.cz:/scratch/project/open-33-7/r"
    with pytest.raises(ConfigError, match="federation.remotes.karolina.push_path: .* another folder"):
        build_run_config({**config, "cluster": "leonardo"}, base_dir=ROOT)
    karolina["push_path"] = "jdoe@karolina-push:/scratch/project/open-33-7/r"
    edited = build_run_config({**config, "cluster": "leonardo"}, base_dir=ROOT)
    assert placeholder_problem(edited, ["karolina"], "x") is None
    # The tests' own remotes are no placeholders.
    del karolina["push_path"]
    for path in ("me@leo:/run", "me@karo:/scratch/results/demo", "fedtune@127.0.0.1:/tmp/run"):
        karolina["path"] = path
        run = build_run_config({**config, "cluster": "leonardo"}, base_dir=ROOT)
        assert placeholder_problem(run, ["karolina"], "x") is None, path


def test_a_real_run_with_the_placeholder_stops_at_start_and_its_dry_run_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDTUNE_ACCOUNT", "proj123")
    (tmp_path / "config.yaml").write_text(LLAMA2.read_text())
    dry = snakemake(tmp_path, "-n", "--quiet", "rules", profile="leonardo", timeout=300)
    assert "federation.remotes.karolina.path is 'me@" in dry.stderr, dry.stderr[-2000:]
    assert "the run will refuse to start until then" in dry.stderr
    real = snakemake(tmp_path, profile="leonardo", check=False, timeout=300)
    assert real.returncode != 0
    assert "federation.remotes.karolina.path is 'me@" in printed(real), printed(real)[-2000:]
    assert "Building DAG" not in printed(real) and "Submitted" not in printed(real)
    # Karolina's controller logs in nowhere: its remote entry is none of its business.
    karolina = snakemake(tmp_path, "-n", "--quiet", "rules", profile="karolina", timeout=300)
    assert "placeholder" not in karolina.stderr, karolina.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(RESERVED_SITE_NAMES))
def test_a_site_named_like_a_folder_of_the_run_is_refused_saying_why(name):
    """`pooled` passed validation, then ended in a MissingInputException for <run>/pooled/eval/pooled.json."""
    config = demo_config()
    config["sites"][name] = config["sites"].pop("beta")
    message = refused(config)
    assert message.startswith(f"my.yaml: sites: '{name}' is reserved as a site's name: "), message
    assert message.endswith("; name the site otherwise") and RESERVED_SITE_NAMES[name] in message


def test_the_schema_reserves_the_names_the_message_explains():
    schema = yaml.safe_load((ROOT / "fedtune" / "schemas" / "config.schema.yaml").read_text())
    names = schema["properties"]["sites"]["propertyNames"]["not"]["enum"]
    assert sorted(names) == sorted(RESERVED_SITE_NAMES)


def test_the_run_folders_names_beside_a_sites_are_reserved():
    """Every folder name that sits beside a site's in the run folder (round-<r>/<site>, round-<r>/eval/
    <model>, eval/<site>) or names a model in the report: read from the rules' run_path() calls."""
    rules = "\n".join(path.read_text() for path in (ROOT / "workflow" / "rules").glob("*.smk"))
    beside = set(re.findall(r'run_path\(f"round-\{round\}", "(\w+)"', rules))
    beside |= set(re.findall(r'run_path\("eval", "(\w+)"', rules))
    beside |= set(re.findall(r'run_path\(f"round-\{round\}", "eval", "(\w+)"', rules))
    assert beside, "no run_path calls found"
    assert beside | {"pooled", "base"} <= set(RESERVED_SITE_NAMES), beside - set(RESERVED_SITE_NAMES)


def test_a_site_named_like_a_compared_merge_method_is_refused():
    config = demo_config()
    config["sites"]["ties"] = config["sites"].pop("beta")
    config["aggregate"] = {**config.get("aggregate", {}), "compare": ["ties"]}
    message = refused(config)
    assert message.startswith("my.yaml: sites: 'ties' is also a merge method of aggregate.compare"), message


def test_a_site_named_pooled_stops_the_dry_run_at_start(tmp_path):
    config = demo_config()
    config["sites"]["pooled"] = config["sites"].pop("beta")
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "-n", check=False, timeout=120)
    assert result.returncode != 0
    assert "sites: 'pooled' is reserved as a site's name" in printed(result), printed(result)[-2000:]
    assert "MissingInputException" not in printed(result)


# 5. Docs that contradicted the code.


def test_the_docs_no_longer_call_evaluation_where_the_data_lives_planned():
    schema = (ROOT / "fedtune" / "schemas" / "config.schema.yaml").read_text()
    configuration = (ROOT / "docs" / "configuration.md").read_text()
    for text in (schema, configuration):
        assert "is planned" not in " ".join(text.split()), "evaluation where the data lives is built"
    assert "`evaluate.cross_site: none`" in configuration


def test_the_txt_data_format_is_documented():
    configuration = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    assert "**`.txt` one line per document**" in configuration
    schema = yaml.safe_load((ROOT / "fedtune" / "schemas" / "config.schema.yaml").read_text())
    assert (
        "text: one line is one document" in schema["$defs"]["dataset"]["properties"]["format"]["description"]
    )


def test_the_two_commands_name_one_thing():
    readme = (ROOT / "README.md").read_text()
    assert "two commands" not in readme.lower(), "the demo's pair and the clusters' pair were both named so"
    assert "## Demo and tests" in readme and "(#demo-and-tests)" in readme


def test_the_short_dry_run_is_the_documented_one():
    readme = (ROOT / "README.md").read_text()
    assert (
        "snakemake --profile profiles/local -n --quiet rules  # dry run: what would run, in a summary"
        in readme
    )
    assert "Dry-run each first with `-n --quiet rules`" in readme
    running = (ROOT / "docs" / "running.md").read_text()
    assert "`snakemake --profile profiles/<cluster> -n --quiet rules`" in running


def test_the_quick_start_and_running_md_name_the_twin():
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start") : readme.index("1. **Clone on both clusters")]
    assert "scripts/twin config/examples/llama2-it-cs.yaml" in " ".join(quick.split())
    assert "scripts/twin config/examples/llama2-it-cs.yaml" in (ROOT / "docs" / "running.md").read_text()
