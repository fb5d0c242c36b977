"""Every statement of the docs that names a metric, an error type, a config option, a flag or an
``EMBCACHE_*`` variable matches the code (issue 25 item 7).

The pages are README.md, docs/**/*.md (without the generated tables of docs/benchmarks.md),
server/README.md and deploy/README.md. Each statement found is its own test, named
``file:line``; the rules:

1. Metrics: each Prometheus name in backticks (or a fenced block) that contains ``embcache_``
   is exported, after brace expansion (``embcache_ssd_{read,write}_ops_total``), by a real
   cache's collector (:func:`embcache.metrics.register_metrics`) or by a real server's
   ``/metrics`` (one ``embcache-server`` process on 127.0.0.1 for the module), or, with a
   colon, is a recording rule of ``deploy/prometheus/rules``. The labels in braces after it
   (``{table,tier}``) are the labels its samples carry.
2. Errors: each ``SomethingError`` in backticks is a class of embcache (``embcache.errors``,
   ``embcache.rpc.errors``, ...) or a builtin; "`X` (a `Y`)", "`X`, a `Y`" and "`X` (an `Y`)"
   hold as ``issubclass(X, Y)``; a paragraph saying its errors are "each also a `A`, `B` or
   `C`" holds for every error it lists, and the errors page's "every error ... (and of the
   matching built-in: ...)" holds for every class of ``embcache.errors``; "`X` (CODE",
   "`X`, CODE", "CODE: `X`" and "CODE (`X`" name the gRPC status code the server sends X as.
3. Config: the option tables of docs/concepts/tiers.md name every field of ``TableConfig`` /
   ``CacheConfig`` and no other, with the dataclass's defaults; ``CacheConfig.x`` /
   ``TableConfig.x`` anywhere names a field; "`name`, default V" and "`name` (default V)"
   match the default of the field, server setting or ``Client`` argument of that name;
   "`Client(lease_ttl=30)`" names a keyword of that callable and "`sync = true`" a key of
   server.toml (a server setting or config field).
4. Flags: each ``--flag`` in backticks (or in a command of a fenced block) exists in the parser
   of the command it goes with: the command the span starts with, else the commands named in
   its paragraph (``embcache export``, ``embcache import`` and ``python -m examples.dlrm`` too), else
   any of embcache-server, ``embcache reshard``, ``embcache sizing``,
   ``python -m bench``, the demo. "`--flag`, default V", "`--flag` (default V)" and
   "default `--flag V`" match the server setting's (or parser's) default.
5. Environment: each ``EMBCACHE_X`` is a setting or CacheConfig field the server reads
   (``apply_environment``) or a variable the code reads (a string constant in embcache/ or
   bench/, ``${EMBCACHE_X`` in ./dev and scripts/).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import importlib
import inspect
import itertools
import re
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 300  # seconds: server start-up (imports) on a loaded 2-core machine


# ---------------------------------------------------------------------- reading the pages
@dataclass(frozen=True)
class Para:
    """A paragraph (non-blank lines, a table, a list) or a fenced block of a page."""

    page: str
    line: int  # of its first line
    text: str
    fenced: bool

    def where(self, offset: int) -> str:
        return f"{self.page}:{self.line + self.text.count(chr(10), 0, offset)}"


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "server" / "README.md",
            ROOT / "deploy" / "README.md"]


def _paras() -> list[Para]:
    out = []
    for page in _pages():
        rel = str(page.relative_to(ROOT))
        lines = page.read_text().split("\n")
        i = 0
        while i < len(lines):
            line = lines[i]
            if rel == "docs/benchmarks.md" and line.strip() == "<!-- bench:begin -->":  # generated figures
                while lines[i].strip() != "<!-- bench:end -->":
                    i += 1
                i += 1
                continue
            if line.lstrip().startswith("```"):
                j = i + 1
                while not lines[j].lstrip().startswith("```"):
                    j += 1
                out.append(Para(rel, i + 2, "\n".join(lines[i + 1:j]), True))
                i = j + 1
                continue
            if not line.strip():
                i += 1
                continue
            j = i
            while j < len(lines) and lines[j].strip() and not lines[j].lstrip().startswith("```"):
                j += 1
            out.append(Para(rel, i + 1, "\n".join(lines[i:j]), False))
            i = j
    return out


PARAS = _paras()
SPAN = re.compile(r"`([^`]+)`")


def _spans(p: Para) -> Iterator[tuple[int, str]]:
    """(offset, text) of each inline code span; a fenced block is one span."""
    if p.fenced:
        yield 0, p.text
    else:
        for m in SPAN.finditer(p.text):
            yield m.start(), m.group(1)


def _ids(cases: list[tuple[Any, ...]]) -> list[str]:
    return [f"{c[0]}-{c[1]}" for c in cases]


# ---------------------------------------------------------------------- 1. metrics


def _expand(name: str) -> list[str]:
    """``a_{b,c}_d`` -> ``a_b_d``, ``a_c_d`` (braces inside a name, not a trailing label set)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def _metric_mentions() -> list[tuple[str, str, str, frozenset[str]]]:
    """(where, written, name, labels named) of each metric name in code."""
    out = []
    name_rx = re.compile(r"(?<![\w:.-])([a-z_:]*embcache_[A-Za-z0-9_:]*(?:\{[a-z_,]+\}_[A-Za-z0-9_:]*)*)"
                         r"(\{[^}]*\})?")
    for p in PARAS:
        for offset, span in _spans(p):
            for m in name_rx.finditer(span):
                name, labels = m.group(1), m.group(2) or ""
                if name == "embcache_" or name.startswith("embcache_data"):
                    continue  # `grep embcache_` (the prefix); ./embcache-data is a path, not a metric
                label_names = frozenset(re.findall(r"([a-z_]+)\s*(?:[=!]~?[^,}]*)?(?=[,}])", labels))
                where = f"{p.page}:{p.line + p.text.count(chr(10), 0, offset + m.start())}"
                for full in _expand(name):
                    out.append((where, m.group(0), full, label_names))
    return out


