#!/usr/bin/env python3
"""Check the built book the way a reader sees it: in a headless Chromium, 1280 px wide.

Run after ``jupyter-book build .``; it opens every page listed in ``_toc.yml`` from
``_build/html`` and fails (exit status 1, one line per problem naming the page) unless

* the math is typeset: the page has MathJax output (``mjx-container`` elements) for its math,
  MathJax reported no errors, and no raw TeX (``$$``, ``\\(``, ``\\[``, ``\\begin{``, a control
  word such as ``\\tau``, a ``$`` opening a formula) is left in the visible text outside code blocks,
  nor a Markdown table's separator row (``| --- |``, ``|—|``) that was never parsed;
* every image loads: each ``<img src>`` of the static page and of the rendered DOM is a local
  file that exists and starts like an image (PNG, JPEG, GIF, WebP or SVG);
* every internal link resolves: each ``href`` to a local file exists, and its ``#anchor`` is an
  ``id`` (or ``<a name>``) in the target page; local scripts and stylesheets exist too;
* no cell output is noise: no stderr output (myst-nb's ``div.output.stderr``), and no output
  text that looks like a progress bar (``37%|###``, ``12/40 [00:03<``, ``it/s``), a warning
  (``SomethingWarning``, ``warn(``), a widget placeholder (``HBox(``, ``FloatProgress(``,
  ``IProgress``, a widget mime type) or a log line (``INFO:``, ``WARNING:root:``, a timestamp);
  no widget output (a ``widget-view+json`` script, which a static page cannot show); and no
  stderr or widget output in the executed notebook (``_build/jupyter_execute``) that a tag or
  a setting keeps off the page;
* every figure is shown once, numbered and captioned: each image in the page body is inside a
  ``<figure>`` with a ``:name:`` (an id other than Sphinx's ``idN``) and a caption numbered
  ``Fig. N``, and no image (same ``src`` or same file content) appears twice on a page;
* no figure is shrunk: its rendered width is at least ``MIN_IMAGE_SCALE`` (70 %) of its
  natural width (a matplotlib figure of at most about 7 in at the default DPI fits);
* nothing is wider than the text column at 1280 px: no display equation (``mjx-container``
  with ``display="true"``) is wider than its box or the column, or scrolls or is clipped; no
  visible code block (a cell's source or a literal block) scrolls horizontally
  (``scrollWidth > clientWidth``), nor a cell's output, nor a table; and the page itself does
  not scroll sideways;
* every notebook chapter starts with the install cell: the first code cell of the page is the
  cell ``scripts/sync_install_cells.py`` writes from ``repository`` in ``_config.yml``, collapsed
  behind a toggle (its ``hide-input`` tag).

The layout is measured in the browser itself: for each page a temporary copy is written next to
the original (so that relative URLs still work; it is deleted afterwards) with a ``<script>``
that waits for the page's ``load`` event, ``MathJax.startup.promise`` (the initial typeset)
and the images, then measures and writes JSON into a hidden ``<pre id="rbc-measurements">``,
which ``--dump-dom`` returns. A screenshot of each page is kept under
``_build/screenshots/<page>.png`` (1280x2000).

Only the Python standard library is used. When ``chromium`` is not on ``PATH`` the script
installs it with ``apt-get install -y chromium`` (running ``apt-get update`` first if that
fails), which needs root.

Usage:
    python3 scripts/check_rendered_book.py [--root .] [--build-dir _build] [PAGE ...]

``PAGE`` is a toc entry such as ``book/rope``; without any, every page in ``_toc.yml`` is checked.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_install_cells import expected_source  # noqa: E402  (stdlib only)

WINDOW_WIDTH = 1280
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--virtual-time-budget=15000",
    f"--window-size={WINDOW_WIDTH},2000",
]
CHROMIUM_TIMEOUT_S = 90
RAW_TEX = ("$$", "\\(", "\\[", "\\begin{")
# TeX that escaped the math parser (a line of an inline formula read as a list item, say): a
# control word such as \tau, or a "$" opening a formula, left in the visible prose.
RAW_TEX_PATTERN = re.compile(r"(?<![\w\\])\\[A-Za-z]{2,}|\$(?=[\\A-Za-z(^_{])")
# A Markdown table that was not parsed (printed as a paragraph from a cell, say): its separator
# row, "| --- |" or, after smart quotes, "|—|", left in the visible prose.
RAW_TABLE_PATTERN = re.compile(r"\|\s*(?:-{3,}|[\u2013\u2014]+)\s*\|")
# Text inside these elements is code, machinery or already-typeset math, not prose.
SKIP_TEXT_IN = {
    "script",
    "style",
    "pre",
    "code",
    "textarea",
    "noscript",
    "template",
    "head",
    "title",
    "mjx-container",
    "svg",
}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
EXTERNAL_SCHEMES = {"http", "https", "mailto", "javascript", "data", "tel", "ftp"}
IMAGE_MAGIC = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"RIFF")

MIN_IMAGE_SCALE = 0.7  # rendered width / natural width
SLACK_PX = 1.0  # sub-pixel rounding allowed in every width comparison
# Output text that is not a result: progress bars, warnings, widget placeholders, log lines.
NOISE = [
    ("a progress bar", re.compile(r"\d+%\|.{0,80}\||\d+/\d+ \[\d+:\d\d")),
    ("a progress rate", re.compile(r"\d(?:\.\d+)?\s?(?:it/s|s/it)\b")),
    ("a warning", re.compile(r"\b[A-Z]\w*Warning\b|\bWarning:|\bwarn\(")),
    ("a widget placeholder", re.compile(r"\b(?:HBox|VBox|FloatProgress|IntProgress|IProgress)\b|widget-view\+json")),
    (
        "a log line",
        re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)(?::|\s)|^\[?\d{4}-\d\d-\d\d[ T]\d\d:\d\d", re.M),
    ),
]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
OUT_ID = "rbc-measurements"
MEASURE_JS = r"""
(function () {
  "use strict";
  const OUT_ID = "__OUT_ID__";
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  // Laid out and not inside a closed <details> (a hide-input cell, a dropdown).
  const shown = (el) => {
    if (el.getClientRects().length === 0) return false;
    for (let d = el.closest("details"); d; d = d.parentElement && d.parentElement.closest("details")) {
      if (!d.open && !el.closest("summary")) return false;
    }
    return true;
  };
  const text = (el) => (el ? el.textContent || "" : "").replace(/\s+/g, " ").trim();
  const raw = (el) => {
    // textContent without the copy button that sphinx-copybutton puts next to every <pre>
    const copy = el.cloneNode(true);
    copy.querySelectorAll("button").forEach((b) => b.remove());
    return copy.textContent || "";
  };
  const where = (el) => {
    const section = el.closest("section[id]");
    return section ? section.id : "";
  };
  function write(result) {
    let pre = document.getElementById(OUT_ID);
    if (!pre) {
      pre = document.createElement("pre");
      pre.id = OUT_ID;
      pre.style.display = "none";
      document.body.appendChild(pre);
    }
    pre.textContent = JSON.stringify(result);
  }

  async function measure() {
    const result = { done: true, errors: [] };
    const mj = window.MathJax;
    result.mathjax_loaded = !!(mj && mj.startup && mj.startup.promise);
    if (result.mathjax_loaded) {
      try {
        await mj.startup.promise;
      } catch (error) {
        result.errors.push("MathJax startup failed: " + error);
      }
    }
    if (document.fonts && document.fonts.ready) await document.fonts.ready;
    const body = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
    const images = Array.from(body.querySelectorAll("img"));
    images.forEach((img) => (img.loading = "eager"));
    await Promise.all(
      images.map((img) =>
        img.complete
          ? null
          : new Promise((resolve) => {
              img.addEventListener("load", resolve, { once: true });
              img.addEventListener("error", resolve, { once: true });
            })
      )
    );
    await sleep(100); // one more layout pass after the last image and the math

    const doc = document.documentElement;
    const column = body.getBoundingClientRect();
    result.window = { width: window.innerWidth, scroll_width: doc.scrollWidth, client_width: doc.clientWidth };
    result.column = { left: column.left, right: column.right, width: column.width };

    result.images = images.map((img) => {
      const rect = img.getBoundingClientRect();
      const figure = img.closest("figure");
      const caption = figure ? figure.querySelector("figcaption") : null;
      return {
        src: img.getAttribute("src") || "",
        alt: img.getAttribute("alt") || "",
        natural_width: img.naturalWidth,
        natural_height: img.naturalHeight,
        width: rect.width,
        height: rect.height,
        shown: shown(img),
        in_output: !!img.closest(".cell_output"),
        figure_id: figure ? figure.id || "(no id)" : null,
        caption_number: caption ? text(caption.querySelector(".caption-number")) : "",
        caption_text: caption ? text(caption.querySelector(".caption-text")) : "",
        section: where(img),
      };
    });

    const tex = new Map();
    if (result.mathjax_loaded && mj.startup.document) {
      for (const item of mj.startup.document.math) {
        if (item.typesetRoot) tex.set(item.typesetRoot, item.math);
      }
    }
    result.display_math = Array.from(body.querySelectorAll('mjx-container[display="true"]')).map((box) => {
      const inner = box.querySelector("mjx-math") || box;
      const rect = inner.getBoundingClientRect();
      const holder = box.parentElement;
      return {
        tex: (tex.get(box) || "").replace(/\s+/g, " ").trim(),
        shown: shown(box),
        math_width: rect.width,
        math_left: rect.left,
        math_right: rect.right,
        box_client_width: box.clientWidth,
        box_scroll_width: box.scrollWidth,
        holder_client_width: holder ? holder.clientWidth : 0,
        holder_scroll_width: holder ? holder.scrollWidth : 0,
        section: where(box),
      };
    });

    result.code = Array.from(body.querySelectorAll("div.highlight pre")).map((pre) => {
      const lines = (pre.textContent || "").split("\n");
      let longest = "";
      for (const line of lines) if (line.length > longest.length) longest = line;
      const kind = pre.closest(".cell_input") ? "input" : pre.closest(".cell_output") ? "output" : "block";
      return {
        kind: kind,
        shown: shown(pre),
        client_width: pre.clientWidth,
        scroll_width: pre.scrollWidth,
        longest: longest,
        section: where(pre),
      };
    });

    result.tables = Array.from(body.querySelectorAll("table")).map((table) => {
      const holder = table.parentElement;
      return {
        shown: shown(table),
        width: table.getBoundingClientRect().width,
        holder_client_width: holder ? holder.clientWidth : 0,
        holder_scroll_width: holder ? holder.scrollWidth : 0,
        column_width: column.width,
        first_cell: text(table.querySelector("th, td")).slice(0, 60),
        section: where(table),
      };
    });

    result.outputs = Array.from(body.querySelectorAll(".cell_output > *")).map((out) => ({
      classes: out.className,
      shown: shown(out),
      text: raw(out).slice(0, 4000),
      section: where(out),
    }));

    // A widget output is a script for a widget manager that the static page may not load.
    result.widgets = Array.from(body.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')).map(
      (el) => where(el)
    );

    const cells = Array.from(body.querySelectorAll("div.cell"));
    result.code_cells = cells.length;
    const first = cells.length ? cells[0].querySelector(".cell_input pre") : null;
    result.first_code_cell = first ? first.textContent : null;
    result.first_code_collapsed = first ? first.closest("details") !== null : null;
    return result;
  }

  window.addEventListener("load", () => {
    measure().then(write, (error) => write({ done: false, errors: ["measurement failed: " + error] }));
  });
})();
""".replace("__OUT_ID__", OUT_ID)


# ----------------------------------------------------------------------------- HTML reading


def _in_section(section: str | None) -> str:
    """`` (section NAME)`` for a problem's message, or nothing when the section is unknown."""
    return f" (section {section})" if section else ""


