"""The federation benchmark's site-sets, and their split into a tuning half and a confirmation half.

Fixed before any setting was tried (../shared/design.md, "Choosing federation settings without fooling
ourselves"): settings are chosen on TUNING only, and the figures the docs claim come from CONFIRMATION
only. If the default fails there, the method changes and is tuned on TUNING again; the split does not.

Every site is real text from a Debian package (scripts/real-text builds it; `prepare` below runs it):
- help-<lang>: LibreOffice's help pages in one language (MPL-2.0), prose about software;
- ref-<lang>: the Debian Reference in one language (GPL-2+), technical prose with shell examples;
- code: Python's standard library (PSF-2.0), source code. The two halves take disjoint modules (even
  and odd documents in the source's hash order), so no text is in both.
No language of one source appears in both halves. The number after the site is its training documents
(a Debian Reference holds 240-500 pieces, so its sites are smaller): sizes differ by 5x or more in most
sets, and four sets have three or four sites. Each site's test split is its first 40 test documents (8 in
the fine-tuning regimes, whose model is slower to score), 37 for the English Debian Reference.

FINETUNE names the sets of the fine-tuning regime (SmolLM2-135M, full weights and LoRA): two of each half.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SOURCES = {"help": "libreoffice-help", "ref": "debian-reference", "code": "python-stdlib"}


@dataclass(frozen=True)
class SiteSpec:
    name: str  # help-de, ref-en, code
    documents: int  # training documents (the test split is the same size for every site)

    @property
    def key(self) -> str:
        """The name in a fedtune config (sites are identifiers)."""
        return self.name.replace("-", "_")

    @property
    def source(self) -> str:
        return SOURCES[self.name.split("-", 1)[0]]

    @property
    def language(self) -> str:
        return self.name.split("-", 1)[1] if "-" in self.name else "3.11"


def _sites(text: str) -> tuple[SiteSpec, ...]:
    return tuple(SiteSpec(name, int(n)) for name, n in (item.split(":") for item in text.split()))


TUNING = {
    "de-fr": _sites("help-de:500 help-fr:500"),
    "es-pl-nl": _sites("help-es:500 help-pl:250 help-nl:100"),
    "ref-en+code": _sites("ref-en:240 code:48"),
    "help-en+ref-de": _sites("help-en-us:100 ref-de:500"),
    "ru-sv-ref-es-code": _sites("help-ru:400 help-sv:200 ref-es:500 code:80"),
}

CONFIRMATION = {
    "it-cs": _sites("help-it:500 help-cs:500"),  # the published experiment's languages (and the demo's)
    "fi-hu-tr": _sites("help-fi:500 help-hu:250 help-tr:100"),
    "ref-fr+code": _sites("ref-fr:270 code:54"),
    "help-pt+ref-ja": _sites("help-pt:80 ref-ja:420"),
    "ko-el-ref-it-da": _sites("help-ko:500 help-el:100 ref-it:270 help-da:200"),
}

FINETUNE = {"tuning": ("de-fr", "ref-en+code"), "confirmation": ("it-cs", "ref-fr+code")}


def cut_for_fine_tuning(config: dict) -> None:
    """The fine-tuning regimes' cut of a SmolLM2 example config, in place (federation_yardstick.py's, as
    the retired federation_bench.py cut it, so that their cells compare): blocks of 64 tokens, 4 rounds
    of 3 steps of 4 blocks, warmup 1 step, evaluation in disjoint windows of 64 tokens."""
    config["tokenize"]["block_size"] = 64
    config["train"].update(max_steps=3, warmup_steps=1, micro_batch=4, global_batch=4)
    config["federation"]["rounds"] = 4
    config["evaluate"].update(max_length=64, stride=64)


HALVES = {"tuning": TUNING, "confirmation": CONFIRMATION}


def half_of(set_name: str) -> str:
    return next(half for half, sets in HALVES.items() if set_name in sets)


def site_documents(text_dir: Path, site: SiteSpec, half: str, test_documents: int) -> tuple[list, list]:
    """(train texts, test texts) of one site, from text_dir/<source>-<language>/{train,test}.jsonl."""
    folder = text_dir / f"{site.source}-{site.language}"
    result = []
    for split, count in (("train", site.documents), ("test", test_documents)):
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            sys.exit(f"error: {path} is missing: run benchmarks/federation_sets.py prepare")
        texts = [json.loads(line)["text"] for line in path.open(encoding="utf-8")]
        if site.name == "code":  # disjoint modules for the two halves
            texts = texts[half == "confirmation" :: 2]
        if len(texts) < (count if split == "train" else min(count, 30)):
            sys.exit(f"error: {path}: {len(texts)} documents for {site.name}, the set needs {count}")
        result.append(texts[:count])  # test: up to `count` (the Debian Reference in English has 37)
    return result[0], result[1]


def prepare(text_dir: Path) -> None:
    """Build every site's text with scripts/real-text (Debian's package pool; cheap when there)."""
    wanted: dict[str, set[str]] = {}
    for sets in HALVES.values():
        for sites in sets.values():
            for site in sites:
                if not (text_dir / f"{site.source}-{site.language}" / "train.jsonl").is_file():
                    wanted.setdefault(site.source, set()).add(site.language)
    for source, languages in sorted(wanted.items()):
        # Code: every document (the halves split them); prose: 500 / 60 per language, as data/real.
        caps = [] if source == "python-stdlib" else ["--max-train", "500", "--max-test", "60"]
        command = [sys.executable, str(ROOT / "scripts" / "real-text"), "--out", str(text_dir),
                   "--source", source, "--languages", *sorted(languages), *caps]  # fmt: skip
        subprocess.run(command, check=True)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="The fine-tuning sets' text, built once from Debian's packages."
    )
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument(
        "--text", type=Path, default=ROOT / ".cache" / "fedbench" / "text",
        help="where the sites' text goes (federation_yardstick.py --text reads it)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    prepare(args.text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
