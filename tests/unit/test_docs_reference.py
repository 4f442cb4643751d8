"""The generated reference pages (docs/configuration.md, docs/metrics.md) match the code."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs/gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_committed_pages_are_what_the_generator_writes(gen: ModuleType) -> None:
    for rel, text in gen.render_pages().items():
        committed = (ROOT / rel).read_text()
        assert committed == text, f"{rel} is stale: run python docs/gen_reference.py"


def test_every_option_of_every_command_is_listed(gen: ModuleType) -> None:
    from gateway.cli import build_parser

    page = (ROOT / "docs/configuration.md").read_text()
    commands = list(gen.walk_commands(build_parser()))
    assert {"strata serve", "strata engine", "strata admin keys rotate"} <= {
        c.name for c in commands
    }
    for command in commands[1:]:  # the first is `strata` itself
        assert f"### `{command.name}`" in page
        for action in command.parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in page, f"{command.name} {option}"


def test_every_metric_is_listed(gen: ModuleType) -> None:
    from gateway.metrics import GatewayMetrics

    page = (ROOT / "docs/metrics.md").read_text()
    names = [m.name for m in GatewayMetrics().registry.collect()]
    assert len(names) >= 24
    for name in names:
        assert f"| `{name}` |" in page, name


def test_env_scanner_finds_every_way_of_reading(gen: ModuleType) -> None:
    source = """
import os
A = os.environ.get("A", "1")
def f():
    env = os.environ
    return env.get("B", 2), os.getenv("C"), os.environ["D"], "E" in os.environ
class K:
    def g(self):
        child = dict(os.environ, X="1")
        child.setdefault("F", "10")
        os.environ["G"] = "set, not read"
"""
    reads = {r.name: r for r in gen.scan_env_reads(source, "m")}
    assert set(reads) == {"A", "B", "C", "D", "E", "F"}
    assert reads["A"].default == "1" and reads["A"].where == "m"
    assert reads["B"].default == "2" and reads["B"].where == "m:f"
    assert reads["F"].where == "m:K.g"


def test_every_environment_variable_read_is_documented(gen: ModuleType) -> None:
    page = (ROOT / "docs/configuration.md").read_text()
    reads = gen.env_reads()
    assert {"STRATA_REDIS_URL", "STRATA_ADMIN_TOKEN", "STRATA_HUGE_PAGES"} <= set(reads)
    for name in reads:
        assert f"| `{name}` |" in page, name


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces as hyphens."""
    ids = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().lower()
            ids.add("".join(c for c in text if c.isalnum() or c in " -_").replace(" ", "-"))
    return ids


def test_relative_links_in_the_docs_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
