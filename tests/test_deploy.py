"""Deployment assets under deploy/, checked by the real tools, and a real Prometheus scraping a real server.

- promtool: the scrape config, the rules, the rules' unit tests, every PromQL expression of the
  Grafana dashboard, and the /metrics text of a cache and of a server under a workload;
- kubernetes-validate --strict on every manifest, hadolint on the Dockerfile, and the
  cross-references between them and the server (ports, flags, config file, probes, user id);
- Debian's Prometheus scraping ``python -m embcache.server`` every second, with the recording
  rules loaded: the hit ratios it records equal the server's own stats().

The tools come from scripts/install-ci-tools.sh. A missing tool makes its tests skip, saying what
to install, except under CI=true, where it fails them (CI must run them all).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, start_http_server

from embcache import CacheConfig, EmbeddingCache, TableConfig
from embcache.metrics import register_metrics

try:
    import yaml
except ImportError:  # PyYAML comes with kubernetes-validate (scripts/install-ci-tools.sh)
    yaml = None
try:
    import jsonschema
except ImportError:  # a test dependency (pyproject.toml), also kubernetes-validate's
    jsonschema = None

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
PROM = DEPLOY / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
DASHBOARD = DEPLOY / "grafana" / "embcache.json"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
# prometheus-operator objects: applied only where its CRDs are installed, so kept out of MANIFESTS.
OPERATOR_MANIFESTS = sorted((DEPLOY / "kubernetes" / "prometheus-operator").glob("*.yaml"))
# The CRDs' OpenAPI schemas, trimmed to the fields used (each file names its source version).
CRD_SCHEMAS = REPO / "tests" / "data" / "crd-schemas"
RUNBOOKS = REPO / "docs" / "runbooks"

# Metrics the dashboard and rules use that an embedded cache does not export: the server's request
# histogram (checked against a live server below).
NOT_FROM_EMBEDDED_CACHE = {
    "embcache_rpc_request_duration_seconds",
    "embcache_shard_map_version",
    "embcache_migration_pending",
    "embcache_migration_rows_total",
    "embcache_memory_limit_bytes",
    "embcache_build_info",
}
# Metrics the rules use that wait on a field of EmbeddingCache.stats() (deploy/README.md, "Metrics"):
# metric -> (stats section, field). Once stats() reports the field, the metric must be exported.
WAITING_ON_STATS = {
    "embcache_prefetch_running_seconds": ("prefetch", "running_seconds"),
}


def not_exported_yet(stats: dict[str, Any]) -> set[str]:
    """The metrics of WAITING_ON_STATS whose field ``stats()`` does not report yet."""
    first = next(iter(stats.values()))
    return {name for name, (section, field) in WAITING_ON_STATS.items() if field not in first[section]}


def missing(what: str) -> None:
    """``what`` is not installed: fail under CI=true (it must have every tool), else skip saying what to install."""
    message = (f"{what} is not installed: run scripts/install-ci-tools.sh (promtool and prometheus come from "
               f"Debian's 'prometheus' package, apt as root)")
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (required under CI=true)")
    pytest.skip(message)


def tool(name: str) -> str:
    """Path of a command-line tool (PATH, then the venv's bin/), or fail telling how to install it."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        missing(name)
    return str(found)


@pytest.fixture(autouse=True)
def _needs_yaml() -> None:
    if yaml is None:
        missing("PyYAML")


def prometheusrule_script() -> Any:
    """scripts/prometheusrule.py as a module (it generates the PrometheusRule; RUNBOOK_BASE is its runbook base)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("prometheusrule", REPO / "scripts" / "prometheusrule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(args: list[str], stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ Prometheus config and rules
def test_promtool_check_config() -> None:
    out = run([tool("promtool"), "check", "config", str(PROM / "prometheus.yml")])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(RULE_FILES)} rule files found" in out.stdout + out.stderr


def test_promtool_check_rules() -> None:
    out = run([tool("promtool"), "check", "rules", *map(str, RULE_FILES)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULE_FILES) == 2


def test_promtool_rule_unit_tests() -> None:
    tests = sorted((PROM / "tests").glob("*.yml"))
    assert tests
    out = run([tool("promtool"), "test", "rules", *map(str, tests)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout and "FAILED" not in out.stdout


def load_rules() -> tuple[dict[str, str], dict[str, str]]:
    """(recording rule name -> expr, alert name -> expr) of every rule file."""
    records, alerts = {}, {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    records[rule["record"]] = rule["expr"]
                else:
                    alerts[rule["alert"]] = rule["expr"]
    return records, alerts


def test_every_rule_is_unit_tested() -> None:
    """Each alert has a case where it fires and one where it does not; each recording rule is evaluated."""
    records, alerts = load_rules()
    assert {"EmbcacheServerDown", "EmbcacheHitRatioDrop", "EmbcacheSsdSlow", "EmbcacheStoreDiskNearlyFull",
            "EmbcachePrefetchFallingBehind"} <= set(alerts)
    fires: set[str] = set()
    silent: set[str] = set()
    exprs: list[str] = []
    for path in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (fires if t.get("exp_alerts") else silent).add(t["alertname"])
            exprs += [t["expr"] for t in case.get("promql_expr_test", [])]
    assert set(alerts) <= fires, f"alerts never shown firing: {set(alerts) - fires}"
    assert set(alerts) <= silent, f"alerts never shown silent: {set(alerts) - silent}"
    # A recording rule counts as tested when a test queries it or a tested alert uses it.
    used = " ".join(exprs) + " ".join(alerts.values())
    untested = [name for name in records if not re.search(re.escape(name) + r"(?![\w:])", used)]
    assert not untested, f"recording rules no test evaluates: {untested}"


# ------------------------------------------------------------------ runbooks
def alert_rules() -> dict[str, dict[str, Any]]:
    """Alert name -> its rule (expr, for, labels, annotations) of every rule file."""
    return {rule["alert"]: rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"] if "alert" in rule}


def test_every_alert_links_its_runbook() -> None:
    """Each alert's runbook_url is the runbook base + its name, and docs/runbooks/<alert>.md is its page."""
    base = prometheusrule_script().RUNBOOK_BASE
    # The base is an absolute URL (Alertmanager cannot resolve a path in the repository) ending in the pages' folder.
    assert base.startswith("https://") and base.endswith(f"/{RUNBOOKS.relative_to(REPO).as_posix()}/")
    alerts = alert_rules()
    assert len(alerts) >= 14
    index = (RUNBOOKS / "README.md").read_text()
    for name, rule in alerts.items():
        assert rule["annotations"].get("runbook_url") == f"{base}{name}.md", name
        page = RUNBOOKS / f"{name}.md"
        assert page.is_file(), f"{name} has no runbook: {page.relative_to(REPO)}"
        text = page.read_text()
        assert text.startswith(f"# {name}\n"), page.name
        assert f"**Severity:** {rule['labels']['severity']}." in text, page.name
        for section in ("## What it means", "## Confirm", "## What to do", "## Fixed when"):
            assert f"\n{section}\n" in text, (page.name, section)
        assert f"[{name}.md]({name}.md)" in index, f"docs/runbooks/README.md does not list {name}"
    pages = {p.stem for p in RUNBOOKS.glob("*.md")} - {"README"}
    assert pages == set(alerts), f"runbooks of no alert: {sorted(pages - set(alerts))}"


def test_rule_unit_tests_assert_the_runbook_urls() -> None:
    """promtool compares a firing alert's annotations exactly: each alert's tests name its runbook_url."""
    alerts = alert_rules()
    checked: set[str] = set()
    for path in (PROM / "tests").glob("*.yml"):
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                for expected in t.get("exp_alerts") or []:
                    url = expected["exp_annotations"].get("runbook_url")
                    assert url == alerts[t["alertname"]]["annotations"]["runbook_url"], (case["name"], t["alertname"])
                    checked.add(t["alertname"])
    assert checked == set(alerts), f"alerts whose runbook_url no test asserts: {set(alerts) - checked}"


def test_runbooks_name_real_panels_sections_and_pages() -> None:
    """A quoted name in a runbook is a dashboard panel or a deploy/README.md section; links lead to pages."""
    dash = json.loads(DASHBOARD.read_text())
    panels = {p["title"] for p in dashboard_panels(dash)}
    readme = re.sub(r"```.*?```", "", (DEPLOY / "README.md").read_text(), flags=re.S)
    sections = set(re.findall(r"^#+ (.+)$", readme, re.M)) | set(re.findall(r"\*\*([^*]+?)\.\*\*", readme))
    for page in sorted(RUNBOOKS.glob("*.md")):
        prose = re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
        for quoted in re.findall(r'"([^"]+)"', prose):
            name = " ".join(quoted.split())
            assert name in panels | sections, f"{page.name}: {name!r} is no dashboard panel nor deploy/README section"
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            assert (RUNBOOKS / target).is_file(), f"{page.name} links to {target}, which does not exist"


# ------------------------------------------------------------------ Grafana dashboard
def dashboard_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and the inner selector of label_values()."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard_panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
            assert m, var["query"]
            exprs.append(m.group(1))
    return exprs


def concrete(expr: str) -> str:
    """Grafana variables replaced by values Prometheus accepts."""
    for var, value in (("$__rate_interval", "1m"), ("$__interval", "15s"), ("$__range", "1h"),
                       ("$job", "embcache"), ("$instance", "a"), ("$table", "user")):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def promtool_check_exprs(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard_query_{i}", "expr": concrete(e)} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    return run([tool("promtool"), "check", "rules", str(path)])


def test_dashboard_promql_is_valid(tmp_path: Path) -> None:
    exprs = dashboard_queries()
    assert len(exprs) >= 30
    out = promtool_check_exprs(exprs, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout
    # The same check rejects a broken expression (a missing parenthesis).
    bad = promtool_check_exprs([exprs[0], "sum by (table) (rate(embcache_lookups_total[1m])"], tmp_path)
    assert bad.returncode != 0 and "dashboard_query_1" in bad.stdout + bad.stderr


def test_dashboard_layout_and_variables() -> None:
    dash = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "job", "instance", "table"]
    panels = list(dashboard_panels(dash))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
            # Every series is filtered by the shard variable, per-table ones by the table variable too (the
            # server's RPC, disk, process and resharding series have no table).
            # (recording rules sum over shards: they have no instance)
            raw = re.findall(r'(?<![\w:])([a-z_]+)\{job=~"\$job"(,instance=~"\$instance")?', t["expr"])
            assert all(filtered for _, filtered in raw), t["expr"]
            if not re.search(r"rpc_request|filesystem|process_|memory_limit|shard_map|migration_", t["expr"]):
                assert 'table=~"$table"' in t["expr"], t["expr"]
    exprs = " ".join(dashboard_queries())
    for needed in ("embcache_tier_hit_ratio", "embcache_mrc_hit_ratio", "embcache_lookups_total",
                   "histogram_quantile(0.99", "embcache_tier_demotions_total", "embcache_tier_resident_bytes",
                   "embcache_ssd_read_bytes_total", "embcache_ssd_write_bytes_total", "process_resident_memory_bytes",
                   "process_cpu_seconds_total", "embcache_memory_limit_bytes", "embcache_shard_map_version"):
        assert needed in exprs, needed


def metric_names(text: str) -> set[str]:
    """Names of raw embcache metrics in PromQL (not recording rules, whose names hold colons)."""
    names = set(re.findall(r"(?<![\w:])embcache_\w+(?![\w:])", text))
    return {re.sub(r"_(bucket|count|sum)$", "", n) if "duration_seconds" in n else n for n in names}


# ------------------------------------------------------------------ /metrics of a real cache
@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[tuple[EmbeddingCache, int]]:
    """A real cache (RocksDB under tmp_path) after a small workload, exported on 127.0.0.1:<port>/metrics."""
    cache = EmbeddingCache(CacheConfig(hbm_bytes=64 * 100, ddr_bytes=256 * 100, path=str(tmp_path / "store"),
                                       device="cpu"),
                           [TableConfig(name="user", dim=8, optimizer="adagrad", seed=1),
                            TableConfig(name="item", dim=4, seed=2)])
    registry = CollectorRegistry()
    register_metrics(cache, registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        gen = torch.Generator().manual_seed(0)
        for _ in range(20):
            keys = (torch.rand(256, generator=gen) ** 3 * 2000).long()  # skewed: some keys hot
            cache.lookup("user", keys)
            cache.apply_gradients("user", keys, torch.randn(256, 8, generator=gen))
            cache.lookup("item", keys % 300)
        cache.prefetch({"user": torch.arange(5000, 5040)}).result(timeout=60)
        cache.begin_pass({"user": torch.arange(5000, 5040)})
        cache.lookup("user", torch.arange(5000, 5010))
        cache.end_pass()
        yield cache, server.server_port
    finally:
        server.shutdown()
        thread.join(timeout=5)
        cache.close()


def fetch(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def test_metrics_pass_promtool_check_metrics(exporter: tuple[EmbeddingCache, int]) -> None:
    _, port = exporter
    text = fetch(f"http://127.0.0.1:{port}/metrics")
    families = set(re.findall(r"^# TYPE (embcache_\w+) ", text, re.M))
    assert len(families) >= 30, families
    assert {"embcache_tier_misses_total", "embcache_store_filesystem_avail_bytes", "embcache_mrc_hit_ratio"} <= families
    assert "embcache_ssd_op_duration_seconds" in families  # the cache times its store operations
    out = run([tool("promtool"), "check", "metrics"], stdin=text)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
    # The same check complains about a counter without _total and a time not in seconds.
    bad = "# HELP embcache_x_ms Bad.\n# TYPE embcache_x_ms counter\nembcache_x_ms 1\n"
    out = run([tool("promtool"), "check", "metrics"], stdin=bad)
    assert out.returncode != 0 and "embcache_x_ms" in out.stdout + out.stderr


def test_dashboard_and_rules_use_exported_metrics(exporter: tuple[EmbeddingCache, int]) -> None:
    """Every raw metric the dashboard and rules query is one the cache exports (catches typos)."""
    cache, port = exporter
    exported = set(re.findall(r"^# TYPE (embcache_\w+) ", fetch(f"http://127.0.0.1:{port}/metrics"), re.M))
    records, alerts = load_rules()
    used = metric_names(" ".join(dashboard_queries()) + " ".join(records.values()) + " ".join(alerts.values()))
    assert len(used) >= 25
    assert set(WAITING_ON_STATS) <= used  # still needed, else drop it from WAITING_ON_STATS
    unknown = used - exported - NOT_FROM_EMBEDDED_CACHE - not_exported_yet(cache.stats())
    assert not unknown, f"queried but not exported: {sorted(unknown)}"
    dash_and_rules = " ".join(dashboard_queries()) + " ".join(alerts.values())
    for record in records:  # every recording rule is shown or alerted on
        assert re.search(re.escape(record) + r"(?![\w:])", dash_and_rules), record


def test_runbooks_name_exported_metrics(exporter: tuple[EmbeddingCache, int]) -> None:
    """Every raw metric a runbook tells the operator to query is one the cache or the server exports."""
    cache, port = exporter
    exported = set(re.findall(r"^# TYPE (embcache_\w+) ", fetch(f"http://127.0.0.1:{port}/metrics"), re.M))
    used = metric_names(" ".join(p.read_text() for p in RUNBOOKS.glob("*.md")))
    assert len(used) >= 25
    unknown = used - exported - NOT_FROM_EMBEDDED_CACHE - not_exported_yet(cache.stats())
    assert not unknown, f"named in docs/runbooks but not exported: {sorted(unknown)}"


def test_latency_histogram_passes_promtool_check_metrics(exporter: tuple[EmbeddingCache, int]) -> None:
    """The store latency histogram is valid exposition text with durations in every bucket, +Inf included.

    The real cache's own histogram (a few fast operations) is checked by the test above; this one
    replaces it with durations from 50 us to 9 s so that every bucket boundary is exercised.
    """
    from prometheus_client import generate_latest

    from embcache.metrics import LatencyHistogram

    cache, _ = exporter
    hist = LatencyHistogram()
    for seconds in (0.00005, 0.0003, 0.002, 0.04, 0.7, 9.0):
        hist.observe(seconds)
    stats = cache.stats()
    for s in stats.values():
        s["ssd"].update(read_latency=hist.snapshot(), write_latency=hist.snapshot())

    class Snapshot:  # the real cache's stats, frozen with these histograms in
        closed = False

        def stats(self) -> dict[str, Any]:
            return stats

    registry = CollectorRegistry()
    register_metrics(Snapshot(), registry)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE embcache_ssd_op_duration_seconds histogram") == 1
    assert 'embcache_ssd_op_duration_seconds_bucket{le="+Inf",op="write",table="user"} 6.0' in text
    out = run([tool("promtool"), "check", "metrics"], stdin=text)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def test_rpc_metrics_pass_promtool_check_metrics() -> None:
    """The server's RPC families (embcache's histogram and the grpc_server_* names) are valid exposition
    text, every bucket exercised, and agree per method and code."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from embcache.rpc.v1 import embcache_pb2 as pb
    from embcache.server.rpcmetrics import RpcMetrics
    from embcache.server.serve import _LATENCY_BUCKETS

    metrics = RpcMetrics(pb.DESCRIPTOR.services_by_name["EmbeddingCacheService"], _LATENCY_BUCKETS)
    registry = CollectorRegistry()
    registry.register(metrics)
    for i, seconds in enumerate((0.0, 0.0004, 0.0005, 0.003, 0.04, 0.7, 9.0, 31.0)):
        metrics.started("Lookup")
        metrics.handled("Lookup", "OK" if i % 3 else "NOT_FOUND", seconds)
    metrics.started("PrefetchStream")
    for _ in range(3):
        metrics.received("PrefetchStream")
        metrics.sent("PrefetchStream")
    metrics.handled("PrefetchStream", "CANCELLED", 0.2)
    text = generate_latest(registry).decode()
    out = run([tool("promtool"), "check", "metrics"], stdin=text)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    service = ("grpc_service", "embcache.rpc.v1.EmbeddingCacheService")
    lookup = (("grpc_method", "Lookup"), service, ("grpc_type", "unary"))
    assert samples[("grpc_server_started_total", lookup)] == 8
    assert samples[("grpc_server_msg_received_total", lookup)] == 8
    assert samples[("grpc_server_msg_sent_total", lookup)] == 5  # one reply per call that ended OK
    assert samples[("grpc_server_handling_seconds_count", lookup)] == 8
    assert samples[("grpc_server_handling_seconds_bucket", (*lookup, ("le", "0.0005")))] == 3  # le: <= the bound
    assert samples[("grpc_server_handling_seconds_bucket", (*lookup, ("le", "30.0")))] == 7
    own = {(dict(k[1])["method"], dict(k[1])["code"]): v for k, v in samples.items()
           if k[0] == "embcache_rpc_request_duration_seconds_count"}
    std = {(dict(k[1])["grpc_method"], dict(k[1])["grpc_code"]): v for k, v in samples.items()
           if k[0] == "grpc_server_handled_total"}
    assert own == std == {("Lookup", "NOT_FOUND"): 3, ("Lookup", "OK"): 5, ("PrefetchStream", "CANCELLED"): 1}
    stream = (("grpc_method", "PrefetchStream"), service, ("grpc_type", "bidi_stream"))
    assert samples[("grpc_server_msg_received_total", stream)] == samples[("grpc_server_msg_sent_total", stream)] == 3


# ------------------------------------------------------------------ Kubernetes and the image
def test_kubernetes_manifests_validate_strict() -> None:
    assert {p.name for p in MANIFESTS} >= {"statefulset.yaml", "service.yaml", "configmap.yaml", "networkpolicy.yaml"}
    out = run([tool("kubernetes-validate"), "--strict", *map(str, MANIFESTS)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert (out.stdout + out.stderr).count(" passed for resource ") == len(MANIFESTS)


def manifests() -> dict[str, dict[str, Any]]:
    docs = [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_kubernetes_manifests_fit_together() -> None:
    m = manifests()
    sts, svc, cm = m["StatefulSet"], m["Service"], m["ConfigMap"]
    pod = sts["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert m["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert args["listen"] == f"0.0.0.0:{ports['grpc']}"
    assert int(args["metrics-port"]) == ports["metrics"] == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"grpc": "grpc", "metrics": "metrics"}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == ports["grpc"], probe
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys()
    # The config file the server reads is a key of the ConfigMap mounted where --config points.
    mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    config_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert volumes[config_volume]["configMap"]["name"] == cm["metadata"]["name"]
    assert args["config"] == f"{mounts[config_volume]}/server.toml" and "server.toml" in cm["data"]
    # The store lives on the shard's own volume.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert args["path"].startswith(mounts[claim["metadata"]["name"]] + "/")
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30
    # Prometheus finds the shards through the Service's SRV records of the metrics port.
    scrape = yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"][0]
    (name,) = scrape["dns_sd_configs"][0]["names"]
    assert name.startswith(f"_metrics._tcp.{svc['metadata']['name']}.")


def test_server_accepts_the_manifests_config_and_flags(tmp_path: Path) -> None:
    """The real server's option parser takes the ConfigMap's file with the StatefulSet's flags."""
    from embcache.server.main import load_settings

    m = manifests()
    pod = m["StatefulSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = tmp_path / "server.toml"
    config.write_text(m["ConfigMap"]["data"]["server.toml"])
    argv = [f"--config={config}" if a.startswith("--config=") else a for a in container["args"]]
    settings, _ = load_settings(argv)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert settings.listen == f"0.0.0.0:{ports['grpc']}"
    assert (settings.metrics_host, settings.metrics_port) == ("0.0.0.0", ports["metrics"])  # scrapable from outside
    assert [t.name for t in settings.tables] and settings.flush_interval_seconds > 0
    cfg = settings.cache_config()
    # Both memory tiers live in RAM on a CPU node: the memory request covers them with room for the process.
    request = container["resources"]["requests"]["memory"]
    assert request.endswith("Gi") and int(request[:-2]) << 30 >= cfg.hbm_bytes + cfg.ddr_bytes + (512 << 20)
    # Kubernetes waits for the drain (refusing, then calls in flight) and the flush after it before
    # killing the pod; the drain refuses new calls for a while, so that clients resend them.
    assert settings.drain_seconds > 0
    assert pod["terminationGracePeriodSeconds"] >= settings.drain_seconds + settings.grace_seconds + 60


def test_network_policy_admits_clients_prometheus_and_peers_only() -> None:
    """gRPC from labelled clients and the shards, metrics from Prometheus's pods in its namespace, egress to peers."""
    m = manifests()
    policy, pod = m["NetworkPolicy"]["spec"], m["StatefulSet"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    shard = {"app.kubernetes.io/name": labels["app.kubernetes.io/name"]}
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]  # both directions default to deny
    (container,) = pod["spec"]["containers"]
    ports = {p["name"] for p in container["ports"]}
    ingress = {p["port"]: rule["from"] for rule in policy["ingress"] for p in rule["ports"]}
    # Ports by the container's names (no number to drift), every one of them admitted by one rule.
    assert set(ingress) == ports == {"grpc", "metrics"} and len(policy["ingress"]) == 2
    assert all(p["protocol"] == "TCP" for rule in policy["ingress"] for p in rule["ports"])
    # gRPC: pods labelled as clients in any namespace, and the shards (`embcache reshard` runs in one).
    clients = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"embcache.io/client": "true"}}}
    assert ingress["grpc"] == [clients, {"podSelector": {"matchLabels": shard}}]
    # Metrics: Prometheus's pods AND its namespace (one peer holding both selectors; two peers would be an OR).
    assert ingress["metrics"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    # Egress: the other shards' gRPC port (resharding) and the cluster's DNS, nothing else.
    peers, dns = policy["egress"]
    assert peers == {"to": [{"podSelector": {"matchLabels": shard}}], "ports": [{"port": "grpc", "protocol": "TCP"}]}
    assert dns["to"][0]["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
    assert sorted((p["port"], p["protocol"]) for p in dns["ports"]) == [(53, "TCP"), (53, "UDP")]
    # The README's scale-up procedure needs this path: a reshard run inside a shard's pod.
    readme = (DEPLOY / "README.md").read_text()
    assert "kubectl -n embcache exec embcache-0 -- sh -c 'exec embcache reshard --token" in readme


def test_auth_secret_is_mounted_where_the_server_reads_its_tokens(tmp_path: Path) -> None:
    """The Secret's keys are files in a read-only mount, at the paths the server's token flags name."""
    from embcache.server.main import load_settings

    m = manifests()
    pod = m["StatefulSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    ((volume, secret),) = secrets.items()
    assert secret["secretName"] == "embcache-auth" and not secret.get("optional", False)  # no Secret, no start
    (mount,) = [v for v in container["volumeMounts"] if v["name"] == volume]
    assert mount["readOnly"] is True
    files = {f"{mount['mountPath']}/{item['path']}": item["key"] for item in secret["items"]}
    config = tmp_path / "server.toml"
    config.write_text(m["ConfigMap"]["data"]["server.toml"])
    settings, _ = load_settings([f"--config={config}" if a.startswith("--config=") else a for a in container["args"]])
    assert settings.auth_token_files == [f"{mount['mountPath']}/tokens.txt"]
    assert settings.auth_readonly_token_files == [f"{mount['mountPath']}/readonly-tokens.txt"]
    assert set(settings.auth_token_files + settings.auth_readonly_token_files) == set(files)
    # Readable by the server's group (the pod's fsGroup owns the files), by nobody else.
    assert secret["defaultMode"] & 0o040 and not secret["defaultMode"] & 0o007 and pod["securityContext"]["fsGroup"]
    # The README creates the Secret with exactly these keys, and no manifest ships a token.
    readme = (DEPLOY / "README.md").read_text()
    for key in files.values():
        assert f"--from-file={key}" in readme, key
    assert "Secret" not in m


def operator_manifests() -> dict[str, dict[str, Any]]:
    docs = [d for p in OPERATOR_MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    return {d["kind"]: d for d in docs}


def crd_schema(doc: dict[str, Any]) -> dict[str, Any]:
    group, version = doc["apiVersion"].split("/")
    path = CRD_SCHEMAS / f"{doc['kind'].lower()}.{group}-{version}.yaml"
    assert path.is_file(), f"no vendored schema for {doc['kind']} {doc['apiVersion']}: {path.relative_to(REPO)}"
    return dict(yaml.safe_load(path.read_text()))


def test_prometheus_operator_objects_match_their_crd_schemas() -> None:
    """kubernetes-validate knows no CRDs (it only warns), so the objects are checked against the CRDs' schemas."""
    if jsonschema is None:
        missing("jsonschema")
    docs = [d for p in OPERATOR_MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    assert sorted(d["kind"] for d in docs) == ["PrometheusRule", "ServiceMonitor"]  # one of each
    for doc in docs:
        schema = crd_schema(doc)
        jsonschema.Draft4Validator.check_schema(schema)
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in jsonschema.Draft4Validator(schema).iter_errors(doc)]
        assert not errors, (doc["kind"], errors)
    # The same check refuses what the API server would: a misspelt field, a bad duration, a rule
    # that is both alert and record, a relabeling with an invalid label name.
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    bad = [
        {**monitor, "spec": {**monitor["spec"], "endpoint": monitor["spec"]["endpoints"]}},
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "metrics", "interval": "15 s"}]}},
        {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "metrics", "relabelings": [
            {"sourceLabels": ["pod-name"], "targetLabel": "instance"}]}]}},
        {**rule, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "record": "b", "expr": "1"}]}]}},
        {**rule, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "1", "for": "ten minutes"}]}]}},
    ]
    for doc in bad:
        assert not jsonschema.Draft4Validator(crd_schema(doc)).is_valid(doc), doc["spec"]


