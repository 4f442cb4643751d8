"""What the files under deploy/ refer to: the PromQL of every Grafana panel, variable and
alert rule, and the metric names in it. Shared by the static checks of deploy/ and the
test that scrapes a served system."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
RULE_FILES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))

_TOKENS = re.compile(
    r"""(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
      | (?P<range>\[[^\]]*\])
      | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?)
      | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<punct>[{}()])
      | (?P<other>\S)""",
    re.VERBOSE,
)
_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", *_GROUPING}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    aggregations, keywords, label names (in braces or grouping lists) or label values."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKENS.finditer(expr)]
    names: set[str] = set()
    depth = 0  # inside {...}: label matchers
    skip_list = False  # the (...) after by/without/on/ignoring/group_left/group_right
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "punct":
            if text == "{":
                depth += 1
            elif text == "}":
                depth -= 1
            elif text == ")" and skip_list:
                skip_list = False
            continue
        if kind != "ident" or depth or skip_list:
            continue
        if text in _GROUPING:
            skip_list = following == "("
            continue
        if text in _KEYWORDS or following == "(" or text in _AGGREGATIONS:
            continue
        names.add(text)
    return names


def dashboards() -> Iterator[tuple[str, dict]]:
    for path in DASHBOARDS:
        yield path.name, json.loads(path.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, rows' nested panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable of every dashboard."""
    for name, dashboard in dashboards():
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                yield f"{name}: {panel['title']} {target['refId']}", target["expr"]
        for var in dashboard["templating"]["list"]:
            if var["type"] == "query":
                query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
                assert inner, f"{name}: variable {var['name']}: {query}"
                yield f"{name}: variable {var['name']}", inner.group(1)


def rules() -> Iterator[tuple[str, dict]]:
    """(file, rule) for every rule of every rule file."""
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                yield path.name, rule


def every_query() -> Iterator[tuple[str, str]]:
    yield from dashboard_queries()
    for file, rule in rules():
        yield f"{file}: {rule.get('alert') or rule.get('record')}", rule["expr"]