METRICS = _metric_mentions()


def _families(text: str) -> dict[str, set[str]]:
    """Every sample and family name of an exposition, with the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            out.setdefault(name, set())
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "info": ["_info"],
                        "summary": ["_count", "_sum"]}.get(kind, [])
            for s in suffixes:
                out.setdefault(name + s, set())
        elif line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{([^}]*)\})?", line)
            assert m
            labels = set(re.findall(r'([A-Za-z_]+)="', m.group(3) or "")) - {"le"}
            out.setdefault(m.group(1), set()).update(labels)
    for name in list(out):  # a family's labels are those of its samples (histogram: _bucket etc.)
        for s in ("_total", "_bucket", "_count", "_sum", "_info"):
            if name.endswith(s) and name[:-len(s)] in out:
                out[name[:-len(s)]] |= out[name]
                out[name] |= out[name[:-len(s)]]
    return out


@pytest.fixture(scope="module")
def cache_metrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """What register_metrics exports for a small cache that wrote to and read from its store in a pass."""
    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    from embcache import CacheConfig, EmbeddingCache, TableConfig
    from embcache.metrics import register_metrics

    tables = [TableConfig(name="t", dim=4, optimizer="adagrad")]
    config = CacheConfig(hbm_bytes=20_000, ddr_bytes=40_000, device="cpu", mrc_sample_rate=1.0,
                         path=str(tmp_path_factory.mktemp("metrics") / "store"))
    with EmbeddingCache(config, tables) as cache:
        registry = CollectorRegistry()
        register_metrics(cache, registry)
        for step in range(6):
            keys = torch.arange(step * 500, step * 500 + 1000)
            cache.lookup("t", keys)
            cache.apply_gradients("t", keys, torch.ones(len(keys), 4))
        cache.prefetch({"t": torch.arange(100, 150)}).result()
        cache.begin_pass({"t": torch.arange(100, 150)})
        cache.lookup("t", torch.arange(0, 400))
        text = generate_latest(registry).decode()
        cache.end_pass().result()
    return _families(text)


@pytest.fixture(scope="module")
def server_metrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """What one real embcache-server exports on /metrics after a few calls (one failing)."""
    import torch

    from embcache.client import Client
    from embcache.server.local import LocalServer

    base = tmp_path_factory.mktemp("server")
    server = LocalServer(base / "store", tables=["name=t,dim=4"], args=["--hbm-bytes", "20000", "--ddr-bytes", "40000"],
                         metrics=True, workdir=base / "run", start_timeout=START_TIMEOUT).start()
    try:
        with Client(server.address) as client:
            client.lookup("t", torch.arange(10))
            with pytest.raises(Exception):  # noqa: B017  (any error: a NOT_FOUND sample is what is wanted)
                client.lookup("nope", torch.arange(3))
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
    finally:
        server.stop()
    return _families(text)


def _declared_labels() -> dict[str, set[str]]:
    """Family name -> the labels the code declares for it (``labels=[...]`` or a third positional list)."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / "embcache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and node.args[0].value.startswith("embcache_")):
                continue
            labels = out.setdefault(node.args[0].value, set())
            for value in [k.value for k in node.keywords if k.arg in ("labels", "labelnames")] + node.args[2:3]:
                if isinstance(value, (ast.List, ast.Tuple)):
                    labels.update(
                        e.value for e in value.elts if isinstance(e, ast.Constant))
    return out


