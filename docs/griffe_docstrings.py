"""A griffe extension (mkdocs.yml names it; it is not a page): attnlab's docstrings, written for
readers of the source and for ``help()``, rendered as Markdown by mkdocstrings.

The source keeps its reST habits; only the rendered reference changes:

* ``Example:`` is read as griffe's ``Examples:`` section (doctest lines become code);
* ``.. math:: ...`` (with its continuation lines) becomes a ``$$ ... $$`` display and
  ``:math:`x``` inline math, typeset as MathML when the site builds (docs/hooks.py);
* roles such as ``:func:`name``` become code (`` `name` ``);
* a literal block introduced by ``::`` keeps its indentation (a code block in Markdown) and
  loses one colon, or the whole ``::`` when it stands alone;
* a reST simple table (``=====  =====`` borders) is shown as preformatted text.
"""

from __future__ import annotations

import re

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|obj|exc):`~?([^`]+)`")
INLINE_MATH = re.compile(r":math:`([^`]+)`")
MATH = re.compile(r"^(\s*)\.\. math::\s*(.*)$")
TABLE_BORDER = re.compile(r"^\s*=+(?: +=+)+\s*$")


def _display_math(lines: list[str]) -> list[str]:
    """``.. math:: a`` + lines indented deeper -> ``$$``, ``a``, the lines, ``$$``."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = MATH.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent, first = match.groups()
        body = [first] if first else []
        i += 1
        while (
            i < len(lines)
            and lines[i].strip()
            and len(lines[i]) - len(lines[i].lstrip()) > len(indent)
        ):
            body.append(lines[i].strip())
            i += 1
        out += [f"{indent}$$", *(indent + b for b in body), f"{indent}$$"]
    return out


def _simple_tables(lines: list[str]) -> list[str]:
    """A reST simple table (border, header, border, rows, border) -> a fenced text block."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not TABLE_BORDER.match(lines[i]):
            out.append(lines[i])
            i += 1
            continue
        borders = [j for j in range(i, len(lines)) if TABLE_BORDER.match(lines[j])][:3]
        end = borders[-1] if len(borders) == 3 else i
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        out += ["", f"{indent}```text", *lines[i : end + 1], f"{indent}```", ""]
        i = end + 1
    return out


def to_markdown(text: str) -> str:
    """One docstring's reST habits as Markdown (see the module docstring)."""
    text = EXAMPLE.sub(r"\1Examples:", text)
    text = INLINE_MATH.sub(r"$\1$", text)
    text = ROLE.sub(r"`\1`", text)
    lines = _simple_tables(_display_math(text.splitlines()))
    # "text::" introduces a literal block: keep "text:"; a "::" alone on its line goes
    lines = [
        "" if line.strip() == "::" else line[:-1] if line.endswith("::") else line for line in lines
    ]
    return "\n".join(lines)


class ReSTHabits(griffe.Extension):
    """Rewrite every docstring with :func:`to_markdown` as the object is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