@dataclass
class PageScan:
    """What one HTML document contains, as far as the checks are concerned."""

    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)  # <a href>
    images: list[str] = field(default_factory=list)  # <img src>
    assets: list[str] = field(default_factory=list)  # <script src>, <link rel=stylesheet href>
    math_nodes: int = 0  # Sphinx's class="math" spans and divs (static page)
    mjx_containers: int = 0  # MathJax output (rendered DOM)
    mjx_errors: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # visible prose text


class Scanner(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.scan = PageScan()
        self.stack: list[str] = []
        self.skip_depth = 0
        self.in_error = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: (v or "") for k, v in attrs}
        if "id" in a:
            self.scan.ids.add(a["id"])
        if tag == "a" and "name" in a:
            self.scan.ids.add(a["name"])
        if tag == "a" and "href" in a:
            self.scan.links.append(a["href"])
        elif tag == "img" and "src" in a:
            self.scan.images.append(a["src"])
        elif tag == "script" and a.get("src"):
            self.scan.assets.append(a["src"])
        elif tag == "link" and "stylesheet" in a.get("rel", "").split() and a.get("href"):
            self.scan.assets.append(a["href"])
        if "math" in a.get("class", "").split() and tag in ("span", "div"):
            self.scan.math_nodes += 1
        if tag == "mjx-container":
            self.scan.mjx_containers += 1
        if tag == "mjx-merror" or "data-mjx-error" in a:
            self.scan.mjx_errors.append(a.get("data-mjx-error", "") or "(no message)")
        if tag in VOID:
            return
        self.stack.append(tag)
        if tag in SKIP_TEXT_IN:
            self.skip_depth += 1

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID and self.stack and self.stack[-1] == tag:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID or tag not in self.stack:
            return
        while self.stack:  # close anything left open inside this element
            top = self.stack.pop()
            if top in SKIP_TEXT_IN:
                self.skip_depth -= 1
            if top == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.skip_depth == 0 and data.strip():
            self.scan.text.append(data)


