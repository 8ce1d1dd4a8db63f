"""The real text in data/real: small, as its manifest says, with its licence; and scripts/real-text, which
rebuilds it from Debian's packages, keeps a help page's visible text and drops what is not text."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json

from .conftest import ROOT

REAL = ROOT / "data" / "real"


def real_text_script():
    loader = importlib.machinery.SourceFileLoader("real_text", str(ROOT / "scripts" / "real-text"))
    spec = importlib.util.spec_from_loader("real_text", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_shipped_text_is_small_licensed_and_as_its_manifest_says():
    total = sum(p.stat().st_size for p in REAL.rglob("*") if p.is_file())
    assert total < 5 * 1024 * 1024
    manifest = json.loads((REAL / "manifest.json").read_text())
    assert set(manifest) == {"libreoffice-help-it", "libreoffice-help-cs"}
    for name, record in manifest.items():
        assert record["licence"].startswith("MPL-2.0") and record["package"] == name
        for split in ("train", "test"):
            path = REAL / name / f"{split}.jsonl"
            texts = [json.loads(line)["text"] for line in path.open(encoding="utf-8")]
            assert len(texts) == record[split]["documents"] and path.stat().st_size == record[split]["bytes"]
            assert sum(map(len, texts)) == record[split]["characters"]
            assert len(set(texts)) == len(texts) and min(map(len, texts)) >= 200
    it = (REAL / "libreoffice-help-it" / "train.jsonl").read_text(encoding="utf-8")
    cs = (REAL / "libreoffice-help-cs" / "train.jsonl").read_text(encoding="utf-8")
    assert " della " in it and " nebo " in cs and " della " not in cs
    assert (REAL / "LICENSE.MPL-2.0").is_file() and (REAL / "COPYRIGHT.libreoffice-help").is_file()


def test_a_help_pages_visible_text_is_kept_and_navigation_and_mac_variants_dropped(tmp_path):
    page = tmp_path / "page.html"
    page.write_text(
        """<html><head><title>T</title><script>var x = 1;</script></head><body>
        <header><p>Guida di LibreOffice</p></header><aside class="leftside"><p>Indice</p></aside>
        <div id="DisplayArea"><h1>Inserire una tabella</h1>
        <p class="paragraph">Scegliete <span hidden="true" class="MAC">Comando+T</span><span>Ctrl+T</span>.</p>
        <div class="howtoget"><p>Per accedere a questo comando...</p></div>
        <table><tr><td>Righe</td><td>Colonne</td></tr></table></div>
        <footer><p>fuori</p></footer></body></html>""",
        encoding="utf-8",
    )
    text = real_text_script().page_text(page)
    assert text.splitlines() == ["Inserire una tabella", "Scegliete Ctrl+T.", "Righe Colonne"], text


def test_the_split_goes_by_page_the_same_in_every_language():
    script = real_text_script()
    keys = [f"text/swriter/guide/page{i}.html" for i in range(2000)]
    test = [key for key in keys if script.in_test(key, 10)]
    assert 150 < len(test) < 250
    assert test == [key for key in keys if script.in_test(key, 10)]  # no state, no randomness