# Exported only where something holds that a test machine may lack.
CONDITIONAL = {"embcache_memory_limit_bytes": "only under a cgroup memory limit"}


# Labels Prometheus adds to every series it scrapes: job, instance, and deploy's relabelling targets.
TARGET_LABELS = {"job", "instance", *re.findall(r"target_label: (\w+)",
                                               (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())}


def _recording_rules() -> set[str]:
    names = set()
    for path in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.update(r["record"] for r in group["rules"] if "record" in r)
    return names


@pytest.mark.parametrize(("where", "written", "name", "labels"), METRICS, ids=_ids(METRICS))
def test_metric_is_exported(where: str, written: str, name: str, labels: frozenset[str],
                            cache_metrics: dict[str, set[str]], server_metrics: dict[str, set[str]]) -> None:
    if ":" in name:
        assert name in _recording_rules(), f"{where}: `{written}` is no recording rule of deploy/prometheus/rules"
        return
    sources = [m for m in (cache_metrics, server_metrics) if name in m]
    if not sources and name in CONDITIONAL:  # not exported here: the code must still declare it
        assert name in _declared_labels(), f"{where}: `{written}`: no code declares {name}"
        sources = [{name: _declared_labels()[name]}]
    assert sources, f"{where}: `{written}` names {name}, which neither a cache's collector nor the server exports"
    carried = set().union(*(m[name] for m in sources))
    if not carried:  # no sample here (e.g. no migration ran): the labels the code declares for the family
        family = re.sub(r"_(total|bucket|count|sum|info)$", "", name)
        carried = _declared_labels().get(family, set())
    carried |= TARGET_LABELS
    assert labels <= carried, (f"{where}: `{written}` names labels {sorted(labels - carried)} that {name} "
                               f"does not carry (it carries {sorted(carried)})")


def test_metric_statements_are_found() -> None:
    assert len(METRICS) > 50 and any(":" in m[2] for m in METRICS)
    assert any(m[2] == "embcache_ssd_write_bytes_total" for m in METRICS)  # from a brace expansion


# ---------------------------------------------------------------------- 2. errors
def _error_classes() -> dict[str, type]:
    out: dict[str, type] = {n: c for n, c in vars(builtins).items()
                            if isinstance(c, type) and issubclass(c, BaseException)}
    for module in ("embcache.errors", "embcache.rpc.errors", "embcache.keyset.keyset", "embcache._extras",
                   "embcache.client"):
        for n, c in vars(importlib.import_module(module)).items():
            if isinstance(c, type) and issubclass(c, BaseException):
                out.setdefault(n, c)
    return out


ERROR = re.compile(r"`([A-Z][A-Za-z]*Error)`")
# "`X` (a `Y`", "`X` (an `Y`", "`X`, a `Y`": X is a Y
IS_A = re.compile(r"`([A-Z][A-Za-z]*Error)`(?: \(|, )an? `([A-Z][A-Za-z]*Error)`")
# "(each also a `A`, `B` or `C`)": every error the paragraph lists is one of them
EACH_ALSO = re.compile(r"each also an? ((?:`[A-Za-z]+`(?:, | or )?)+)")
# "every error ... (and of the matching built-in: `A`, `B` or `C`)": every class of embcache.errors
MATCHING_BUILTIN = re.compile(r"[Ee]very error[^.]*?subclass of `(\w+)` \(and of the matching built-in: "
                              r"((?:`[A-Za-z]+`(?:, | or )?)+)\)")


def _error_mentions() -> list[tuple[str, str, str]]:
    return [(p.where(m.start()), m.group(1), p.page) for p in PARAS if not p.fenced for m in ERROR.finditer(p.text)
            if m.group(1) != "Error"]


def _error_claims() -> list[tuple[str, str, list[str], list[str]]]:
    """(where, claim, errors, bases): each error is a subclass of one of the bases."""
    out = []
    for p in PARAS:
        if p.fenced:
            continue
        text = re.sub(r"\s+", " ", p.text)  # a claim may wrap; whitespace runs become one space

        def where(claim: str, p: Para = p) -> str:
            first = re.escape(claim.split()[0]).replace(" ", r"\s+")
            m = re.search(first, p.text)
            return p.where(m.start() if m else 0)

        for m in IS_A.finditer(text):
            out.append((where(m.group(0)), m.group(0), [m.group(1)], [m.group(2)]))
        for m in EACH_ALSO.finditer(text):
            bases = re.findall(r"`(\w+)`", m.group(1))
            listed = re.findall(r"`([A-Z]\w*Error)`", text[m.end():])
            out.append((where("each also"), m.group(0), listed, bases))
        for m in MATCHING_BUILTIN.finditer(text):
            errors = importlib.import_module("embcache.errors")
            every = [n for n in errors.__all__ if n != m.group(1)]
            out.append((where(m.group(0)), m.group(0), every, re.findall(r"`(\w+)`", m.group(2))))
            out.append((where(m.group(0)), m.group(0), every, [m.group(1)]))
    return out


ERRORS = _error_mentions()
CLAIMS = _error_claims()


@pytest.mark.parametrize(("where", "name", "page"), ERRORS, ids=_ids(ERRORS))
def test_error_type_exists(where: str, name: str, page: str) -> None:
    assert name in _error_classes(), f"{where}: `{name}` is neither an error class of embcache nor a builtin"


@pytest.mark.parametrize(("where", "claim", "errors", "bases"), CLAIMS, ids=_ids(CLAIMS))
def test_error_is_what_the_docs_say(where: str, claim: str, errors: list[str], bases: list[str]) -> None:
    classes = _error_classes()
    assert errors and bases, f"{where}: found no errors or bases in {claim!r}"
    wrong = [e for e in errors if not any(issubclass(classes[e], classes[b]) for b in bases)]
    assert not wrong, (f"{where}: {claim!r}, but " + "; ".join(
        f"{e}'s bases are {[c.__name__ for c in classes[e].__mro__[1:-2]]}" for e in wrong))


def test_error_claims_are_found() -> None:
    assert len(ERRORS) > 40
    assert any("each also" in c[1] for c in CLAIMS) and any("matching built-in" in c[1] for c in CLAIMS)
    assert any(c[2] == ["TLSMismatchError"] for c in CLAIMS)


# "`StoreFullError` (RESOURCE_EXHAUSTED", "`WrongShardError`, FAILED_PRECONDITION", "NOT_FOUND: `UnknownTableError`",
# "UNAUTHENTICATED (`UnauthenticatedError`": the status code the server sends the error as
# (embcache.rpc.errors.status_of), or, for the client's own types, the code it raises them for.
STATUS_AFTER = re.compile(r"`([A-Z]\w*Error)`(?: \(|, )([A-Z][A-Z_]{3,})\b")
STATUS_BEFORE = re.compile(r"\b([A-Z][A-Z_]{3,})(?:: | \()`([A-Z]\w*Error)`")


def _status_claims() -> list[tuple[str, str, str, str]]:
    import grpc

    codes = {c.name for c in grpc.StatusCode}
    out = []
    for p in PARAS:
        if p.fenced:
            continue
        text = re.sub(r"\s+", " ", p.text)
        found = [(m.group(0), m.group(1), m.group(2)) for m in STATUS_AFTER.finditer(text)]
        found += [(m.group(0), m.group(2), m.group(1)) for m in STATUS_BEFORE.finditer(text)]
        for written, error, code in found:
            if code in codes:
                m = re.search(re.escape(f"`{error}`"), p.text)
                out.append((p.where(m.start() if m else 0), written, error, code))
    return out


STATUS_CLAIMS = _status_claims()


@pytest.mark.parametrize(("where", "written", "error", "code"), STATUS_CLAIMS, ids=_ids(STATUS_CLAIMS))
def test_error_status_code(where: str, written: str, error: str, code: str) -> None:
    import grpc

    from embcache.rpc import errors

    cls = _error_classes().get(error)
    assert cls is not None, f"{where}: {written!r}: no error type {error}"
    sent = errors.status_of(cls.__new__(cls))[0]
    raised_for = getattr(errors, "_BY_CODE", {}).get(getattr(grpc.StatusCode, code))
    assert sent.name == code or raised_for is cls, (
        f"{where}: {written!r}, but the server sends {error} as {sent.name}")


def test_status_claims_are_found() -> None:
    assert {("StoreFullError", "RESOURCE_EXHAUSTED"), ("UnknownTableError", "NOT_FOUND")} <= {
        (c[2], c[3]) for c in STATUS_CLAIMS}


# ---------------------------------------------------------------------- 3. config options
def _config_classes() -> dict[str, type]:
    from embcache import CacheConfig, TableConfig

    return {"TableConfig": TableConfig, "CacheConfig": CacheConfig}


def _literal(text: str) -> Any:
    """A default as written: `2**24`, `True`, `"lrfu"`, `0.9`, `math.inf`; raises ValueError for prose."""
    text = text.strip().strip("`")
    if text == "math.inf":
        return float("inf")
    tree = ast.parse(text, mode="eval").body
    if isinstance(tree, ast.BinOp) and isinstance(tree.op, (ast.Pow, ast.LShift)):
        left, right = ast.literal_eval(tree.left), ast.literal_eval(tree.right)
        return left ** right if isinstance(tree.op, ast.Pow) else left << right
    return ast.literal_eval(tree)


def _option_rows() -> list[tuple[str, str, str, str, str]]:
    """(where, class, fields cell, default cell, row) of each row of the option tables of tiers.md."""
    out = []
    current = None
    for p in PARAS:
        if p.page != "docs/concepts/tiers.md" or p.fenced:
            continue
        head = re.match(r"#+ .*\(`(\w+Config)`\)", p.text)
        if head:
            current = head.group(1)
            continue
        if current and p.text.startswith("| option"):
            for n, row in enumerate(p.text.split("\n")[2:]):
                cells = [c.strip() for c in row.strip("|").split("|")]
                out.append((f"{p.page}:{p.line + 2 + n}", current, cells[0], cells[1], row))
    return out


OPTION_ROWS = _option_rows()


def _split_cell(cell: str) -> list[str]:
    """Top-level comma-separated items (commas inside backticks or parentheses do not split)."""
    items, depth, tick, cur = [], 0, False, ""
    for ch in cell:
        tick ^= ch == "`"
        depth += (ch == "(") - (ch == ")") if not tick else 0
        if ch == "," and depth == 0 and not tick:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*items, cur.strip()]