def scan_html(text: str) -> PageScan:
    parser = Scanner()
    parser.feed(text)
    parser.close()
    return parser.scan


# ----------------------------------------------------------------------------- toc and files


def toc_pages(root: Path) -> list[str]:
    """``root`` and every ``file`` entry of ``_toc.yml``, in order, without extensions."""
    toc = root / "_toc.yml"
    if not toc.is_file():
        sys.exit(f"check_rendered_book: {toc} not found")
    pages: list[str] = []
    for line in toc.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\s*(?:-\s*)?(?:root|file)\s*:\s*['\"]?([^'\"#\s]+)", line)
        if match:
            page = re.sub(r"\.(ipynb|md|rst)$", "", match.group(1))
            if page not in pages:
                pages.append(page)
    if not pages:
        sys.exit(f"check_rendered_book: no root/file entries found in {toc}")
    return pages


def resolve_local(page_file: Path, url: str) -> tuple[Path, str] | None:
    """The file and fragment a relative URL points to, or None for an external URL."""
    parts = urlsplit(url)
    if parts.scheme and parts.scheme.lower() in EXTERNAL_SCHEMES:
        return None
    if parts.scheme == "file":
        target = Path(unquote(parts.path))
    elif parts.path:
        target = (page_file.parent / unquote(parts.path)).resolve()
    else:
        target = page_file
    if url.endswith("/") or target.is_dir():
        target = target / "index.html"
    return target, unquote(parts.fragment)


