"""The public surface: twins share signatures, the oracle needs no torch, exports resolve."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import attnlab
import attnlab.functional as AF
import attnlab.reference as R

TWINS = [
    "masked_softmax",
    "attention",
    "dot_product_scores",
    "scaled_dot_product_scores",
    "general_scores",
    "concat_scores",
    "additive_scores",
    "scaled_dot_product_attention",
    "additive_attention",
    "hard_attention_weights",
    "hard_attention",
    "apply_rotary",
]


@pytest.mark.parametrize("name", TWINS)
def test_twins_have_the_same_signature(name):
    torch_params = inspect.signature(getattr(AF, name)).parameters
    numpy_params = inspect.signature(getattr(R, name)).parameters
    assert [(p.name, p.kind, p.default) for p in torch_params.values()] == [
        (p.name, p.kind, p.default) for p in numpy_params.values()
    ]


def test_reference_imports_no_torch():
    code = "import sys, attnlab.reference; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_exports_resolve():
    for name in attnlab.__all__:
        assert getattr(attnlab, name) is not None
    for module in (AF, R, attnlab.masks):
        for name in module.__all__:
            assert getattr(module, name) is not None