@pytest.mark.parametrize(("where", "cls", "fields", "defaults", "row"), OPTION_ROWS, ids=_ids(OPTION_ROWS))
def test_option_table_row(where: str, cls: str, fields: str, defaults: str, row: str) -> None:
    real = {f.name: f for f in dataclasses.fields(_config_classes()[cls])}
    names = re.findall(r"`(\w+)`", fields)
    assert names, f"{where}: no option in {row!r}"
    unknown = [n for n in names if n not in real]
    assert not unknown, f"{where}: {cls} has no field {unknown} (it has {sorted(real)})"
    values = [defaults] if len(names) == 1 else _split_cell(defaults)
    if defaults == "required":
        values = ["required"] * len(names)
    assert len(values) == len(names), f"{where}: {len(names)} options but {len(values)} defaults in {row!r}"
    for name, value in zip(names, values, strict=True):
        f = real[name]
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if value == "required":
            assert default is dataclasses.MISSING, (
                f"{where}: {cls}.{name} is documented required, has default {default!r}")
            continue
        assert default is not dataclasses.MISSING, f"{where}: {cls}.{name} is required, documented default {value!r}"
        try:
            stated = _literal(value) if value.startswith("`") and value.endswith("`") else None
        except (ValueError, SyntaxError):  # `1/sqrt(dim)`, `cuda`, `./embcache-data`: computed or a plain word
            stated = value.strip("`")
            if default is not None:
                assert str(default) == stated, f"{where}: {cls}.{name} defaults to {default!r}, documented {value}"
            continue
        if stated is None:  # prose ("torch's default", "1/8 of RAM ..."): the field computes it
            assert default is None, f"{where}: {cls}.{name} defaults to {default!r}, documented as {value!r}"
        else:
            assert (default == stated and type(default) is type(stated)) or (
                isinstance(default, float) and default == stated), (
                f"{where}: {cls}.{name} defaults to {default!r}, documented {value}")