def looks_like_image(path: Path) -> bool:
    """True when the file starts like a PNG, JPEG, GIF or WebP, or is an SVG document."""
    with path.open("rb") as f:
        head = f.read(4096)
    if head.startswith(IMAGE_MAGIC):
        return True
    return path.suffix.lower() == ".svg" and b"<svg" in head.lower()


# ----------------------------------------------------------------------------- chromium


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        sys.exit(
            "check_rendered_book: chromium is not installed and installing it needs root: "
            "run `apt-get install -y chromium` as root, then rerun"
        )
    print("check_rendered_book: chromium not found; installing it with apt-get", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "chromium"]
    if subprocess.run(install, env=env).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=False)
        if subprocess.run(install, env=env).returncode != 0:
            sys.exit("check_rendered_book: `apt-get install -y chromium` failed; cannot check the rendered book")
    found = shutil.which("chromium")
    if not found:
        sys.exit("check_rendered_book: chromium was installed but is not on PATH")
    return found


def render(chromium: str, html_file: Path, screenshot: Path) -> tuple[str | None, str]:
    """Load the page, let MathJax run, save a screenshot; return (DOM or None, error text).

    The browser loads a temporary copy of the page, next to it, with ``MEASURE_JS`` added at
    the end of ``<body>``; the copy is deleted afterwards.
    """
    page = html_file.read_text(encoding="utf-8", errors="replace")
    script = f"<script>{MEASURE_JS}</script>"
    at = page.lower().rfind("</body>")
    page = page[:at] + script + page[at:] if at >= 0 else page + script
    fd, name = tempfile.mkstemp(prefix=f".{html_file.stem}.", suffix=".rbc.html", dir=html_file.parent)
    copy = Path(name)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        cmd = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--screenshot={screenshot}",
            "--dump-dom",
            copy.resolve().as_uri(),
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None, f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s"
    finally:
        copy.unlink(missing_ok=True)
        shutil.rmtree(profile, ignore_errors=True)
    if done.returncode != 0 or "<html" not in done.stdout.lower():
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return None, f"chromium exited with status {done.returncode} and no DOM ({tail})"
    return done.stdout, ""


