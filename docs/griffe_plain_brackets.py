"""Griffe extension for the API pages: `paged`'s docstrings are plain prose, where `x[i][j]` is an
index, not a Markdown reference link. Outside code spans, `][` becomes `]\\[`, so mkdocs-autorefs
does not look up `j` as an object (strict mode would fail on it)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_CODE_SPAN = re.compile(r"(`+)(?:.|\n)*?\1")


def _escape(text: str) -> str:
    out, last = [], 0
    for span in _CODE_SPAN.finditer(text):
        out.append(text[last : span.start()].replace("][", "]\\["))
        out.append(span.group(0))
        last = span.end()
    out.append(text[last:].replace("][", "]\\["))
    return "".join(out)


class PlainBrackets(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _escape(obj.docstring.value)
