#!/usr/bin/env python3
"""Check the built book the way a reader sees it: in a headless Chromium.

Run after ``jupyter-book build .``; it opens every page listed in ``_toc.yml`` from
``_build/html`` and fails (exit status 1, one line per problem naming the page) unless

* the math is typeset: the page has MathJax output (``mjx-container`` elements) for its math,
  MathJax reported no errors, and no raw TeX (``$$``, ``\\(``, ``\\[``, ``\\begin{``) is left in
  the visible text outside code blocks;
* every image loads: each ``<img src>`` of the static page and of the rendered DOM is a local
  file that exists and starts like an image (PNG, JPEG, GIF, WebP or SVG);
* every internal link resolves: each ``href`` to a local file exists, and its ``#anchor`` is an
  ``id`` (or ``<a name>``) in the target page; local scripts and stylesheets exist too.

A screenshot of each page is kept under ``_build/screenshots/<page>.png`` (1280x2000).

Only the Python standard library is used. When ``chromium`` is not on ``PATH`` the script
installs it with ``apt-get install -y chromium`` (running ``apt-get update`` first if that
fails), which needs root.

Usage:
    python3 scripts/check_rendered_book.py [--root .] [--build-dir _build] [PAGE ...]

``PAGE`` is a toc entry such as ``book/rope``; without any, every page in ``_toc.yml`` is checked.
"""

from __future__ import annotations

import argparse
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

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--virtual-time-budget=15000",
    "--window-size=1280,2000",
]
CHROMIUM_TIMEOUT_S = 90
RAW_TEX = ("$$", "\\(", "\\[", "\\begin{")
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


# ----------------------------------------------------------------------------- HTML reading


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
    """Load the page, let MathJax run, save a screenshot; return (DOM or None, error text)."""
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    cmd = [
        chromium,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--screenshot={screenshot}",
        "--dump-dom",
        html_file.resolve().as_uri(),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s"
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if done.returncode != 0 or "<html" not in done.stdout.lower():
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return None, f"chromium exited with status {done.returncode} and no DOM ({tail})"
    return done.stdout, ""


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
        for token in RAW_TEX:
            at = text.find(token)
            if at >= 0:
                snippet = text[max(0, at - 40) : at + 60]
                problems.append(f"raw TeX '{token}' in visible text: ...{snippet}...")
        for src in set(dom.images) - set(static.images):
            problems += self.image_problems(page_file, src)
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
        if dom_text is None:
            problems.append(error)
        else:
            problems += checker.dom_problems(html_file, static, scan_html(dom_text))
        if not screenshot.is_file():
            problems.append(f"no screenshot written to {screenshot}")
        failures += [(page, p) for p in problems]
        status = "ok  " if not problems else "FAIL"
        print(
            f"{status} {page}: {static.math_nodes} math, {len(static.images)} images, "
            f"{len(static.links)} links, {time.monotonic() - t0:.1f} s",
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
