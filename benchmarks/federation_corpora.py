"""The yardstick benchmark's corpora (benchmarks/federation_yardstick.py): English text with topical
structure that is on every Debian machine and that no earlier tuning set used (those were LibreOffice's
help, the Debian Reference and Python's standard library: benchmarks/federation_sets.py).

Written down before the first run (benchmarks/results/federation/confirmation.md holds the rule and the
bar):
- TUNING: the English manual pages (/usr/share/man/man<N>, roff stripped), one topic per kind of page:
  user commands (man1), Perl modules (man3 *.3pm, *.3perl), file formats (man5), administration
  (man8), C and other library calls (man3, the rest), overviews and conventions (man7).
- CONFIRMATION: the packages' documentation (/usr/share/doc/<package>), one topic per kind of file:
  copyright and licence statements (copyright), Debian changelogs (changelog.Debian.gz), and READMEs
  and NEWS files.

Every choice is a hash of the file's path (sha256), so the sets do not depend on the order the disk
lists files in, and a document is in one site only. Documents are cut to their first MAX_CHARS
characters (test documents to TEST_CHARS), so that a few long pages do not dominate a site's tokens or
the evaluation's time.

Non-IID by topic: site i holds topic i mod T (T topics); when sites outnumber topics a topic's
documents are dealt among its sites. The IID control takes the same documents and deals them at random
(by hash) to the same number of sites.
"""

from __future__ import annotations

import gzip
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

MAX_CHARS = 3000
TEST_CHARS = 1500
MIN_CHARS = 400

MAN = Path("/usr/share/man")
DOC = Path("/usr/share/doc")


def _hash(path: Path) -> str:
    return hashlib.sha256(str(path).encode()).hexdigest()


def _man_topic(path: Path) -> str | None:
    section, name = path.parent.name, path.name
    if section == "man1":
        return "commands"
    if section == "man3":
        return "perl" if re.search(r"\.3(pm|perl)(\.gz)?$", name) else "library"
    return {"man5": "formats", "man7": "overviews", "man8": "admin"}.get(section)


def _doc_topic(path: Path) -> str | None:
    name = path.name
    if name == "copyright":
        return "copyright"
    if name == "changelog.Debian.gz":
        return "changelog"
    if name.startswith(("README", "NEWS")) and not name.endswith((".html", ".pdf")):
        return "readme"
    return None


# Topic order: site i of a non-IID split holds TOPICS[i mod T], so 2 sites are the two first topics.
FAMILIES = {
    "tuning": ("man", ("commands", "library", "admin", "overviews", "formats", "perl")),
    "confirmation": ("doc", ("copyright", "changelog", "readme")),
}


def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


_ROFF_REQUEST = re.compile(r"^[.'][^\n]*$", re.M)
_ROFF_ESCAPE = re.compile(r"\\(f[BIRP]|f\(..|s[-+]?\d|\(..|\*\(..|\*.|[&|^~%:0-9ec-])")


def strip_roff(text: str) -> str:
    """Manual page source as plain prose: requests (lines starting with . or ') and font escapes go."""
    text = _ROFF_REQUEST.sub("", text)
    text = _ROFF_ESCAPE.sub("", text).replace("\\-", "-").replace("\\\\", "\\")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _candidates(family: str) -> dict[str, list[Path]]:
    """Every file of the family by topic, in hash order."""
    kind, topics = FAMILIES[family]
    found: dict[str, list[Path]] = {t: [] for t in topics}
    if kind == "man":
        for section in ("man1", "man3", "man5", "man7", "man8"):
            for path in (MAN / section).iterdir():
                topic = _man_topic(path)
                if topic in found and not path.is_symlink():
                    found[topic].append(path)
    else:
        for package in DOC.iterdir():
            if not package.is_dir() or package.is_symlink():
                continue
            for path in package.iterdir():
                topic = _doc_topic(path)
                if topic in found and path.is_file() and not path.is_symlink():
                    found[topic].append(path)
    return {t: sorted(paths, key=_hash) for t, paths in found.items()}


def topic_documents(family: str, topic_count: dict[str, int]) -> dict[str, list[str]]:
    """The first `topic_count[topic]` usable documents of each topic, in hash order (a document is usable
    with at least MIN_CHARS characters once roff is stripped; identical texts are kept once)."""
    result, seen = {}, set()
    for topic, paths in _candidates(family).items():
        wanted, texts = topic_count.get(topic, 0), []
        for path in paths:
            if len(texts) >= wanted:
                break
            text = _read(path)
            if FAMILIES[family][0] == "man":
                text = strip_roff(text)
            digest = hashlib.sha256(text.encode()).digest()
            if len(text) < MIN_CHARS or digest in seen:
                continue
            seen.add(digest)
            texts.append(text)
        if len(texts) < wanted:
            raise SystemExit(f"error: {family} topic {topic}: {len(texts)} usable documents, {wanted} needed")
        result[topic] = texts
    return result


@dataclass(frozen=True)
class SiteData:
    name: str
    topic: str  # "mixed" in the IID control
    train: list[str]
    test: list[str]


def split_sites(family: str, sites: int, train_docs: int, test_docs: int, iid: bool) -> list[SiteData]:
    """`sites` sites of `train_docs` training and `test_docs` test documents each, non-IID by topic or
    (iid) the same documents dealt at random."""
    topics = FAMILIES[family][1]
    owners = [topics[i % len(topics)] for i in range(sites)]
    per_topic = {t: owners.count(t) * (train_docs + test_docs) for t in topics}
    texts = topic_documents(family, per_topic)
    # Each site's documents: its topic's documents dealt round robin among the topic's sites.
    dealt: list[list[str]] = []
    for i, topic in enumerate(owners):
        k, n = owners[:i].count(topic), owners.count(topic)
        dealt.append(texts[topic][k::n])
    if iid:
        pool = [text for docs in dealt for text in docs]
        pool.sort(key=lambda t: hashlib.sha256(t.encode()).hexdigest())
        dealt = [pool[i::sites] for i in range(sites)]
    result = []
    for i, docs in enumerate(dealt):
        test = [d[:TEST_CHARS] for d in docs[:test_docs]]
        train = [d[:MAX_CHARS] for d in docs[test_docs : test_docs + train_docs]]
        result.append(SiteData(f"s{i:02d}", "mixed" if iid else owners[i], train, test))
    return result