@pytest.mark.parametrize("cls", ["TableConfig", "CacheConfig"])
def test_option_tables_name_every_field(cls: str) -> None:
    named = {n for _, c, fields, _, _ in OPTION_ROWS if c == cls for n in re.findall(r"`(\w+)`", fields)}
    missing = [f.name for f in dataclasses.fields(_config_classes()[cls]) if f.name not in named]
    assert not missing, (f"docs/concepts/tiers.md: the {cls} table (\"every option\", docs/index.md) "
                         f"lacks {missing}")


def _field_mentions() -> list[tuple[str, str, str]]:
    return [(p.where(m.start()), m.group(1), m.group(2)) for p in PARAS
            for m in re.finditer(r"\b(CacheConfig|TableConfig)\.([a-z_]+)\b", p.text)]


FIELD_MENTIONS = _field_mentions()


@pytest.mark.parametrize(("where", "cls", "name"), FIELD_MENTIONS, ids=_ids(FIELD_MENTIONS))
def test_config_field_exists(where: str, cls: str, name: str) -> None:
    assert name in {f.name for f in dataclasses.fields(_config_classes()[cls])}, f"{where}: {cls} has no field {name}"


def _known_defaults() -> dict[str, list[tuple[str, Any]]]:
    """name -> (owner, default) of every config field, server setting and Client argument."""
    from embcache.client import Client
    from embcache.server.settings import ServerSettings

    out: dict[str, list[tuple[str, Any]]] = {}
    for cls in (*_config_classes().values(), ServerSettings):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out.setdefault(f.name, []).append((cls.__name__, f.default))
    for owner, fn in (("Client", Client.__init__), *_store_inits()):
        for p in inspect.signature(fn).parameters.values():
            if p.default is not inspect.Parameter.empty:
                out.setdefault(p.name, []).append((owner, p.default))
    return out