def measurements(dom_text: str) -> dict | None:
    """The JSON that ``MEASURE_JS`` left in the DOM, or None if it did not finish."""
    match = re.search(rf'<pre id="{OUT_ID}"[^>]*>(.*?)</pre>', dom_text, re.S)
    if not match:
        return None
    try:
        return json.loads(html.unescape(match.group(1)))
    except json.JSONDecodeError:
        return None


# ----------------------------------------------------------------------------- checks


class Checker:
    def __init__(self, html_root: Path) -> None:
        self.html_root = html_root
        self.id_cache: dict[Path, set[str]] = {}

    def ids_of(self, path: Path) -> set[str]:
        if path not in self.id_cache:
            self.id_cache[path] = scan_html(path.read_text(encoding="utf-8", errors="replace")).ids
        return self.id_cache[path]

    def static_problems(self, page_file: Path, scan: PageScan) -> list[str]:
        problems = []
        for src in scan.images:
            problems += self.image_problems(page_file, src)
        for href in scan.links:
            if href in ("", "#"):
                continue
            resolved = resolve_local(page_file, href)
            if resolved is None:
                continue
            target, fragment = resolved
            if not target.is_file():
                problems.append(f"broken link {href!r}: {self.rel(target)} does not exist")
            elif fragment and target.suffix == ".html" and fragment not in self.ids_of(target):
                problems.append(f"broken link {href!r}: no id {fragment!r} in {self.rel(target)}")
        for src in scan.assets:
            resolved = resolve_local(page_file, src)
            if resolved is not None and not resolved[0].is_file():
                problems.append(f"missing asset {src!r}: {self.rel(resolved[0])} does not exist")
        return problems

    def image_problems(self, page_file: Path, src: str) -> list[str]:
        if src.startswith("data:image/"):
            return []
        resolved = resolve_local(page_file, src)
        if resolved is None:
            return [f"image {src!r} is remote and will not load offline"]
        target = resolved[0]
        if not target.is_file():
            return [f"image {src!r} does not load: {self.rel(target)} does not exist"]
        if target.stat().st_size == 0 or not looks_like_image(target):
            return [f"image {src!r} does not load: {self.rel(target)} is empty or not an image"]
        return []

    def dom_problems(self, page_file: Path, static: PageScan, dom: PageScan) -> list[str]:
        problems = []
        if static.math_nodes and dom.mjx_containers == 0:
            problems.append(
                f"math not typeset: {static.math_nodes} math elements but no MathJax output (mjx-container)"
            )
        elif dom.mjx_containers < static.math_nodes:
            problems.append(
                f"math partly typeset: {static.math_nodes} math elements, {dom.mjx_containers} mjx-container"
            )
        for message in dom.mjx_errors:
            problems.append(f"MathJax error: {message}")
        text = " ".join(" ".join(dom.text).split())

        def around(at: int) -> str:
            return text[max(0, at - 40) : at + 60]

        for token in RAW_TEX:
            at = text.find(token)
            if at >= 0:
                problems.append(f"raw TeX '{token}' in visible text: ...{around(at)}...")
        tex = RAW_TEX_PATTERN.search(text)
        if tex:
            problems.append(f"raw TeX '{tex.group()}' in visible text: ...{around(tex.start())}...")
        table = RAW_TABLE_PATTERN.search(text)
        if table:
            problems.append(f"a Markdown table left unparsed in visible text: ...{around(table.start())}...")
        for src in set(dom.images) - set(static.images):
            problems += self.image_problems(page_file, src)
        return problems

    # ------------------------------------------------------------------ measured in the browser

    def measured_problems(self, page_file: Path, m: dict) -> list[str]:
        problems = [f"in the browser: {e}" for e in m.get("errors", [])]
        problems += self.output_problems(m)
        problems += self.figure_problems(page_file, m)
        problems += self.width_problems(m)
        return problems

    @staticmethod
    def output_problems(m: dict) -> list[str]:
        problems = []
        for out in m.get("outputs", []):
            classes = out.get("classes", "").split()
            first = next((line.strip() for line in out.get("text", "").splitlines() if line.strip()), "")
            at = _in_section(out.get("section"))
            if "stderr" in classes:
                problems.append(f"stderr in a cell output{at}: {first[:100]!r}")
                continue
            for what, pattern in NOISE:
                hit = pattern.search(out.get("text", ""))
                if hit:
                    line = next(x for x in out["text"][: hit.end()].splitlines()[::-1] if x.strip())
                    problems.append(f"cell output{at} looks like {what}: {line.strip()[:100]!r}")
                    break
        for section in m.get("widgets", []):
            at = _in_section(section)
            problems.append(
                f"widget output{at} ({WIDGET_MIME}): a progress bar or widget has no place on a static page"
            )
        return problems

    def figure_problems(self, page_file: Path, m: dict) -> list[str]:
        problems = []
        seen: dict[str, list[dict]] = {}
        for img in m.get("images", []):
            src = img["src"]
            at = _in_section(img.get("section"))
            name = "a data: image" if src.startswith("data:") else src
            if len(name) > 70:
                name = "..." + name[-60:]
            seen.setdefault(self.image_key(page_file, src), []).append(img)
            number = img.get("caption_number", "")
            if img.get("figure_id") is None:
                problems.append(
                    f"uncaptioned figure{at}: {name} is not inside a numbered figure "
                    "(glue it with display=False, close it, and show it with {glue:figure}, a caption and :name:)"
                )
            elif not re.match(r"Fig\.\s*\d+", number) or not img.get("caption_text"):
                problems.append(f"figure {img['figure_id']!r}{at} has no numbered caption ('Fig. N' and a text)")
            elif re.fullmatch(r"id\d+", img["figure_id"]):
                problems.append(f"figure {number.strip()}{at} has no :name: (its id is {img['figure_id']!r})")
            if img.get("shown") and img.get("natural_width", 0) == 0:
                problems.append(f"image {name}{at} did not load in the browser")
            elif img.get("shown") and img["width"] < MIN_IMAGE_SCALE * img["natural_width"]:
                label = number.strip() or name
                problems.append(
                    f"figure {label}{at} is scaled to {img['width'] / img['natural_width']:.0%} of its natural size "
                    f"({img['width']:.0f} of {img['natural_width']} px; at least {MIN_IMAGE_SCALE:.0%}): "
                    "make it narrower (at most about 7 in) or split it into rows"
                )
        for images in seen.values():
            if len(images) > 1:
                labels = [
                    i.get("caption_number", "").strip()
                    or ("a bare cell output" if i.get("in_output") else "uncaptioned")
                    for i in images
                ]
                sections = sorted({i.get("section", "") for i in images} - {""})
                problems.append(
                    f"figure shown {len(images)} times ({', '.join(labels)}; section {', '.join(sections)}): "
                    "close a glued figure (plt.close(fig)) so that it is not also a cell output"
                )
        return problems

    def image_key(self, page_file: Path, src: str) -> str:
        """What makes two images the same: their file's content (or the data: URI itself)."""
        resolved = None if src.startswith("data:") else resolve_local(page_file, src)
        if resolved is None or not resolved[0].is_file():
            return src
        return hashlib.sha256(resolved[0].read_bytes()).hexdigest()

    @staticmethod
    def width_problems(m: dict) -> list[str]:
        problems = []
        column = m.get("column", {})
        window = m.get("window", {})
        if window.get("scroll_width", 0) > window.get("client_width", 0) + SLACK_PX:
            problems.append(
                f"the page scrolls sideways at {WINDOW_WIDTH} px: {window['scroll_width']} px wide "
                f"in a {window['client_width']} px window"
            )
        for eq in m.get("display_math", []):
            if not eq.get("shown"):
                continue
            box = eq["box_client_width"]
            over = (
                eq["math_width"] > box + SLACK_PX
                or eq["box_scroll_width"] > box + SLACK_PX
                or eq["holder_scroll_width"] > eq["holder_client_width"] + SLACK_PX
                or eq["math_right"] > column.get("right", 1e9) + SLACK_PX
                or eq["math_left"] < column.get("left", -1e9) - SLACK_PX
            )
            if over:
                at = _in_section(eq.get("section"))
                tex = eq.get("tex", "")
                tex = tex[:70] + ("..." if len(tex) > 70 else "")
                problems.append(
                    f"display equation wider than its container{at}: {eq['math_width']:.0f} px in "
                    f"{min(box, eq['holder_client_width']):.0f} px; break it with aligned or split: {tex!r}"
                )
        for code in m.get("code", []):
            if not code.get("shown") or code["scroll_width"] <= code["client_width"] + SLACK_PX:
                continue
            at = _in_section(code.get("section"))
            what = {"input": "code cell", "output": "cell output", "block": "code block"}[code["kind"]]
            longest = code.get("longest", "").rstrip()
            problems.append(
                f"{what} scrolls sideways{at}: {code['scroll_width']} px in {code['client_width']} px, "
                f"longest line {len(longest)} characters: {longest.strip()[:70]!r}"
            )
        for table in m.get("tables", []):
            if not table.get("shown"):
                continue
            if (
                table["holder_scroll_width"] > table["holder_client_width"] + SLACK_PX
                or table["width"] > table["column_width"] + SLACK_PX
            ):
                at = _in_section(table.get("section"))
                problems.append(
                    f"table wider than the text column{at}: {table['width']:.0f} px in "
                    f"{table['holder_client_width']:.0f} px (first cell {table['first_cell']!r})"
                )
        return problems

    # ------------------------------------------------------------------ notebook chapters

    @staticmethod
    def install_cell_problems(m: dict, expected: str) -> list[str]:
        first = m.get("first_code_cell")
        fix = "run python scripts/sync_install_cells.py"
        if first is None:
            return [f"chapter has no code cell: its first code cell must be the install cell ({fix})"]

        def norm(s: str) -> str:
            return "\n".join(line.rstrip() for line in s.strip().splitlines())

        if norm(first) != norm(expected):
            line = first.strip().splitlines()[0] if first.strip() else ""
            return [f"first code cell is not the install cell ({fix}); it starts {line[:70]!r}"]
        if m.get("first_code_collapsed") is False:
            return [f"the install cell is shown open, not collapsed behind a toggle ({fix})"]
        return []

    @staticmethod
    def executed_notebook_problems(executed: Path, m: dict | None) -> list[str]:
        """stderr or widget outputs that the page does not show (a remove-stderr tag, a setting)."""
        if not executed.is_file():
            return []
        try:
            nb = json.loads(executed.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            return [f"cannot read the executed notebook {executed}: {error}"]
        problems = []
        stderr_cells = []
        for index, cell in enumerate(nb.get("cells", [])):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream" and out.get("name") == "stderr":
                    stderr_cells.append(index)
                if WIDGET_MIME in out.get("data", {}):
                    problems.append(f"cell {index} of the executed notebook has a widget output ({WIDGET_MIME})")
        shown = 0 if m is None else sum("stderr" in o.get("classes", "").split() for o in m.get("outputs", []))
        if len(stderr_cells) > shown:
            cells = ", ".join(str(i) for i in sorted(set(stderr_cells)))
            problems.append(
                f"the executed notebook writes {len(stderr_cells)} stderr output(s) (cells {cells}) "
                f"and the page shows {shown}: stderr is hidden, not fixed"
            )
        return problems

    def rel(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.html_root.resolve()))
        except ValueError:
            return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="toc entries to check (default: every page in _toc.yml)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="the book's root")
    parser.add_argument(
        "--build-dir", type=Path, default=None, help="jupyter-book's build folder (default ROOT/_build)"
    )
    args = parser.parse_args()

    root = args.root.resolve()
    build = (args.build_dir or root / "_build").resolve()
    html_root = build / "html"
    shots = build / "screenshots"
    if not html_root.is_dir():
        sys.exit(f"check_rendered_book: {html_root} not found; build the book first (python3 tasks.py book)")
    pages = args.pages or toc_pages(root)
    install_cell = expected_source(root)
    chromium = find_chromium()
    shots.mkdir(parents=True, exist_ok=True)
    checker = Checker(html_root)

    start = time.monotonic()
    failures: list[tuple[str, str]] = []
    for page in pages:
        t0 = time.monotonic()
        html_file = html_root / f"{page}.html"
        if not html_file.is_file():
            failures.append((page, f"page not built: {checker.rel(html_file)} does not exist"))
            print(f"FAIL {page}: not built", flush=True)
            continue
        static = scan_html(html_file.read_text(encoding="utf-8", errors="replace"))
        problems = checker.static_problems(html_file, static)
        screenshot = shots / f"{Path(page).name}.png"
        dom_text, error = render(chromium, html_file, screenshot)
        measured = None
        if dom_text is None:
            problems.append(error)
        else:
            problems += checker.dom_problems(html_file, static, scan_html(dom_text))
            measured = measurements(dom_text)
            if measured is None or not measured.get("done"):
                errors = "; ".join(measured.get("errors", [])) if measured else "no result in the DOM"
                problems.append(f"layout not measured: the script in the page did not finish ({errors})")
            else:
                problems += checker.measured_problems(html_file, measured)
        is_notebook = (root / f"{page}.ipynb").is_file()
        if is_notebook and measured is not None and measured.get("done"):
            problems += checker.install_cell_problems(measured, install_cell)
        if is_notebook:
            problems += checker.executed_notebook_problems(build / "jupyter_execute" / f"{page}.ipynb", measured)
        if not screenshot.is_file():
            problems.append(f"no screenshot written to {screenshot}")
        failures += [(page, p) for p in problems]
        status = "ok  " if not problems else "FAIL"
        extra = ""
        if measured is not None and measured.get("done"):
            extra = (
                f", {len(measured.get('display_math', []))} display equations, "
                f"{sum(c['shown'] for c in measured.get('code', []))} code blocks"
            )
        print(
            f"{status} {page}: {static.math_nodes} math, {len(static.images)} images, "
            f"{len(static.links)} links{extra}, {time.monotonic() - t0:.1f} s",
            flush=True,
        )

    elapsed = time.monotonic() - start
    if failures:
        print(f"\n{len(failures)} problem(s) in the rendered book:", file=sys.stderr)
        for page, problem in failures:
            print(f"  {page}: {problem}", file=sys.stderr)
        print(f"checked {len(pages)} pages in {elapsed:.0f} s; screenshots in {shots}", file=sys.stderr)
        return 1
    print(f"\nall {len(pages)} pages render cleanly ({elapsed:.0f} s); screenshots in {shots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
