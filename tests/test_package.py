"""attnlab as a package: what ``import attnlab`` offers (lazily), and an sdist that holds
everything its own tests need, built here offline and collected from where it is unpacked."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import attnlab

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = (
    "functional",
    "reference",
    "masks",
    "nn",
    "cache",
    "compat",
    "models",
    "integrations",
    "pretrained",
    "translate",
    "viz",
    "kernels",
)


# ------------------------------------------------------------------------------ import attnlab
LIGHT_IMPORT = """
import sys, attnlab
heavy = sorted(m for m in ("torch", "numpy", "transformers", "matplotlib") if m in sys.modules)
print(heavy, sorted(set(attnlab.__all__) - set(dir(attnlab))))
"""


def test_import_attnlab_imports_neither_torch_nor_numpy():
    proc = subprocess.run(
        [sys.executable, "-c", LIGHT_IMPORT], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[] []"


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_subpackage_is_reachable_from_import_attnlab(name):
    module = getattr(attnlab, name)
    assert module.__name__ == f"attnlab.{name}"
    assert name in attnlab.__all__ and name in dir(attnlab)


def test_names_used_in_the_readme_resolve():
    assert callable(attnlab.translate.load_run)
    assert callable(attnlab.integrations.transformers.register)
    assert attnlab.compat.MultiheadAttention.__name__ == "MultiheadAttention"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        attnlab.nope  # noqa: B018
    with pytest.raises(AttributeError, match="attnlab.translate' has no attribute 'nope'"):
        attnlab.translate.nope  # noqa: B018


def test_cache_folder_env_and_its_old_name(monkeypatch, tmp_path):
    from attnlab.pretrained import cache_root

    monkeypatch.delenv("ATTNLAB_CACHE", raising=False)
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "old"))
    assert cache_root() == tmp_path / "old"
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "new"))
    assert cache_root() == tmp_path / "new"  # the documented name wins
    monkeypatch.delenv("ATTNLAB_CACHE_DIR")
    monkeypatch.delenv("ATTNLAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "attnlab"


def test_license_changelog_and_version_agree():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert "attnlab contributors" in (ROOT / "LICENSE").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(
        rf"^## \[{re.escape(attnlab.__version__)}\] - \d{{4}}-\d\d-\d\d$", changelog, re.M
    )
    assert f'version = "{attnlab.__version__}"' in (ROOT / "pyproject.toml").read_text()
    assert (ROOT / "src" / "attnlab" / "py.typed").exists()


# ------------------------------------------------------------------------------ the sdist
@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """The sdist and the wheel built from it (``python -m build`` builds the wheel from the
    sdist), offline: ``--no-isolation`` uses this environment's setuptools."""
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sdist,) = out.glob("attnlab-*.tar.gz")
    (wheel,) = out.glob("attnlab-*.whl")
    return sdist, wheel


def test_the_sdist_holds_what_its_tests_need(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    wanted = {"LICENSE", "README.md", "CHANGELOG.md", "CONTRIBUTING.md", "src/attnlab/py.typed"}
    wanted |= {"src/attnlab/kernels/cpu_flash.cpp", "src/attnlab/kernels/cpu_flash_brgemm.h"}
    for folder, pattern in [
        ("docs", "*.md"),
        ("tests", "*.py"),
        ("tests/browser", "*.py"),
        ("scripts", "*"),
        ("benchmarks", "*.py"),
        ("src/attnlab/data/bible_data", "*"),
    ]:
        wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern) if p.is_file()}
    assert "tests/conftest.py" in wanted and "docs/layers.md" in wanted
    assert not wanted - names, sorted(wanted - names)
    assert not [n for n in names if n.endswith((".pyc", ".pyo"))]


def test_the_wheel_is_typed_and_licensed(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert "attnlab/py.typed" in names
    assert "attnlab/kernels/cpu_flash.cpp" in names  # (built on the user's machine)
    assert "attnlab/kernels/cpu_flash_brgemm.h" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if n.startswith(("tests/", "docs/", "benchmarks/"))]


def test_the_unpacked_sdist_collects_and_runs_its_tests(dists, tmp_path):
    sdist, _ = dists
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path, filter="data")
    (tree,) = tmp_path.glob("attnlab-*")
    # the sdist's own attnlab, not the editable install of this checkout
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "HF_HUB_OFFLINE": "1"}

    def pytest_in_tree(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    which = subprocess.run(
        [sys.executable, "-c", "import attnlab; print(attnlab.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    assert Path(which.stdout.strip()).is_relative_to(tree), which

    collected = pytest_in_tree("--collect-only", "-q")
    tail = collected.stdout.strip().splitlines()[-1]
    assert collected.returncode == 0 and "error" not in tail, collected.stdout[-3000:]
    count = int(re.match(r"(\d+) tests? collected", tail).group(1))
    assert count > 1000, tail

    ran = pytest_in_tree(
        "-q",
        "tests/test_cli_front.py",
        "tests/test_docs_snippets.py::test_the_docs_have_python_blocks",
        "-k",
        "not show_draws",  # the one test here that trains a model
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert " passed" in ran.stdout.strip().splitlines()[-1]