def test_servicemonitor_scrapes_the_shards_as_job_embcache() -> None:
    """Its selector finds the Service, its port is the Service's metrics port, and the job is the one the rules use."""
    m = manifests()
    svc, pod = m["Service"], m["StatefulSet"]["spec"]["template"]
    monitor = operator_manifests()["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["port"] == "metrics"
    assert endpoint["path"] == pod["metadata"]["annotations"]["prometheus.io/path"]
    # No jobLabel: the operator names the job after the Service, which is the job the rules select.
    assert "jobLabel" not in monitor["spec"] and svc["metadata"]["name"] == "embcache"
    _, alerts = load_rules()
    assert all('job="embcache"' in expr for name, expr in alerts.items() if "up{" in expr or "process_" in expr)
    # instance = the pod name, stable across restarts like the DNS-SRV config's
    assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "instance"}]


def test_prometheusrule_carries_the_rule_files() -> None:
    """The PrometheusRule holds the rule files' groups, and is what scripts/prometheusrule.py writes from them."""
    script = prometheusrule_script()
    doc = operator_manifests()["PrometheusRule"]
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    groups = [g for name in config["rule_files"] for g in yaml.safe_load((PROM / name).read_text())["groups"]]
    assert doc["spec"]["groups"] == groups
    assert sorted(PROM / name for name in config["rule_files"]) == RULE_FILES
    out = run([sys.executable, "scripts/prometheusrule.py", "--check"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert script.OUT.read_text() == script.render()


def test_prometheusrule_runbook_base_moves_only_the_links() -> None:
    """``scripts/prometheusrule.py --runbook-base URL`` points every alert's runbook_url elsewhere, nothing else."""
    script = prometheusrule_script()
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    groups = [g for name in config["rule_files"] for g in yaml.safe_load((PROM / name).read_text())["groups"]]
    moved = yaml.safe_load(script.render("https://runbooks.example.com/embcache/"))
    urls = [r["annotations"]["runbook_url"] for g in moved["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert urls and all(u.startswith("https://runbooks.example.com/embcache/Embcache") for u in urls)
    for rule in (r for g in moved["spec"]["groups"] for r in g["rules"] if "alert" in r):
        rule["annotations"]["runbook_url"] = script.RUNBOOK_BASE + rule["alert"] + ".md"
    assert moved["spec"]["groups"] == groups


def test_dockerfile_lint_and_consistency() -> None:
    out = run([tool("hadolint"), str(DOCKERFILE)])
    assert out.returncode == 0, out.stdout + out.stderr
    text = DOCKERFILE.read_text()
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (REPO / path).exists(), path
    assert "--index-url" in text and "whl/cpu" in text  # the CPU torch wheel, not PyPI's CUDA build
    (container,) = manifests()["StatefulSet"]["spec"]["template"]["spec"]["containers"]
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}  # type: ignore[union-attr]
    assert exposed == {p["containerPort"] for p in container["ports"]}
    uid = manifests()["StatefulSet"]["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert f"USER {uid}:" in text
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))  # type: ignore[union-attr]
    scripts = re.search(r"^\[project\.scripts\]\n((?:[^\[\n].*\n|\n)*)", (REPO / "pyproject.toml").read_text(), re.M)
    assert scripts and re.search(rf"^{re.escape(entry[0])}\s*=", scripts.group(1), re.M), \
        f"ENTRYPOINT {entry[0]} is not a console script of pyproject.toml"


# ------------------------------------------------------------------ Prometheus scraping a live server
class Prometheus:
    """Debian's Prometheus on 127.0.0.1, scraping ``target`` every second with deploy/'s rules loaded."""

    def __init__(self, tmp_path: Path, target: str) -> None:
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in RULE_FILES],
                  "scrape_configs": [{"job_name": "embcache", "static_configs": [{"targets": [target]}]}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(tmp_path / "prometheus.log", "w")  # closed in stop()
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address={self.url[7:]}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait(lambda: fetch(self.url + "/-/ready", timeout=1) is not None, "Prometheus to start")

    def wait(self, ready: Any, what: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"Prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
            try:
                value = ready()
                if value:
                    return value
            except (OSError, KeyError, IndexError):
                pass
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def query(self, promql: str) -> dict[tuple[tuple[str, str], ...], tuple[float, float]]:
        """Instant query: {sorted labels without __name__: (timestamp, value)}."""
        body = json.loads(fetch(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})))
        assert body["status"] == "success", body
        return {tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")):
                (float(r["value"][0]), float(r["value"][1])) for r in body["data"]["result"]}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Server:
    """``python -m embcache.server`` on 127.0.0.1 (free ports), with a gRPC stub to drive it."""

    def __init__(self, tmp_path: Path) -> None:
        import grpc

        from embcache.rpc.v1 import embcache_pb2_grpc

        port_file = tmp_path / "server.json"
        self.log = open(tmp_path / "server.log", "w")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embcache.server", "--listen=127.0.0.1:0", "--metrics-port=0",
             f"--port-file={port_file}", f"--path={tmp_path / 'store'}", "--device=cpu",
             f"--hbm-bytes={64 * 100}", f"--ddr-bytes={256 * 100}", "--table=name=user,dim=8,optimizer=adagrad,seed=1"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert self.proc.poll() is None, f"server exited: {Path(self.log.name).read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the server did not start in 60 s"
            time.sleep(0.1)
        ports = json.loads(port_file.read_text())
        self.metrics_port = int(ports["metrics_port"])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{ports['port']}")
        self.stub = embcache_pb2_grpc.EmbeddingCacheServiceStub(self.channel)

    def workload(self, steps: int, seed: int = 0) -> None:
        """Zipf-distributed lookups and updates of table user, 512 keys a step, 0.1 s apart."""
        import numpy as np

        from embcache.rpc.codec import encode_tensor
        from embcache.rpc.v1 import embcache_pb2 as pb

        rng = np.random.default_rng(seed)
        for _ in range(steps):
            keys = encode_tensor(torch.from_numpy(rng.zipf(1.3, 512) % 3000))
            self.stub.Lookup(pb.LookupRequest(tables=[pb.TableKeys(table="user", keys=keys)]), timeout=30)
            grads = encode_tensor(torch.ones(512, 8))
            self.stub.ApplyGradients(pb.ApplyGradientsRequest(
                tables=[pb.TableValues(table="user", keys=keys, values=grads)]), timeout=30)
            time.sleep(0.1)

    def stats(self) -> dict[str, Any]:
        from embcache.rpc.v1 import embcache_pb2 as pb

        return dict(json.loads(self.stub.Stats(pb.StatsRequest(), timeout=30).json))

    def stop(self) -> int:
        """SIGTERM (graceful drain) and the exit status."""
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self.log.close()


def test_prometheus_records_the_hit_ratio_of_a_live_server(tmp_path: Path) -> None:
    """Recorded hit ratios equal the server's stats(): hits / lookups per tier, and from memory end to end.

    The 1m window holds a scrape from before the workload (every counter 0) and one after it,
    so rate()'s extrapolation is the same factor for every series and cancels in the ratio: the
    recorded ratio is the ratio of the final counters, up to float rounding, whatever the timing.
    """
    server = Server(tmp_path)
    prom = None
    try:
        prom = Prometheus(tmp_path, f"127.0.0.1:{server.metrics_port}")
        lookups = 'embcache_lookups_total{job="embcache",table="user"}'
        # A sample with every counter at 0 is stored before the workload starts.
        prom.wait(lambda: prom.query(lookups).popitem()[1][1] == 0, "a scrape before the workload")
        started = time.monotonic()
        server.workload(steps=25)  # ~2.5 s: several scrapes land during the workload
        stats = server.stats()["user"]
        total = stats["lookups"]
        assert total == 25 * 512
        # The final counters scraped, then the rules evaluated after that scrape (timestamp(): of the samples).
        prom.wait(lambda: [v for _, v in prom.query(lookups).values()] == [total], "the final scrape")
        (scraped,) = [v for _, v in prom.query(f"timestamp({lookups})").values()]
        ratio = "job_table_tier:embcache_tier_hit_ratio:rate1m"
        # A scrape's samples carry its start time but are committed when it ends: a rule evaluated
        # in between still sees the previous scrape. Two evaluation intervals later it cannot.
        prom.wait(lambda: min(v for _, v in prom.query(f"timestamp({ratio})").values()) >= scraped + 2.0,
                  "a rule evaluation after the final scrape was committed")
        assert time.monotonic() - started < 50, "the 1m window no longer reaches back to the zero sample"

        per_tier = prom.query(ratio)
        end_to_end = prom.query("job_table:embcache_hit_ratio:rate1m")
        local = prom.query("job_table_tier:embcache_tier_local_hit_ratio:rate5m")
        key = (("job", "embcache"), ("table", "user"))
        for tier in ("hbm", "ddr", "ssd"):
            expected = stats[tier]["hits"] / total
            assert per_tier[(*key, ("tier", tier))][1] == pytest.approx(expected, rel=1e-9, abs=1e-12), tier
        assert 0 < stats["hbm"]["hits"] / total < 1 and stats["ddr"]["hits"] > 0  # a workload that uses the tiers
        memory = (stats["hbm"]["hits"] + stats["ddr"]["hits"]) / total
        assert end_to_end[key][1] == pytest.approx(memory, rel=1e-9)
        reached_ddr = total - stats["hbm"]["hits"]
        assert local[(*key, ("tier", "ddr"))][1] == pytest.approx(stats["ddr"]["hits"] / reached_ddr, rel=1e-9)
        # The server's request histogram, by method and status.
        calls = prom.query('embcache_rpc_request_duration_seconds_count{method="Lookup",code="OK"}')
        assert [v for _, v in calls.values()] == [25]
        # and the same count under the grpc-ecosystem's standard names
        for query in ('grpc_server_handled_total{grpc_method="Lookup",grpc_code="OK",grpc_type="unary"}',
                      'grpc_server_handling_seconds_count{grpc_method="Lookup"}',
                      'grpc_server_started_total{grpc_method="Lookup"}'):
            assert [v for _, v in prom.query(query).values()] == [25], query

        # Every rule (alerts too) evaluates without error on the real series.
        groups = json.loads(fetch(prom.url + "/api/v1/rules"))["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        records, alerts = load_rules()
        assert len(rules) == len(records) + len(alerts)
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

        # The server's own /metrics passes promtool and has everything the dashboard and rules query.
        text = fetch(f"http://127.0.0.1:{server.metrics_port}/metrics")
        out = run([tool("promtool"), "check", "metrics"], stdin=text)
        assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
        exported = set(re.findall(r"^# TYPE (embcache_\w+) ", text, re.M))
        used = metric_names(" ".join(dashboard_queries()) + " ".join(records.values()) + " ".join(alerts.values()))
        assert "embcache_rpc_request_duration_seconds" in exported
        missing_now = used - exported - NOT_FROM_EMBEDDED_CACHE - not_exported_yet(server.stats())
        assert not missing_now, sorted(missing_now)
    finally:
        if prom is not None:
            prom.stop()
        assert server.stop() == 0, Path(server.log.name).read_text()[-2000:]  # drained and flushed cleanly