def _store_inits() -> list[tuple[str, Callable[..., Any]]]:
    from embcache.stores.lmdb import LMDBStore

    return [("LMDBStore", LMDBStore.__init__)]


NUMBER = r"(\d+(?:\.\d+)?)(?: ?([KMGT]iB|s))?\b"
# "`name`, default 60 s", "`name` (default 30)", "`name` (default 1 TiB", "default `--name 0`"
STATED = re.compile(r"`(-{0,2}[\w-]+)`(?:,| \()\s*default " + NUMBER
                    + r"|default `(--[\w-]+) " + NUMBER + "`")


def _number(value: str, unit: str | None) -> float:
    return float(value) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}.get(unit or "", 1)


def _stated_defaults() -> list[tuple[str, str, str, float]]:
    out = []
    for p in PARAS:
        if p.fenced:
            continue
        text = p.text
        for m in STATED.finditer(text):
            name = m.group(1) or m.group(4)
            value, unit = (m.group(2), m.group(3)) if m.group(1) else (m.group(5), m.group(6))
            out.append((p.where(m.start()), m.group(0).replace("\n", " "), name, _number(value, unit)))
    return out


DEFAULTS = _stated_defaults()


@pytest.mark.parametrize(("where", "written", "name", "value"), DEFAULTS, ids=_ids(DEFAULTS))
def test_stated_default(where: str, written: str, name: str, value: float) -> None:
    if name.startswith("--"):
        parser = _server_parser()
        action = next((a for a in parser._actions if name in a.option_strings), None)
        assert action, f"{where}: {written!r}: embcache-server has no {name}"
        help_default = re.search(r"\(default " + NUMBER, action.help or "")
        assert help_default and _number(help_default.group(1), help_default.group(2)) == value, (
            f"{where}: {written!r}, but embcache-server --help says {action.help!r}")
        name = name[2:].replace("-", "_")
    owners = _known_defaults().get(name)
    assert owners, f"{where}: {written!r}: no config field, server setting or Client argument is named {name}"
    assert any(isinstance(d, (int, float)) and not isinstance(d, bool) and d == value for _, d in owners), (
        f"{where}: {written!r}, but the code's default is " + ", ".join(f"{o}.{name}={d!r}" for o, d in owners))


def test_stated_defaults_are_found() -> None:
    names = {d[2] for d in DEFAULTS}
    assert {"--grace-seconds", "--drain-seconds", "timeout", "retries"} <= names, names


# "`Client(lease_ttl=30)`": a keyword of a callable of embcache's namespace; "`sync = true`", a
# server.toml key: a server setting or a [cache] / [[tables]] field.
CALL_KW = re.compile(r"^(\w+)\((\w+)=[^`]*\)$")
TOML_KEY = re.compile(r"^([a-z_]+) = (\"[^\"]*\"|true|false|[0-9][0-9_.]*)$")


def _keyword_mentions() -> list[tuple[str, str, str, str]]:
    out = []
    for p in PARAS:
        if p.fenced:
            continue
        for offset, span in _spans(p):
            flat = re.sub(r"\s+", " ", span)
            call, key = CALL_KW.match(flat), TOML_KEY.match(flat)
            if call:
                out.append((p.where(offset), flat, call.group(1), call.group(2)))
            elif key:
                out.append((p.where(offset), flat, "server.toml", key.group(1)))
    return out


KEYWORDS = _keyword_mentions()


