"""griffe extension: keep the docstring items that the Google parser would drop.

Some docstrings of the package name several parameters on one ``Args:`` line
(``beta1, beta2: ...``) and list exceptions as a sentence under ``Raises:`` (``UnknownTableError,
InvalidKeysError, StoreError (nothing changed).``). griffe's Google parser expects one
``name: description`` per item and drops the others, so the API reference would lose them.
Before parsing, this splits a shared ``Args`` line into one item per name (same description),
and turns a ``Raises:`` section whose items are not ``Type: description`` into a paragraph.
The docstrings in ``embcache/`` are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Raises):\s*$")
ITEM = re.compile(r"^[\w.*]+(?: \([^)]*\))?:(?:\s|$)")
SHARED = re.compile(r"^([\w*]+(?:, [\w*]+)+):(.*)$")


def _sections(lines: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = SECTION.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent, kind = m.group(1), m.group(2)
        body: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            i -= 1
            body.pop()
        item_indent = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=len(indent) + 4)
        starts = [b[item_indent:] for b in body if b.strip() and len(b) - len(b.lstrip()) == item_indent]
        if kind == "Raises" and not all(ITEM.match(s) for s in starts):
            text = " ".join(b.strip() for b in body if b.strip())
            out += [f"{indent}**Raises:** {text}"]
            continue
        out.append(f"{indent}{kind}:")
        for b in body:
            shared = SHARED.match(b[item_indent:]) if len(b) - len(b.lstrip()) == item_indent else None
            if shared and kind != "Raises":
                # all names but the last marked: _copy_continuations gives them the item's other lines
                names, rest = shared.group(1).split(", "), shared.group(2)
                out.extend(f"{' ' * item_indent}{n}:{rest}" + ("\x00" if k < len(names) - 1 else "")
                           for k, n in enumerate(names))
            else:
                out.append(b)
    return _copy_continuations(out)


def _copy_continuations(lines: list[str]) -> list[str]:
    """Give every name of a split item (marked with NUL) the continuation lines of the last one."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].endswith("\x00"):
            out.append(lines[i])
            i += 1
            continue
        group = []
        while lines[i].endswith("\x00"):
            group.append(lines[i][:-1])
            i += 1
        last = lines[i]
        indent = len(last) - len(last.lstrip())
        j = i + 1
        cont = []
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > indent:
            cont.append(lines[j])
            j += 1
        for g in group:
            out += [g, *cont]
        out += [last, *cont]
        i = j
    return out


def rewrite(text: str) -> str:
    return "\n".join(_sections(text.split("\n")))


class KeepAllItems(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
