"""Readable plain text from an HTML page, with the standard library's ``html.parser``.

``html_to_text(page)`` keeps the words of the page's main content and its paragraph
structure, and nothing else: for a Sphinx page (the Python documentation) only the
``<div role="main">`` body is read, so navigation bars, sidebars and footers are left
out; ``<script>`` / ``<style>`` contents and Sphinx's "¶" permalinks are dropped;
block elements (paragraphs, headings, list items, table rows, ...) end a paragraph;
whitespace is collapsed except inside ``<pre>``, whose lines (code examples) are kept
as they are.  Entities are decoded (``convert_charrefs``).

Used by ``real_corpus`` to turn the Python documentation into long English documents.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser

#: elements whose start and end break the text into paragraphs
BLOCKS = frozenset("p div section article h1 h2 h3 h4 h5 h6 dl ul ol table blockquote pre "
                   "figure figcaption caption hr".split())
#: elements that start a new line (not a paragraph)
LINES = frozenset("li dt dd tr br".split())
#: elements whose contents are never text
SKIPPED = frozenset("script style head title noscript".split())
VOID = frozenset("br hr img meta link input wbr col area base source".split())


def _is_main(tag: str, attrs: dict) -> bool:
    """The element holding a page's own content (Sphinx: ``div role="main"``)."""
    return attrs.get("role") == "main" or tag == "main"


class _TextParser(HTMLParser):
    """Collects text with the breaks between blocks (see the module docstring).

    A break is not written when it is met but kept pending (the strongest one wins) and
    written before the next text, so nested blocks make one break, not a pile.  A list
    item's bullet waits the same way, so ``<li><p>text`` gives ``* text``; inside a table
    cell blocks are spaces, and the cells of a row are joined by `` | ``.
    """

    def __init__(self, main_only: bool):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.main_only = main_only
        self.stack: list[str] = []         # open elements (void ones are never pushed)
        self.main_depth = None             # len(stack) where the main element opened
        self.skip_depth = None             # len(stack) where a skipped element opened
        self.finished = False              # the main element has closed
        self.pre = self.cells = 0          # open <pre> / <td>, <th> elements
        self.brk, self.prefix = "", ""     # pending break and bullet / cell separator

    def _reading(self) -> bool:
        if self.skip_depth is not None or self.finished:
            return False
        return not self.main_only or self.main_depth is not None

    def _break(self, sep: str) -> None:
        if len(sep) > len(self.brk):
            self.brk = sep

    def _boundary(self, tag: str, start: bool) -> None:
        if not self._reading():
            return
        if tag in ("td", "th"):
            if start and self.parts and not self.brk:
                self.prefix = " | "
        elif self.cells and tag not in ("tr", "table"):
            if tag in BLOCKS or tag in LINES:
                self.prefix = self.prefix or " "
        elif tag in BLOCKS:
            self._break("\n\n")
        elif tag in LINES:
            self._break("\n")
            if tag == "li" and start:
                self.prefix = "* "

    def handle_starttag(self, tag, attrs):
        attrs = {k: v or "" for k, v in attrs}
        if tag not in VOID:
            self.stack.append(tag)
        if self.main_only and self.main_depth is None and _is_main(tag, attrs):
            self.main_depth = len(self.stack)
        if self.skip_depth is None and tag not in VOID and (
                tag in SKIPPED or "headerlink" in attrs.get("class", "").split()):
            self.skip_depth = len(self.stack)
        self._boundary(tag, True)
        if tag == "pre":
            self.pre += 1
        elif tag in ("td", "th"):
            self.cells += 1

    def handle_endtag(self, tag):
        if tag not in self.stack:
            return                          # a stray end tag: ignore it
        while self.stack:                   # close what was left open inside it too
            depth = len(self.stack)
            top = self.stack.pop()
            if top == "pre":
                self.pre = max(0, self.pre - 1)
            elif top in ("td", "th"):
                self.cells = max(0, self.cells - 1)
            self._boundary(top, False)
            if self.skip_depth == depth:
                self.skip_depth = None
            if self.main_depth == depth:
                self.main_depth = None
                self.finished = True        # one main element per page
            if top == tag:
                break

    def handle_data(self, data):
        if not self._reading():
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not data.strip() and (self.brk or self.prefix or not self.parts):
                return                      # whitespace between blocks
        if self.parts:
            self.parts.append(self.brk)
        self.parts.append(self.prefix + data)
        self.brk, self.prefix = "", ""


def html_to_text(page: str, main_only: bool | None = None) -> str:
    """The text of ``page`` (see the module docstring).  ``main_only``: read only the
    main-content element; None: when the page has one (``role="main"`` or ``<main>``)."""
    if main_only is None:
        main_only = bool(re.search(r"""role=["']main["']|<main[\s>]""", page))
    parser = _TextParser(main_only)
    parser.feed(page)
    parser.close()
    lines = [line.rstrip() for line in "".join(parser.parts).split("\n")]
    # indented lines come from <pre> (code): keep them; elsewhere a line's leading
    # space is what the collapsing left over
    text = "\n".join(line if line.startswith("    ") else line.strip() for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"