@pytest.mark.parametrize(("where", "written", "owner", "name"), KEYWORDS, ids=_ids(KEYWORDS))
def test_keyword_exists(where: str, written: str, owner: str, name: str) -> None:
    import embcache
    from embcache.server.settings import ServerSettings

    if owner == "server.toml":
        keys = {f.name for cls in (ServerSettings, *_config_classes().values()) for f in dataclasses.fields(cls)}
        assert name in keys, f"{where}: `{written}`: {name} is no server setting nor config field"
        return
    fn = getattr(embcache, owner, None)
    assert fn is not None, f"{where}: `{written}`: embcache has no {owner}"
    assert name in inspect.signature(fn).parameters, f"{where}: `{written}`: {owner} takes no {name}"


def test_keyword_statements_are_found() -> None:
    assert {("Client", "lease_ttl"), ("server.toml", "sync")} <= {(k[2], k[3]) for k in KEYWORDS}


# ---------------------------------------------------------------------- 4. flags
def _ast_flags(path: Path) -> set[str]:
    """The option strings of every ``add_argument`` call in a script whose parser lives inside main()."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                         and a.value.startswith("-"))
    return flags


def _server_parser() -> argparse.ArgumentParser:
    from embcache.server.main import build_parser

    return build_parser()


_FLAGS: dict[str, set[str]] = {}


# the benchmark and profiling scripts run as ``bench/NAME.py`` that take flags (those without, such
# as readme.py, name no flag a sentence beside them could mean)
_BENCH_SCRIPTS = sorted(p for p in (ROOT / "bench").glob("*.py")
                        if not p.name.startswith("_") and ".add_argument(" in p.read_text())


def _flag_sets() -> dict[str, set[str]]:
    """Command -> its flags: the real parsers where a function builds them, else the scripts' add_argument calls."""
    if not _FLAGS:
        from embcache import reshard, sizing
        from embcache.export import commands

        _FLAGS["embcache-server"] = set(_server_parser()._option_string_actions)
        for name, module in (("embcache reshard", reshard), ("embcache sizing", sizing)):
            p = argparse.ArgumentParser(prog=name)
            module.add_arguments(p)
            _FLAGS[name] = set(p._option_string_actions)
        for name, add in (("embcache export", commands.add_export_arguments),
                          ("embcache import", commands.add_import_arguments)):
            p = argparse.ArgumentParser(prog=name)
            add(p)
            _FLAGS[name] = set(p._option_string_actions)
        _FLAGS["python -m examples.dlrm"] = _ast_flags(ROOT / "examples" / "dlrm.py")
        _FLAGS["python -m bench"] = _ast_flags(ROOT / "bench" / "__main__.py")
        _FLAGS["python -m bench.ab"] = _ast_flags(ROOT / "bench" / "ab.py")
        _FLAGS["demo"] = _ast_flags(ROOT / "embcache" / "demo.py")
        for path in _BENCH_SCRIPTS:
            _FLAGS[f"bench/{path.name}"] = _ast_flags(path)
    return _FLAGS


# A command as written in the docs -> its parser (None: someone else's tool, whose flags are not ours).
COMMANDS: list[tuple[re.Pattern[str], str | None]] = [
    (re.compile(r"embcache-server\b|python3? -m embcache\.server\b"), "embcache-server"),
    (re.compile(r"embcache reshard\b"), "embcache reshard"),
    (re.compile(r"embcache sizing\b"), "embcache sizing"),
    (re.compile(r"embcache export\b"), "embcache export"),
    (re.compile(r"embcache import\b"), "embcache import"),
    (re.compile(r"python3? -m examples\.dlrm\b"), "python -m examples.dlrm"),
    (re.compile(r"python3? -m bench(?![.\w])"), "python -m bench"),
    (re.compile(r"python3? -m bench\.ab\b"), "python -m bench.ab"),
    (re.compile(r"\./dev demo\b|embcache-demo\b|python3? -m embcache(?![.\w-])"), "demo"),
    (re.compile(r"\b[Tt]he server\b|\bserver's\b"), "embcache-server"),
    *((re.compile(r"\b(?:bench/)?" + re.escape(p.name)), f"bench/{p.name}")
      for p in _BENCH_SCRIPTS),
    (re.compile(r"\b(?:kubectl|pip|docker|torchrun|mkdocs|curl|helm|promtool|git|grpcurl|sed|uv)\b"), None),
]
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
# Flags of other tools, named alone in a paragraph about them.
FOREIGN = {"--no-deps": "pip", "--cascade": "kubectl", "--build-arg": "docker"}


def _commands_in(text: str) -> list[tuple[int, int, str | None]]:
    """(start, end, command) of each command named in text, in order."""
    found = [(m.start(), m.end(), cmd) for rx, cmd in COMMANDS for m in rx.finditer(text)]
    return sorted(found)


