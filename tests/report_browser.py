"""Opening Snakemake's HTML report in headless Chromium as a user would.

The report is a React app that holds every result as a data: URI in a global `results` and shows one
at a time: a user picks a category, then clicks a result's view button, and the page shows an <img> or
an <iframe> of it. A copy of the report gets a small script that does exactly that (through the app's
own `app.showCategory`, then the view and (i) buttons in the result's row) and writes what the page
then shows (the image or frame, the caption) into a <pre id="fedtune-check">: Chromium's --dump-dom
returns the DOM after the scripts ran, --screenshot the pixels."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, unquote_to_bytes

DRIVER = """
const pause = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
async function look(category, filename) {
  const check = {category, filename, categories: Object.keys(categories)};
  const found = Object.entries(results).find(([path]) => path.split("/").pop() === filename);
  app.showCategory(category);
  await pause(500);
  const row = [...document.querySelectorAll("tr")].find((tr) => tr.textContent.includes(filename));
  check.row = row ? row.textContent : null;
  if (!row) return check;
  row.querySelector("a").click();
  await pause(800);
  const uri = found ? found[1].data_uri : null;
  const img = [...document.querySelectorAll("img")].find((i) => uri && i.src === uri);
  const frame = [...document.querySelectorAll("iframe")].find((f) => uri && f.src === uri);
  check.img = img ? {width: img.naturalWidth, height: img.naturalHeight, complete: img.complete} : null;
  check.frame = frame ? frame.src : null;
  // The result's (i) button: its caption and provenance.
  row.querySelectorAll("a")[1].click();
  await pause(500);
  check.info = document.body.innerText;
  // Back to the result itself, which a screenshot then shows.
  row.querySelector("a").click();
  await pause(500);
  return check;
}
window.addEventListener("load", async () => {
  await pause(500);
  const checks = [];
  for (const [category, filename] of JSON.parse(decodeURIComponent(location.hash.slice(1)))) {
    checks.push(await look(category, filename));
  }
  const out = document.createElement("pre");
  out.id = "fedtune-check";
  out.textContent = JSON.stringify(checks);
  document.body.appendChild(out);
});
"""
CHECK = re.compile(r'<pre id="fedtune-check">(.*?)</pre>', re.S)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], url: str) -> str:
    command = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        # Virtual time: each view the driver looks at pauses 2.3 s of it (8 views fit).
        "--virtual-time-budget=20000", *args, url,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        raise AssertionError(f"chromium {' '.join(args)} {url} failed: {result.stderr[-2000:]}")
    return result.stdout


def driven_copy(report: Path, out: Path) -> Path:
    """The report with the driver script before </body>."""
    html = report.read_text(encoding="utf-8")
    end = html.rindex("</body>")
    out.write_text(html[:end] + f"<script>{DRIVER}</script>" + html[end:], encoding="utf-8")
    return out


def _url(driven: Path, views: list[tuple[str, str]]) -> str:
    return f"file://{driven}#{quote(json.dumps(views))}"


def show(driven: Path, views: list[tuple[str, str]]) -> dict[str, dict]:
    """For each (category, filename): what the page shows after opening the category and clicking the
    result's view button (`img`, `frame`), then its (i) button (`info`: the page's text, caption included)."""
    dom = _run(["--dump-dom"], _url(driven, views))
    found = CHECK.search(dom)
    assert found, f"the driver script did not finish in {driven}: the app did not start?"
    from html import unescape

    return {check["filename"]: check for check in json.loads(unescape(found.group(1)))}


def screenshot(driven: Path, category: str, filename: str, png: Path) -> Path:
    """The window after opening one result (the driver leaves it showing)."""
    _run([f"--screenshot={png}", "--window-size=1400,900"], _url(driven, [(category, filename)]))
    assert png.is_file(), f"chromium wrote no screenshot {png}"
    return png


def data_uri_bytes(uri: str) -> bytes:
    head, _, data = uri.partition(",")
    return base64.b64decode(data) if head.endswith(";base64") else unquote_to_bytes(data)


class _Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def rendered_table_rows(page: bytes, folder: Path) -> list[list[str]]:
    """The table cells of a web page as Chromium's DOM holds them after loading it."""
    path = folder / "frame.html"
    path.write_bytes(page)
    parser = _Cells()
    parser.feed(_run(["--dump-dom"], f"file://{path}"))
    return parser.rows


def distinct_colours(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 24)
    return len(colours)
