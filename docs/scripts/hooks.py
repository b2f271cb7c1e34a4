"""MkDocs hook: a page's links to repository files outside ``docs/`` (which work when the Markdown is
read on a code host) become plain code on the site, where those files do not exist.
Links inside ``docs/`` stay links, and ``mkdocs build --strict`` still checks them."""

from __future__ import annotations

import posixpath
import re
from typing import Any

_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _outside_docs(page_path: str, target: str) -> bool:
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return False
    return posixpath.normpath(posixpath.join(posixpath.dirname(page_path), target)).startswith("../")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    def plain(match: re.Match) -> str:
        text, target = match.groups()
        if not _outside_docs(page.file.src_uri, target):
            return match.group(0)
        path = posixpath.normpath(posixpath.join(posixpath.dirname(page.file.src_uri), target))[3:]
        return text if text.strip("`") == path else f"{text} (`{path}`)"

    return _LINK.sub(plain, markdown)