# Where a sentence ends: after . ; ! ? before a capital, a backtick or a parenthesis; a list item; a table row.
SENTENCE_END = re.compile(r"(?<=[.;!?])\s+(?=[A-Z`(*])|\n\s*(?:[-*|]|\d+\.) ")
MAIN_COMMANDS = ("embcache-server", "embcache reshard", "embcache sizing", "python -m bench", "demo")


def _sentence(text: str, at: int) -> str:
    starts = [0, *(m.end() for m in SENTENCE_END.finditer(text))]
    start = max(s for s in starts if s <= at)
    end = min([m.start() for m in SENTENCE_END.finditer(text) if m.start() > at] or [len(text)])
    return re.sub(r"\s+", " ", text[start:end])


def _flag_mentions() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(where, flag, written, commands it may belong to)."""
    out = []
    for p in PARAS:
        spans: list[tuple[int, str]]
        if p.fenced:  # each command line (with its \ continuations) is a span
            spans, offset = [], 0
            for line in re.split(r"(?<!\\)\n", p.text):
                spans.append((offset, line))
                offset += len(line) + 1
        else:
            spans = [(o + 1, s) for o, s in _spans(p)]
        for offset, span in spans:
            flat = span.replace("\n", " ")
            here = _commands_in(flat)
            for m in FLAG.finditer(flat):
                before = [c for s, e, c in here if e <= m.start()]
                if before:  # the flag follows a command in its span: that command's
                    if before[-1] is None:
                        continue
                    candidates: tuple[str, ...] = (before[-1],)
                elif p.fenced or here:
                    continue  # in a fenced block, only flags of a command line are ours
                elif m.group(1) in FOREIGN:
                    continue
                else:  # a flag alone: of the commands its sentence names, else of one of ours
                    named = [c for _, _, c in _commands_in(_sentence(p.text, offset + m.start())) if c]
                    candidates = tuple(dict.fromkeys(named)) or MAIN_COMMANDS
                where = f"{p.page}:{p.line + p.text.count(chr(10), 0, offset + m.start())}"
                out.append((where, m.group(1), flat[:80], candidates))
    return out


FLAGS = _flag_mentions()


@pytest.mark.parametrize(("where", "flag", "written", "commands"), FLAGS, ids=_ids(FLAGS))
def test_flag_exists(where: str, flag: str, written: str, commands: tuple[str, ...]) -> None:
    flags = _flag_sets()
    have = [c for c in commands if flag in flags[c]]
    assert have, f"{where}: `{written}`: {flag} is no flag of {' or '.join(commands)}"


def test_flag_statements_are_found() -> None:
    assert len(FLAGS) > 40
    assert any(f[1] == "--tls-ca" and f[3] == ("embcache reshard",) for f in FLAGS)
    assert any(f[1] == "--memory-hit" and f[3] == ("embcache sizing",) for f in FLAGS)


# ---------------------------------------------------------------------- 5. environment variables
ENV = re.compile(r"\bEMBCACHE_[A-Z0-9_]*[A-Z0-9]\b(?!<)")


def _env_mentions() -> list[tuple[str, str]]:
    return [(p.where(m.start()), m.group(0)) for p in PARAS for m in ENV.finditer(p.text)]


def _env_read_by_code() -> set[str]:
    from embcache import CacheConfig
    from embcache.server.settings import ServerSettings

    names = {f"EMBCACHE_{f.name.upper()}" for cls in (ServerSettings, CacheConfig) for f in dataclasses.fields(cls)
             if f.name not in ("cache", "tables") and not str(f.type).startswith("list")}
    for path in itertools.chain((ROOT / "embcache").rglob("*.py"), (ROOT / "bench").rglob("*.py"),
                                [ROOT / "tests" / "conftest.py"]):  # the test harness's own variables
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"EMBCACHE_[A-Z0-9_]+", node.value):
                names.add(node.value)
    for path in (ROOT / "dev", *(ROOT / "scripts").glob("*.sh")):
        names.update(re.findall(r"\$\{(EMBCACHE_[A-Z0-9_]+)", path.read_text()))
    return names


ENVS = _env_mentions()


@pytest.mark.parametrize(("where", "name"), ENVS, ids=_ids(ENVS))
def test_environment_variable_is_read(where: str, name: str) -> None:
    assert name in _env_read_by_code(), f"{where}: nothing reads {name} (no setting, CacheConfig field or variable)"


def test_environment_statements_are_found() -> None:
    assert {"EMBCACHE_HBM_BYTES"} <= {e[1] for e in ENVS}
