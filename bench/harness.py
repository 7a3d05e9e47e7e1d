"""bourse beside a direct call and beside its peers, in one run; rewrites bench/RESULTS.md.

    bash bench/run.sh            # installs what is missing, then runs this
    .venv/bin/python -m bench.harness [--quick] [--only a,b,c,d,e,f,g,h,i,j] [--out FILE]

Layout on a 2-core machine: the gateway under test (bourse, LiteLLM proxy with one
worker, Portkey's node gateway) on core 0; nginx (one worker, the echo module,
bench/nginx.conf), wrk, the SSE load client (bench/sse_load.py) and this script on
core 1. Every load run is bounded in time; every wait has a timeout.

Scenarios (each against direct nginx, bourse and each peer that started):
  (a) c=1 non-streamed: latency p50/p99 and what each gateway adds over direct
  (b) c=64 non-streamed: requests/s, ratio to direct
  (c) upstream answering 50 ms late, c=256: requests/s, ratio to direct
  (d) streamed 16-chunk answers: TTFT at c=1 (added over direct), streams/s at c=32
  (e) 10,000 concurrent slow streams through bourse: peak RSS (VmHWM)
  (f) the ledger alone (bench/ledger.py): settled requests/s on SQLite and PostgreSQL
  (g) the stack's alternatives (bench/alternatives.py): servers, upstream clients, decoders
  (h) the market under overload (bench/market.py): both books, one replica stopped
  (i) bytes written to disk a request (bench/disk.py): SQLite and PostgreSQL, c=1 and c=32
  (j) the gateway's CPU a request in cluster mode against alone (bench/cluster_cpu.py)

bourse runs twice in (a), (b) and (d): as configured by default (metrics and the access
log on) and with ``[server] metrics = false`` and ``access_log = false`` (a second
process, loaded right after the first), so one run shows what observing costs.
``--no-peers`` leaves LiteLLM and Portkey out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import cluster_cpu, disk, market
from bench.common import cpu_s, free_port, gateway_process, pinned, process

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
WORK = BENCH / ".work"
LOGS = WORK / "logs"
LITELLM_VENV = WORK / "litellm-venv"
PORTKEY_DIR = WORK / "portkey"
PORTKEY_SERVER = PORTKEY_DIR / "node_modules/@portkey-ai/gateway/build/start-server.js"
GATEWAY_CPU = 0
LOAD_CPU = 1
TEXT = "Fixed answer from the bench upstream: sixteen chunks of plain text for every gateway under test."
LITELLM_KEY = "sk-bench-" + "3f9a1c0e7b5d4a2f8e6c1b0a9d7e5f3c"
BODY = json.dumps({"model": "{model}", "messages": [{"role": "user", "content": "benchmark"}]})


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- targets


@dataclass
class Gateway:
    """One thing to put load on: direct nginx, bourse or a peer."""

    name: str
    url: str  # .../v1/chat/completions
    headers: dict[str, str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)  # variant -> model name
    urls: dict[str, str] = field(default_factory=dict)  # variant -> url, when it differs
    header_overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    pid: int | None = None

    def endpoint(self, variant: str) -> tuple[str, dict[str, str], str] | None:
        """(url, headers, model) for ``variant`` (fast | delay | one | slow), or None."""
        if variant not in self.models:
            return None
        headers = {**self.headers, **self.header_overrides.get(variant, {})}
        return self.urls.get(variant, self.url), headers, self.models[variant]


@dataclass
class Stack:
    nginx_port: int = 0
    delay_port: int = 0
    gateways: dict[str, Gateway] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # peer -> reason
    versions: dict[str, str] = field(default_factory=dict)


def upstream(stack: Stack, variant: str) -> str:
    port = stack.delay_port if variant == "delay" else stack.nginx_port
    prefix = {"one": "/one", "slow": "/slow"}.get(variant, "")
    return f"http://127.0.0.1:{port}{prefix}/v1"


@contextlib.contextmanager
def nginx(stack: Stack) -> Iterator[None]:
    stack.nginx_port, stack.delay_port = free_port(), free_port()
    conf = (BENCH / "nginx.conf").read_text()
    conf = (
        conf.replace("@@WORK@@", str(WORK))
        .replace("@@DELAY_PORT@@", str(stack.delay_port))
        .replace("@@PORT@@", str(stack.nginx_port))
        .replace("@@NOFILE@@", str(nofile()))
        .replace("@@CONNECTIONS@@", str(max(1024, min(30000, nofile() - 200))))
    )
    rendered = WORK / "nginx.conf"
    rendered.write_text(conf)
    check = subprocess.run(
        ["nginx", "-t", "-q", "-c", str(rendered), "-p", str(WORK)], capture_output=True, text=True
    )
    if check.returncode:
        raise RuntimeError(f"nginx -t failed: {check.stderr.strip()}")
    with process(
        ["nginx", "-c", str(rendered), "-p", str(WORK)],
        f"http://127.0.0.1:{stack.nginx_port}/healthz",
        cpu=LOAD_CPU,
        log=LOGS / "nginx.log",
    ):
        stack.gateways["direct"] = Gateway(
            "direct (nginx)",
            f"http://127.0.0.1:{stack.nginx_port}/v1/chat/completions",
            models={"fast": "bench", "delay": "bench"},
            urls={"delay": f"http://127.0.0.1:{stack.delay_port}/v1/chat/completions"},
        )
        yield


def bourse_config(
    stack: Stack, variants: dict[str, str], always_stream: frozenset[str] = frozenset(), observe: bool = True
) -> str:
    out = ['[server]\nlog_level = "info"\n' + ("" if observe else "metrics = false\naccess_log = false\n")]
    for product, variant in variants.items():
        extra = "always_stream = true\n" if product in always_stream else ""
        out.append(
            f"""
[products.{product}]
max_waiting = 1000000
[[products.{product}.deployments]]
engine = "openai"
base_url = "{upstream(stack, variant)}"
model = "bench"
slots = 100000
max_connections = 20000
floor = 0.10
first_byte_timeout_s = 120
{extra}"""
        )
    return "".join(out)


BOURSE_PRODUCTS = {"bench": "fast", "bench-streamed": "fast", "bench-delay": "delay"}
"""The products of both bourse processes (metrics and access log on, and off): the
same config but for those two settings, so the pair differs in nothing else."""


@contextlib.contextmanager
def bourse(stack: Stack) -> Iterator[None]:
    cfg = bourse_config(stack, BOURSE_PRODUCTS, always_stream=frozenset({"bench-streamed"}))
    with gateway_process(cfg, cpu=GATEWAY_CPU, log=LOGS / "bourse.log") as (base, key, proc):
        stack.gateways["bourse"] = Gateway(
            "bourse",
            base + "/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            models={"fast": "bench", "delay": "bench-delay"},
            pid=proc.pid,
        )
        yield


@contextlib.contextmanager
def bourse_one(stack: Stack) -> Iterator[None]:
    """The *always_stream* row's bourse: a process of its own (the same config), so that
    the metrics-on bourse has served no more requests than the metrics-off one when the
    two are compared. Every request leaves a usage record and the ledger's threads
    spend more per request as it grows: in (b), one gateway's SQLite threads went from
    74 to ~104 µs per request over its first ~50,000 requests, then stayed there (the
    event loop's thread stayed at 290-315 µs). With this row on the metrics-on process
    (more requests served before each comparison) on/off read 0.90-0.92; an A/A pair
    of identical gateways reads 0.97-1.03 in 8 alternate rounds."""
    cfg = bourse_config(stack, BOURSE_PRODUCTS, always_stream=frozenset({"bench-streamed"}))
    with gateway_process(cfg, cpu=GATEWAY_CPU, log=LOGS / "bourse-one.log") as (base, key, proc):
        stack.gateways["bourse-one"] = Gateway(
            "bourse, always_stream (16-chunk upstream stream)",
            base + "/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            models={"fast": "bench-streamed"},
            pid=proc.pid,
        )
        yield


@contextlib.contextmanager
def bourse_quiet(stack: Stack) -> Iterator[None]:
    """bourse with metrics and the access log off (the same products otherwise)."""
    cfg = bourse_config(stack, BOURSE_PRODUCTS, always_stream=frozenset({"bench-streamed"}), observe=False)
    with gateway_process(cfg, cpu=GATEWAY_CPU, log=LOGS / "bourse-quiet.log") as (base, key, proc):
        stack.gateways["bourse-quiet"] = Gateway(
            "bourse, metrics and access log off",
            base + "/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            models={"fast": "bench"},
            pid=proc.pid,
        )
        yield


@contextlib.contextmanager
def litellm(stack: Stack) -> Iterator[None]:
    exe = LITELLM_VENV / "bin" / "litellm"
    status = WORK / "litellm.status"
    if not exe.exists():
        stack.missing["LiteLLM"] = status.read_text().strip() if status.exists() else f"{exe} not found"
        yield
        return
    cfg = WORK / "litellm.yaml"
    cfg.write_text(
        f"""model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: {upstream(stack, "fast")}
      api_key: sk-upstream
  - model_name: bench-delay
    litellm_params:
      model: openai/bench
      api_base: {upstream(stack, "delay")}
      api_key: sk-upstream
general_settings:
  master_key: {LITELLM_KEY}
"""
    )
    port = free_port()
    try:
        with process(
            [
                str(exe),
                "--config",
                str(cfg),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            f"http://127.0.0.1:{port}/health/liveliness",
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            cpu=GATEWAY_CPU,
            log=LOGS / "litellm.log",
            health_timeout_s=120,
            cwd=WORK,
        ) as proc:
            stack.gateways["litellm"] = Gateway(
                "LiteLLM proxy (1 worker)",
                f"http://127.0.0.1:{port}/v1/chat/completions",
                headers={"authorization": f"Bearer {LITELLM_KEY}"},
                models={"fast": "bench", "delay": "bench-delay"},
                pid=proc.pid,
            )
            yield
    except RuntimeError as exc:
        if "litellm" in stack.gateways:
            raise
        stack.missing["LiteLLM"] = f"did not start: {exc}"[:500]
        yield


@contextlib.contextmanager
def portkey(stack: Stack) -> Iterator[None]:
    status = WORK / "portkey.status"
    if not PORTKEY_SERVER.exists():
        stack.missing["Portkey"] = (
            status.read_text().strip() if status.exists() else f"not installed: {PORTKEY_SERVER} not found"
        )
        yield
        return
    port = free_port()
    try:
        with process(
            [
                "node",
                "--import",
                str(BENCH / "portkey_fetch_shim.mjs"),
                str(PORTKEY_SERVER),
                f"--port={port}",
                "--headless",
            ],
            f"http://127.0.0.1:{port}/",
            env={"NODE_ENV": "production"},
            cpu=GATEWAY_CPU,
            log=LOGS / "portkey.log",
            health_timeout_s=60,
            cwd=PORTKEY_DIR,
        ) as proc:
            stack.gateways["portkey"] = Gateway(
                "Portkey gateway (node)",
                f"http://127.0.0.1:{port}/v1/chat/completions",
                headers={
                    "authorization": "Bearer sk-upstream",
                    "x-portkey-provider": "openai",
                    "x-portkey-custom-host": upstream(stack, "fast"),
                },
                models={"fast": "bench", "delay": "bench"},
                header_overrides={"delay": {"x-portkey-custom-host": upstream(stack, "delay")}},
                pid=proc.pid,
            )
            stack.notes.append(
                "Portkey runs with `bench/portkey_fetch_shim.mjs` preloaded: without it every streamed "
                "answer fails with `TypeError: immutable` on Node 20 (Portkey-AI/gateway#1389, #1550)."
            )
            yield
    except RuntimeError as exc:
        if "portkey" in stack.gateways:
            raise
        stack.missing["Portkey"] = f"did not start: {exc}"[:500]
        yield


def sanity(gw: Gateway, variant: str = "fast") -> str:
    """One non-streamed and one streamed request; '' when both carry the fixed answer."""
    ep = gw.endpoint(variant)
    if ep is None:
        return "n/a"
    url, headers, model = ep
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "benchmark"}]}
    problems = []
    try:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != TEXT:
            problems.append(f"non-streamed: HTTP {r.status_code} {r.text[:200]}")
        r = httpx.post(
            url,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
            headers=headers,
            timeout=30,
        )
        text = "".join(
            (c["choices"][0]["delta"].get("content") or "")
            for line in r.text.splitlines()
            if line.startswith("data: {")
            for c in [json.loads(line[6:])]
            if c.get("choices")
        )
        if r.status_code != 200 or text != TEXT or "data: [DONE]" not in r.text:
            problems.append(f"streamed: HTTP {r.status_code} {r.text[:200]}")
    except Exception as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    return "; ".join(problems)


# --------------------------------------------------------------------------- load tools


def wrk(
    gw: Gateway, variant: str, conns: int, seconds: float, warmup: float, timeout_s: int = 10
) -> dict[str, Any]:
    return wrk_together([gw], variant, conns, seconds, warmup, timeout_s)[0]


def wrk_together(
    gws: Sequence[Gateway], variant: str, conns: int, seconds: float, warmup: float, timeout_s: int = 10
) -> list[dict[str, Any]]:
    """One wrk per gateway, all at once (a warm-up, then ``seconds`` measured); each
    result with its gateway's CPU per request when it has a pid. ``timeout_s``: wrk
    counts a request unanswered after it as an error."""
    results: list[dict[str, Any]] = []
    for d in ([warmup] if warmup > 0 else []) + [seconds]:
        cpu0 = [cpu_s(gw.pid) for gw in gws]
        procs = [_wrk_start(gw, variant, conns, d, timeout_s) for gw in gws]
        outs = [p.communicate(timeout=d + 60) for p in procs]
        results = []
        for gw, c0, (stdout, stderr) in zip(gws, cpu0, outs, strict=True):
            line = next((ln for ln in stdout.splitlines() if ln.startswith("WRKJSON ")), None)
            if line is None:
                raise RuntimeError(f"wrk printed no result: {stdout[-300:]} {stderr[-300:]}")
            r: dict[str, Any] = json.loads(line[8:])
            if gw.pid is not None and r["requests"]:
                r["cpu_us"] = (cpu_s(gw.pid) - c0) / r["requests"] * 1e6
            r["rps"] = r["requests"] / (r["duration_us"] / 1e6)
            r["errors"] = sum(v for k, v in r.items() if k.startswith("err_"))
            results.append(r)
    return results


def _wrk_start(
    gw: Gateway, variant: str, conns: int, seconds: float, timeout_s: int
) -> subprocess.Popen[str]:
    ep = gw.endpoint(variant)
    assert ep is not None
    url, headers, model = ep
    env = {
        **os.environ,
        "BENCH_BODY": BODY.replace("{model}", model),
        "BENCH_HEADERS": "\n".join(f"{k}: {v}" for k, v in headers.items()),
    }
    args = pinned(
        ["wrk", "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", f"{timeout_s}s",
         "-s", str(BENCH / "wrk_post.lua"), url],
        LOAD_CPU,
    )  # fmt: skip
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def sse(gw: Gateway, variant: str, extra: list[str], timeout: float) -> dict[str, Any]:
    ep = gw.endpoint(variant)
    assert ep is not None
    url, headers, model = ep
    args = [sys.executable, "-m", "bench.sse_load", "--url", url, "--model", model]
    for k, v in headers.items():
        args += ["--header", f"{k}: {v}"]
    p = subprocess.run(
        pinned(args + extra, LOAD_CPU), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"sse_load failed: {p.stderr[-500:]}")
    return dict(json.loads(lines[-1]))


def load(
    gw: Gateway, conns: int, seconds: float, *, streamed: bool = False, timeout_s: int = 10
) -> tuple[int, int]:
    """``conns`` clients for ``seconds``: wrk (non-streamed requests), or ``streamed``,
    the SSE client (16-chunk streams); the requests (streams) answered and the errors.
    ``timeout_s``: wrk's (the SSE client waits as long as the round lasts)."""
    if not streamed:
        r = wrk(gw, "fast", conns, seconds, 0, timeout_s)
        return int(r["requests"]), int(r["errors"])
    extra = ["--concurrency", str(conns), "--duration", str(seconds)]
    s = sse(gw, "fast", extra, seconds + 60 + timeout_s)
    return int(s["streams_ok"]), sum(int(n) for n in s["errors"].values())


def vm(pid: int | None) -> dict[str, int]:
    out: dict[str, int] = {}
    if pid is None:
        return out
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0])
    return out


# --------------------------------------------------------------------------- scenarios


@dataclass
class Opts:
    seconds: float = 10.0
    warmup: float = 2.0
    sse_c1_seconds: float = 5.0
    sse_seconds: float = 10.0
    sse_conc: int = 32
    streams: int = 10_000
    ramp_timeout: float = 140.0
    hold_s: float = 5.0
    ledger_n: int = 2000
    e_upstream: str = "auto"
    rounds: int = 1
    """(a), (b): bourse with observing on and off measured this many times, alternately (the median kept)."""


def targets(stack: Stack, variant: str, order: tuple[str, ...]) -> list[tuple[str, Gateway]]:
    return [
        (k, stack.gateways[k]) for k in order if k in stack.gateways and stack.gateways[k].endpoint(variant)
    ]


ORDER = ("direct", "bourse", "bourse-quiet", "bourse-one", "litellm", "portkey")


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:
        log(f"  failed: {type(exc).__name__}: {exc}")
        (LOGS / "harness-errors.log").open("a").write(traceback.format_exc() + "\n")
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def scenario_wrk(stack: Stack, variant: str, conns: int, o: Opts) -> dict[str, dict[str, Any]]:
    out = {}
    for key, gw in targets(stack, variant, ORDER):
        out[key] = wrk_logged(gw, variant, conns, o)
    pair = [(k, gw) for k, gw in targets(stack, variant, ("bourse", "bourse-quiet"))]
    if o.rounds > 1 and len(pair) == 2:
        runs = {k: [out[k]] for k, _ in pair}
        for i in range(o.rounds - 1):  # on and off alternately: load from elsewhere falls on both
            for k, gw in pair if i % 2 else pair[::-1]:  # off first, then on first, ...
                runs[k].append(wrk_logged(gw, variant, conns, o))
        for k, rs in runs.items():
            good = sorted((r for r in rs if "error" not in r), key=lambda r: float(r["rps"]))
            if good:
                out[k] = {**good[len(good) // 2], "rounds": [round(float(r["rps"])) for r in good]}
        if "error" not in out.get("bourse", {"error": ""}):
            out["bourse"]["paired"] = side_by_side([gw for _, gw in pair], variant, conns, o)
    return out


def side_by_side(pair: Sequence[Gateway], variant: str, conns: int, o: Opts) -> dict[str, Any]:
    """Metrics and access log on and off loaded at the same time, ``o.rounds`` times:
    both processes share the gateway core, so the scheduler gives each half of it and
    their throughputs stand in the inverse ratio of their CPU per request, while
    whatever else disturbs the machine (or drifts between rounds) falls on both
    alike. Alternate rounds, by contrast, differ by ±3 % even between two identical
    gateways. Returns the on/off ratio of each round and their median."""
    log(
        f"  metrics and access log on and off side by side: wrk c={conns} each, {o.rounds} x {o.seconds:.0f}s"
    )
    ratios: list[float] = []
    cpu: list[float] = []
    for _ in range(o.rounds):
        try:
            on, off = wrk_together(pair, variant, conns, o.seconds, o.warmup)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return {"error": str(exc)[:300]}
        ratios.append(on["rps"] / off["rps"])
        if on.get("cpu_us") and off.get("cpu_us"):
            cpu.append(on["cpu_us"] / off["cpu_us"])
        log(f"    on {on['rps']:.0f} req/s, off {off['rps']:.0f} req/s: on/off {ratios[-1]:.3f}")
    return {
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "cpu_ratio": statistics.median(cpu) if cpu else None,
    }


def wrk_logged(gw: Gateway, variant: str, conns: int, o: Opts) -> dict[str, Any]:
    log(f"  {gw.name}: wrk c={conns} {o.seconds:.0f}s ({variant})")
    r = guarded(lambda: wrk(gw, variant, conns, o.seconds, o.warmup))
    if "error" not in r:
        cpu = f", gateway CPU {r['cpu_us']:.0f} us/request" if r.get("cpu_us") else ""
        log(f"    {r['rps']:.0f} req/s p50 {r['p50_us']} us p99 {r['p99_us']} us errors {r['errors']}{cpu}")
    return r


def scenario_d(stack: Stack, o: Opts) -> dict[str, dict[str, Any]]:
    out = {}
    for key, gw in targets(stack, "fast", ORDER):
        if key in ("bourse-one", "bourse-quiet"):
            continue
        log(f"  {gw.name}: SSE c=1 {o.sse_c1_seconds:.0f}s, c={o.sse_conc} {o.sse_seconds:.0f}s")

        def run(gw: Gateway = gw) -> dict[str, Any]:
            sse(gw, "fast", ["--concurrency", "8", "--duration", str(min(2.0, o.warmup))], 60)
            c1 = sse(
                gw, "fast", ["--concurrency", "1", "--duration", str(o.sse_c1_seconds)], o.sse_c1_seconds + 60
            )
            cn = sse(
                gw,
                "fast",
                ["--concurrency", str(o.sse_conc), "--duration", str(o.sse_seconds)],
                o.sse_seconds + 60,
            )
            return {"c1": c1, "cn": cn}

        out[key] = guarded(run)
        r = out[key]
        if "error" not in r:
            log(
                f"    c=1 TTFT p50 {r['c1']['ttft_p50_ms']:.3f} ms; c={o.sse_conc} "
                f"{r['cn']['streams_per_s']:.0f} streams/s errors {r['cn']['errors']}"
            )
    return out


def nofile() -> int:
    """The hard limit on open files (what this process and its children can reach)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


SIM_SLOW = """[server]
log_level = "info"
[products.bench-slow]
max_waiting = 1000000
max_output_tokens = 64
[[products.bench-slow.deployments]]
engine = "sim"
slots = 100000
floor = 0.10
ttft_ms = 1
tokens_per_s = 0.1
output_tokens = 16
max_output_tokens = 64
"""


def hold_run(stack: Stack, o: Opts, kind: str, streams: int) -> dict[str, Any]:
    """One fresh bourse, ``streams`` slow streams held open through it (upstream ``kind``)."""
    if kind == "nginx":
        cfg = bourse_config(stack, {"bench-slow": "slow"})
        desc = "nginx `/slow/v1` via the `openai` engine"
    else:
        cfg = SIM_SLOW
        desc = "in-process `sim` engine"
    # [server] max_connections (default 2,048) would answer the rest 503: room for every stream
    cfg = cfg.replace("[server]\n", f"[server]\nmax_connections = {streams + 1000}\n", 1)
    with gateway_process(cfg, cpu=GATEWAY_CPU, log=LOGS / f"bourse-e-{kind}.log") as (base, key, proc):
        gw = Gateway(
            "bourse", base + "/chat/completions", {"authorization": f"Bearer {key}"}, {"slow": "bench-slow"}
        )
        log(
            f"  bourse ({kind} upstream): opening {streams} slow streams "
            f"(ramp timeout {o.ramp_timeout:.0f}s, hold {o.hold_s:.0f}s)"
        )
        args = ["--mode", "hold", "--streams", str(streams), "--open-concurrency", "256"]
        args += ["--ramp-timeout", str(o.ramp_timeout), "--hold-s", str(o.hold_s), "--pid", str(proc.pid)]
        r = sse(gw, "slow", args, o.ramp_timeout + o.hold_s + 120)
        r["vmhwm_end_kb"] = vm(proc.pid).get("VmHWM", 0)
        r["upstream"] = desc
        log(
            f"    first chunk {r['first_chunk']}/{streams}, max open {r['max_open']}, "
            f"VmHWM {r['vmhwm_end_kb'] / 1024:.0f} MiB, errors {r['errors']}"
        )
        return r


def scenario_e(stack: Stack, o: Opts) -> dict[str, Any]:
    """10,000 streams through nginx when the open-files limit allows two sockets a stream;
    else through the sim engine, plus as many as fit through nginx."""
    need = 2 * o.streams + 2000  # a client socket and an upstream socket per stream
    kind = o.e_upstream
    out: dict[str, Any] = {"runs": [], "why": ""}
    if kind == "auto":
        kind = "nginx" if nofile() >= need else "sim"
        if kind == "sim":
            out["why"] = (
                f"the open-files hard limit here is {nofile():,} and could not be raised, fewer than the "
                f"~{need:,} descriptors that {o.streams:,} client sockets plus {o.streams:,} upstream sockets "
                "need; so the full count goes through the sim engine, and as many streams as fit go through nginx"
            )
    out["runs"].append(guarded(lambda: hold_run(stack, o, kind, o.streams)))
    if o.e_upstream == "auto" and kind == "sim":
        fit = (nofile() - 2000) // 2 // 1000 * 1000
        if fit >= 1000:
            out["runs"].append(guarded(lambda: hold_run(stack, o, "nginx", fit)))
    return out


def ledger_worker(n: int) -> None:
    """Runs pinned to the gateway core (``python -m bench.harness --ledger-worker N``); prints JSON."""
    import asyncio
    import tempfile

    from bench.ledger import drop_pg, fresh_pg, run
    from bourse.storage.postgres import PostgresStore
    from bourse.storage.sqlite import SqliteStore

    pg = os.environ.get("BOURSE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
    rows = []
    for c in (1, 32):
        with tempfile.TemporaryDirectory() as d:
            try:
                rows.append(
                    {
                        "store": "sqlite",
                        "c": c,
                        "accounts": 1,
                        **asyncio.run(run(SqliteStore(os.path.join(d, "b.db")), n, c)),
                    }
                )
            except Exception as exc:
                rows.append(
                    {"store": "sqlite", "c": c, "accounts": 1, "error": f"{type(exc).__name__}: {exc}"[:300]}
                )
        # PostgreSQL: one hot account at c=1 and c=32 (issue 17's target), and 32 accounts at c=32
        for accounts in (1, 32) if c == 32 else (1,):

            async def pg_run(c: int = c, accounts: int = accounts) -> dict[str, float]:
                dsn = await fresh_pg(pg)
                try:
                    return await run(PostgresStore(dsn, max_size=max(2, min(c, 20))), n, c, accounts)
                finally:
                    await drop_pg(pg, dsn)

            try:
                rows.append({"store": "postgres", "c": c, "accounts": accounts, **asyncio.run(pg_run())})
            except Exception as exc:
                error = f"not run: {type(exc).__name__}: {exc}"[:300]
                rows.append({"store": "postgres", "c": c, "accounts": accounts, "error": error})
    print(json.dumps(rows))


def scenario_f(o: Opts) -> dict[str, Any]:
    log(
        f"  ledger: {o.ledger_n} hold+settle each on SQLite and PostgreSQL, c=1 and c=32 (PostgreSQL c=32: 1 and 32 accounts)"
    )
    p = subprocess.run(
        pinned([sys.executable, "-m", "bench.harness", "--ledger-worker", str(o.ledger_n)], GATEWAY_CPU),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("[")]
    if not lines:
        raise RuntimeError(f"ledger worker failed: {p.stderr[-500:]}")
    rows = json.loads(lines[-1])
    for r in rows:
        log(
            f"    {r['store']} c={r['c']} accounts={r.get('accounts', 1)}: "
            + (f"{r['settled_per_s']:.0f}/s" if "error" not in r else r["error"])
        )
    return {"rows": rows}


def scenario_g(o: Opts) -> dict[str, Any]:
    """Issue 17's alternatives, bare pass-through apps (bench/alternatives.py, its own venv)."""
    log(f"  alternatives: 8 server + client stacks, {o.seconds:.0f} s each, twice; pydantic vs msgspec")
    p = subprocess.run(
        [sys.executable, "-m", "bench.alternatives", "--json", "--seconds", str(o.seconds),
         "--warmup", str(o.warmup), "--rounds", "2"],
        capture_output=True, text=True, timeout=1200, cwd=ROOT,
    )  # fmt: skip
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ALTJSON ")]
    if not lines:
        raise RuntimeError(f"bench.alternatives failed: {p.stderr[-500:]}")
    out: dict[str, Any] = json.loads(lines[-1][len("ALTJSON ") :])
    return out


def alternatives_rows(g: dict[str, Any]) -> list[str]:
    """The lines of RESULTS.md's section (g)."""
    if "error" in g:
        return [f"## (g) the stack's alternatives: error: {g['error']}", ""]
    rows = [
        f"## (g) the stack's alternatives (bench/alternatives.py): bare pass-through apps, c={g['conns']}",
        "",
        "No bourse logic: read the body, POST it to nginx, return the answer. Server on the gateway core, "
        "nginx and wrk on the other; two runs each (order reversed). Issue 17, item 1.",
        "",
        "| server + upstream client | req/s | server CPU µs/req | p99 ms |",
        "|---|---|---|---|",
    ]
    for name, runs in g["stacks"].items():
        rps = ", ".join(f1(r["rps"]) for r in runs)
        cpu = ", ".join(f"{r['cpu_us']:.0f}" for r in runs)
        p99 = ", ".join(f"{r['p99_ms']:.1f}" for r in runs)
        rows.append(f"| {name} | {rps} | {cpu} | {p99} |")
    rows += ["", "| request decoding (one chat body, best of 5) | µs |", "|---|---:|"]
    rows += [f"| {name} | {us:.2f} |" for name, us in g["decode"].items()]
    return [*rows, ""]


# --------------------------------------------------------------------------- report


def sh(args: list[str]) -> str:
    try:
        p = subprocess.run(args, capture_output=True, text=True, timeout=30)
        return (p.stdout + p.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"


def machine() -> dict[str, str]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.1f} GiB"
    os_name = "?"
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    return {
        "nproc": str(os.cpu_count()),
        "CPU": cpu,
        "RAM": mem,
        "kernel": platform.release(),
        "OS": os_name,
    }


def versions(stack: Stack) -> dict[str, str]:
    src = os.environ.get("BOURSE_BENCH_SRC")  # bourse served from another checkout
    tree = Path(src).resolve().parent if src else ROOT
    commit = sh(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"])
    dirty = sh(["git", "-C", str(tree), "status", "--porcelain", "--", "src"])
    v = {
        "Python": platform.python_version(),
        "bourse": f"{commit}{' + uncommitted changes in src/' if dirty else ''}",
        "nginx": sh(["nginx", "-v"]).replace("nginx version: ", ""),
        "wrk": sh(["wrk", "-v"]).splitlines()[0].split(" [")[0] if sh(["wrk", "-v"]) else "?",
    }
    lpy = LITELLM_VENV / "bin" / "python"
    v["LiteLLM"] = (
        sh([str(lpy), "-c", "import importlib.metadata as m; print(m.version('litellm'))"])
        if lpy.exists()
        else stack.missing.get("LiteLLM", "not installed")
    )
    pj = PORTKEY_SERVER.parent.parent / "package.json"
    if pj.exists():
        v["Portkey gateway"] = json.loads(pj.read_text())["version"] + f" (node {sh(['node', '--version'])})"
    else:
        v["Portkey gateway"] = stack.missing.get("Portkey", "not installed")
    return v


def ms(us: float) -> str:
    return f"{us / 1000:.3f}"


def f1(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def observing_cost(add: Callable[[str], None], rows: dict[str, Any]) -> None:
    """The line comparing bourse with metrics and the access log on and off (same run)."""
    on, off = rows.get("bourse", {}), rows.get("bourse-quiet", {})
    if "rps" in on and "rps" in off and off["rps"]:
        add("")
        line = (
            f"Metrics and access log on vs off: {f1(on['rps'])} vs {f1(off['rps'])} requests/s "
            f"(on/off {on['rps'] / off['rps']:.3f}), p50 {ms(on['p50_us'])} vs {ms(off['p50_us'])} ms"
        )
        if "rounds" in on:
            line += f" (median of {len(on['rounds'])} alternate rounds: {on['rounds']} vs {off['rounds']} requests/s)"
        if on.get("cpu_us") and off.get("cpu_us"):
            line += (
                f"; the gateway's CPU time per request {on['cpu_us']:.0f} vs {off['cpu_us']:.0f} µs "
                f"(on/off {on['cpu_us'] / off['cpu_us']:.3f}: what throughput on a core of its own follows)"
            )
        add(line + ".")
    paired = on.get("paired")
    if paired and "ratio" in paired:
        rs = ", ".join(f"{x:.3f}" for x in paired["ratios"])
        cpu = f"; CPU per request on/off {paired['cpu_ratio']:.3f}" if paired.get("cpu_ratio") else ""
        add("")
        add(
            f"Side by side (both loaded at once on the gateway core, {len(paired['ratios'])} rounds; "
            f"`side_by_side` in bench/harness.py): requests/s on/off **{paired['ratio']:.3f}** "
            f"(median of {rs}){cpu}."
        )
    elif paired:
        add("")
        add(f"Side by side: error: {paired.get('error')}")


def write_results(
    path: Path, stack: Stack, res: dict[str, Any], o: Opts, started: float, checks: dict[str, str]
) -> None:
    L: list[str] = []
    add = L.append
    add("# Benchmark results")
    add("")
    add(
        f"Written by `bash bench/run.sh` (bench/harness.py) on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, "
        f"run time {(time.time() - started) / 60:.1f} min. Every number below comes from this one run."
    )
    add("")
    add("## Machine and versions")
    add("")
    add("| | |")
    add("|---|---|")
    for k, v in {**machine(), **stack.versions}.items():
        add(f"| {k} | {v} |")
    add("")
    add("## Setup")
    add("")
    add(
        f"- Pinning (`taskset`): the gateway under test on core {GATEWAY_CPU}; nginx (1 worker), wrk, the SSE "
        f"load client and the harness on core {LOAD_CPU}. One gateway is loaded at a time."
    )
    add(
        "- Upstream: nginx + echo module (`bench/nginx.conf`): a fixed `chat.completion` (16 completion tokens, "
        'usage block) for non-streamed bodies; for `"stream": true`, 16 content chunks + a usage chunk + '
        "`[DONE]`. A second port answers 50 ms late (`echo_sleep`)."
    )
    add(
        "- bourse: metering on (a funded account and API key made through the admin API; every request holds "
        'and settles on SQLite, floor $0.10/1M tokens), `log_level = "info"`, `openai` engine products with '
        "100,000 slots. A non-streamed request asks the upstream for one non-streamed answer (the fixed "
        "`chat.completion`); the row *always_stream* is a product with `always_stream = true`, which asks "
        "the upstream for the 16-chunk stream and assembles it, as bourse did before."
    )
    add(
        "- LiteLLM proxy: `litellm --num_workers 1`, master key, no database (so no spend tracking), models "
        "`openai/bench` with `api_base` at nginx, default logging. Portkey: `node build/start-server.js "
        "--headless`, `NODE_ENV=production`, headers `x-portkey-provider: openai`, `x-portkey-custom-host`."
    )
    add(
        f"- Load: wrk (1 thread, Lua POST body, `bench/wrk_post.lua`), {o.warmup:.0f} s warm-up then "
        f"{o.seconds:.0f} s measured; SSE: `bench/sse_load.py` (keep-alive connections, raw HTTP/1.1)."
    )
    for n in stack.notes:
        add(f"- {n}")
    for peer, why in stack.missing.items():
        add(f"- **{peer} not measured**: {why}")
    bad = {k: v for k, v in checks.items() if v}
    for k, v in bad.items():
        add(f"- **sanity check failed for {k}**: {v[:300]}")
    add("")

    def name(key: str) -> str:
        return stack.gateways[key].name if key in stack.gateways else key

    # (a)
    a = res.get("a")
    if a is not None:
        add("## (a) c=1, non-streamed: added latency")
        add("")
        add("| target | p50 ms | p99 ms | added p50 ms | added p99 ms | requests/s | errors |")
        add("|---|---:|---:|---:|---:|---:|---:|")
        d = a.get("direct", {})
        for k, r in a.items():
            if "error" in r:
                add(f"| {name(k)} | error: {r['error']} | | | | | |")
                continue
            ap50 = ms(r["p50_us"] - d["p50_us"]) if "p50_us" in d and k != "direct" else "—"
            ap99 = ms(r["p99_us"] - d["p99_us"]) if "p99_us" in d and k != "direct" else "—"
            add(
                f"| {name(k)} | {ms(r['p50_us'])} | {ms(r['p99_us'])} | {ap50} | {ap99} | {f1(r['rps'])} | {r['errors']} |"
            )
        observing_cost(add, a)
        add("")
    for key, title in (
        ("b", "(b) c=64, non-streamed: throughput"),
        ("c", "(c) upstream 50 ms late, c=256: throughput"),
    ):
        b = res.get(key)
        if b is None:
            continue
        add(f"## {title}")
        add("")
        add("| target | requests/s | ratio to direct | p50 ms | p99 ms | errors |")
        add("|---|---:|---:|---:|---:|---:|")
        d = b.get("direct", {})
        for k, r in b.items():
            if "error" in r:
                add(f"| {name(k)} | error: {r['error']} | | | | |")
                continue
            ratio = f"{r['rps'] / d['rps']:.3f}" if "rps" in d else "—"
            add(
                f"| {name(k)} | {f1(r['rps'])} | {ratio} | {ms(r['p50_us'])} | {ms(r['p99_us'])} | {r['errors']} |"
            )
        observing_cost(add, b)
        if key == "b" and "bourse" in b and "litellm" in b and "rps" in b["bourse"] and "rps" in b["litellm"]:
            add("")
            add(f"bourse / LiteLLM requests/s: **{b['bourse']['rps'] / b['litellm']['rps']:.2f}x**")
        add("")
    dd = res.get("d")
    if dd is not None:
        add(f"## (d) streamed 16-chunk answers: TTFT (c=1) and streams/s (c={o.sse_conc})")
        add("")
        add(
            "TTFT = request written → first `data:` event read. Gaps: between consecutive `data:` events as the "
            "client reads them."
        )
        add("")
        add(
            f"| target | TTFB p50 ms (c=1) | TTFT p50 ms (c=1) | TTFT p99 ms (c=1) | added TTFT p50 ms | added TTFT p99 ms "
            f"| streams/s (c={o.sse_conc}) | ratio to direct | TTFT p50 ms (c={o.sse_conc}) | gap p99 ms (c={o.sse_conc}) "
            f"| data events/stream | errors |"
        )
        add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        d = dd.get("direct", {})
        for k, r in dd.items():
            if "error" in r:
                add(f"| {name(k)} | error: {r['error']} | | | | | | | | | | |")
                continue
            c1, cn = r["c1"], r["cn"]
            if "c1" in d and k != "direct":
                a50 = f"{c1['ttft_p50_ms'] - d['c1']['ttft_p50_ms']:.3f}"
                a99 = f"{c1['ttft_p99_ms'] - d['c1']['ttft_p99_ms']:.3f}"
            else:
                a50 = a99 = "—"
            ratio = f"{cn['streams_per_s'] / d['cn']['streams_per_s']:.3f}" if "cn" in d else "—"
            errs = {**c1["errors"], **cn["errors"]}
            add(
                f"| {name(k)} | {c1['ttfb_p50_ms']:.3f} | {c1['ttft_p50_ms']:.3f} | {c1['ttft_p99_ms']:.3f} | {a50} | {a99} "
                f"| {f1(cn['streams_per_s'])} | {ratio} | {cn['ttft_p50_ms']:.3f} | {cn['gap_p99_ms']:.3f} "
                f"| {cn['events_per_stream']:g} | {json.dumps(errs) if errs else 0} |"
            )
        if "cn" in d:
            add("")
            add(
                f"The direct row is bound by the Python load client (it shares core {LOAD_CPU} with nginx): "
                f"{f1(d['cn']['streams_per_s'])} streams/s is the ceiling this client can observe."
            )
        add("")
    e = res.get("e")
    if e is not None:
        add(f"## (e) {o.streams:,} concurrent slow streams through bourse: memory")
        add("")
        add(
            "Each row is a fresh bourse. Upstreams: nginx `/slow/v1` via the `openai` engine (16 chunks, 10 s "
            "apart), or bourse's in-process `sim` engine (16 tokens at 0.1 token/s); 150 s a stream either way. "
            "The client opens the streams (at most 256 awaiting their first chunk at once), holds them all, "
            "samples `/proc/<pid>/status` meanwhile, then closes them. Each bourse runs with `[server] "
            "max_connections` set above the stream count (its default, 2,048, would answer the rest 503)."
        )
        if e.get("why"):
            add("")
            add(f"Why not only nginx: {e['why']}.")
        add("")
        add(
            "| upstream | streams | reached first chunk | max open at once | open after hold | ramp s "
            "| RSS before MiB | peak RSS (VmHWM) MiB | KiB per open stream | extrapolated to "
            f"{o.streams:,} MiB | errors |"
        )
        add("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in e.get("runs", []):
            if "error" in r:
                add(f"| error: {r['error']} | | | | | | | | | | |")
                continue
            per = (r["vmhwm_end_kb"] - r["rss_before_kb"]) / r["max_open"] if r["max_open"] else float("nan")
            add(
                f"| {r['upstream']} | {r['streams']:,} | {r['first_chunk']:,} | {r['max_open']:,} "
                f"| {r['open_after_hold']:,} | {r['ramp_s']:.1f} | {r['rss_before_kb'] / 1024:.0f} "
                f"| {r['vmhwm_end_kb'] / 1024:.0f} | {per:.0f} | {(r['rss_before_kb'] + per * o.streams) / 1024:.0f} "
                f"| {json.dumps(r['errors']) if r['errors'] else 0} |"
            )
        for r in e.get("runs", []):
            if "error" not in r and r["max_open"] < r["streams"]:
                failed = sum(r["errors"].values())
                add("")
                add(
                    f"{r['upstream']}: only {r['max_open']:,} of {r['streams']:,} streams were open at once"
                    + (f"; {failed:,} failed (errors column)" if failed else "")
                    + (
                        f"; the {o.ramp_timeout:.0f} s ramp ran out before the rest reached their first chunk"
                        if r["ramp_s"] >= o.ramp_timeout - 0.5
                        else ""
                    )
                    + "."
                )
        add("")
        add("The extrapolation assumes memory grows linearly with open streams.")
        add("")
    f = res.get("f")
    if f is not None:
        add("## (f) the ledger alone (bench/ledger.py): hold + settle")
        add("")
        if "error" in f:
            add(f"error: {f['error']}")
        else:
            add(
                "| store | accounts | concurrency | settled/s | hold p50 ms | settle p50 ms | hold p99 ms "
                "| settle p99 ms |"
            )
            add("|---|---:|---:|---:|---:|---:|---:|---:|")
            for r in f["rows"]:
                n_acc = r.get("accounts", 1)
                if "error" in r:
                    add(f"| {r['store']} | {n_acc} | {r['c']} | {r['error']} | | | | |")
                else:
                    add(
                        f"| {r['store']} | {n_acc} | {r['c']} | {f1(r['settled_per_s'])} | {r['hold_p50_ms']:.2f} "
                        f"| {r['settle_p50_ms']:.2f} | {r['hold_p99_ms']:.2f} | {r['settle_p99_ms']:.2f} |"
                    )
        add("")
    if res.get("g") is not None:
        L.extend(alternatives_rows(res["g"]))
    h = res.get("h")
    if h is not None:
        L.extend(market.section_lines(h) if "rows" in h else [market.HEADING, "", f"error: {h['error']}", ""])
    if res.get("i") is not None:
        L.extend(disk.section_lines(res["i"]))
    if res.get("j") is not None:
        L.extend(cluster_cpu.section_lines(res["j"]))
    add("## Targets (issue 40; (f) is issue 17's, the 10x LiteLLM row issue 7's)")
    add("")
    add("| scenario | target | measured | met |")
    add("|---|---|---|---|")
    for row in targets_table(res):
        add("| " + " | ".join(row) + " |")
    add("")
    add(
        "Where a request's CPU goes (the profile behind the missed CPU rows: by thread and library, "
        "instructions at c=1 and c=64, the interpreter's share by package): docs/design.md, "
        '"Where a request\'s CPU goes".'
    )
    add("")
    add("Logs of this run: `bench/.work/logs/` (not committed).")
    path.write_text("\n".join(L) + "\n")


def targets_table(res: dict[str, Any]) -> list[list[str]]:
    """Issue 40's targets (gateway pinned to one core, metering on: the CPU a request
    where it names one), issue 17's for the ledger (f) and issue 7's ratio to LiteLLM,
    against this run's figures."""
    rows: list[list[str]] = []

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("**met**" if ok else "**missed**")

    a = res.get("a", {})
    if "p50_us" in a.get("bourse", {}) and "p50_us" in a.get("direct", {}):
        p50 = (a["bourse"]["p50_us"] - a["direct"]["p50_us"]) / 1000
        p99 = (a["bourse"]["p99_us"] - a["direct"]["p99_us"]) / 1000
        rows.append(["(a) added latency, c=1", "p50 ≤ 0.4 ms", f"{p50:.3f} ms", verdict(p50 <= 0.4)])
        rows.append(["(a) added latency, c=1", "p99 ≤ 1.2 ms", f"{p99:.3f} ms", verdict(p99 <= 1.2)])
        rows.append(_cpu_row("(a) gateway CPU, c=1", 400, a["bourse"]))
    else:
        rows.append(["(a) added latency, c=1", "p50 ≤ 0.4 ms, p99 ≤ 1.2 ms", "—", verdict(None)])
    b = res.get("b", {})
    if "rps" in b.get("bourse", {}):
        r = b["bourse"]["rps"]
        rows.append(
            [
                "(b) c=64 throughput",
                "≥ 5,000 requests/s, metering on",
                f"{r:,.0f} requests/s",
                verdict(r >= 5000),
            ]
        )
        rows.append(_cpu_row("(b) gateway CPU, c=64", 200, b["bourse"]))
        if "rps" in b.get("litellm", {}):
            x = r / b["litellm"]["rps"]
            rows.append(["(b) c=64 throughput", "≥ 10x LiteLLM (issue 7)", f"{x:.2f}x", verdict(x >= 10)])
        else:
            rows.append(
                ["(b) c=64 throughput", "≥ 10x LiteLLM (issue 7)", "LiteLLM not measured", verdict(None)]
            )
    else:
        rows.append(["(b) c=64 throughput", "≥ 5,000 requests/s; ≥ 10x LiteLLM", "—", verdict(None)])
    c = res.get("c", {})
    if "rps" in c.get("bourse", {}) and "rps" in c.get("direct", {}):
        x = c["bourse"]["rps"] / c["direct"]["rps"]
        rows.append(["(c) 50 ms upstream, c=256", "≥ 80 % of direct", f"{x * 100:.1f} %", verdict(x >= 0.8)])
    else:
        rows.append(["(c) 50 ms upstream, c=256", "≥ 80 % of direct", "—", verdict(None)])
    d = res.get("d", {})
    if "c1" in d.get("bourse", {}) and "c1" in d.get("direct", {}):
        add = d["bourse"]["c1"]["ttft_p50_ms"] - d["direct"]["c1"]["ttft_p50_ms"]
        sps = d["bourse"]["cn"]["streams_per_s"]
        rows.append(["(d) streaming", "added TTFT p50 ≤ 0.5 ms (c=1)", f"{add:.3f} ms", verdict(add <= 0.5)])
        rows.append(
            ["(d) streaming", "≥ 3,000 streams/s (c=32)", f"{sps:,.0f} streams/s", verdict(sps >= 3000)]
        )
    else:
        rows.append(["(d) streaming", "added TTFT p50 ≤ 0.5 ms; ≥ 3,000 streams/s", "—", verdict(None)])
    rows.append(_memory_target(res))
    if res.get("i") is not None:
        rows.extend(disk.target_rows(res["i"]))
    if res.get("j") is not None:
        rows.extend(cluster_cpu.target_rows(res["j"]))
    pg = [
        r
        for r in res.get("f", {}).get("rows", [])
        if r["store"] == "postgres" and r["c"] == 32 and r.get("accounts", 1) == 1 and "settled_per_s" in r
    ]
    target = "≥ 2,000 hold+settle pairs/s, PostgreSQL, one account, c=32"
    if pg:
        per_s = pg[0]["settled_per_s"]
        rows.append(["(f) ledger, one hot account", target, f"{per_s:,.0f}/s", verdict(per_s >= 2000)])
    else:
        rows.append(["(f) ledger, one hot account", target, "—", verdict(None)])
    return rows


def _cpu_row(what: str, limit_us: int, r: dict[str, Any]) -> list[str]:
    """The gateway's CPU a request of one wrk run against ``limit_us``."""
    target = f"≤ {limit_us} µs a request"
    if not r.get("cpu_us"):
        return [what, target, "—", "not measured"]
    us = float(r["cpu_us"])
    return [what, target, f"{us:,.0f} µs", "**met**" if us <= limit_us else "**missed**"]


def _memory_target(res: dict[str, Any]) -> list[str]:
    """(e): the peak RSS with 10,000 streams open at once, ≤ 250 MiB (issue 40)."""
    runs = [r for r in res.get("e", {}).get("runs", []) if "vmhwm_end_kb" in r]
    full = [r for r in runs if r["streams"] >= 10_000]
    if not full:
        return ["(e) 10,000 open streams", "≤ 250 MiB peak RSS", "—", "not measured"]
    r = full[0]
    mib = r["vmhwm_end_kb"] / 1024
    ok = r["max_open"] >= r["streams"]
    others = "; ".join(
        f"{x['upstream']}: {x['vmhwm_end_kb'] / 1024:,.0f} MiB with {x['max_open']:,} open"
        for x in runs
        if x is not r
    )
    met = "**met**" if mib <= 250 and ok else "**missed**"
    if not ok:
        met += f" (only {r['max_open']:,} open at once: not demonstrated at {r['streams']:,})"
    measured = f"{mib:,.0f} MiB peak with {r['max_open']:,} open at once ({r['upstream']})" + (
        f"; {others}" if others else ""
    )
    return ["(e) 10,000 open streams", "≤ 250 MiB peak RSS", measured, met]


# --------------------------------------------------------------------------- main


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), max(hard, want)))
        return
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def tool_stack(out: Path) -> Stack:
    """A measuring tool's start (bench.callgrind, bench.calls): its output folder and the
    harness's logs folder made, the open-files limit raised; a new :class:`Stack`."""
    out.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    raise_nofile()
    return Stack()


def start_targets(es: contextlib.ExitStack, stack: Stack, only: set[str], *, peers: bool) -> None:
    """nginx, and for (a)-(d) bourse (twice for (a), (b): observing on and off) and the peers."""
    log("starting nginx")
    es.enter_context(nginx(stack))
    if not only & set("abcd"):
        return
    log("starting bourse")
    es.enter_context(bourse(stack))
    if only & set("ab"):
        log("starting bourse for the always_stream row")
        es.enter_context(bourse_one(stack))
        log("starting bourse with metrics and access log off")
        try:
            es.enter_context(bourse_quiet(stack))
        except RuntimeError as exc:  # a tree without those settings (BOURSE_BENCH_SRC: an older commit)
            log(f"  not started: {exc}")
            stack.notes.append(f"bourse with metrics and access log off: not started ({str(exc)[:200]})")
    if peers:
        log("starting LiteLLM proxy")
        es.enter_context(litellm(stack))
        log("starting Portkey gateway")
        es.enter_context(portkey(stack))


def sanity_checks(stack: Stack) -> dict[str, str]:
    """Each target's sanity check (and the delayed upstream's, for the gateways): what failed."""
    checks: dict[str, str] = {}
    for key, gw in stack.gateways.items():
        checks[key] = sanity(gw)
        if checks[key]:
            log(f"sanity check failed for {key}: {checks[key]}")
        if key in ("bourse", "litellm", "portkey"):
            cd = sanity(gw, "delay")
            if cd:
                checks[key + " (delay)"] = cd
                log(f"sanity check failed for {key} (delay): {cd}")
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test of the harness)")
    ap.add_argument("--only", default="a,b,c,d,e,f,g,h,i,j", help="scenarios to run, e.g. a,b")
    ap.add_argument("--out", default=str(BENCH / "RESULTS.md"))
    ap.add_argument(
        "--e-upstream",
        choices=("auto", "nginx", "sim"),
        default="auto",
        help="upstream of scenario (e): nginx (needs ~2 descriptors a stream) or the sim engine; "
        "auto: nginx when the open-files limit allows",
    )
    ap.add_argument("--no-peers", action="store_true", help="leave LiteLLM and Portkey out")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="(a), (b): measure bourse with observing on and off N times, alternately",
    )
    ap.add_argument("--ledger-worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ledger_worker:
        ledger_worker(args.ledger_worker)
        return
    started = time.time()
    WORK.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    for old in LOGS.iterdir():
        if old.is_file():  # the harness's own logs (bench.calls and bench.callgrind keep folders here)
            old.unlink()
    raise_nofile()
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {LOAD_CPU})
    o = (
        Opts(
            seconds=3,
            warmup=1,
            sse_c1_seconds=2,
            sse_seconds=3,
            streams=1000,
            ramp_timeout=30,
            hold_s=2,
            ledger_n=300,
        )
        if args.quick
        else Opts()
    )
    o.e_upstream = args.e_upstream
    o.rounds = args.rounds
    only = set(args.only.split(","))
    stack = Stack()
    res: dict[str, Any] = {}
    checks: dict[str, str] = {}
    with contextlib.ExitStack() as es:
        start_targets(es, stack, only, peers=not args.no_peers)
        for peer, why in stack.missing.items():
            log(f"{peer}: {why}")
        stack.versions = versions(stack)
        checks.update(sanity_checks(stack))
        if "a" in only:
            log("(a) c=1 non-streamed")
            res["a"] = scenario_wrk(stack, "fast", 1, o)
        if "b" in only:
            log("(b) c=64 non-streamed")
            res["b"] = scenario_wrk(stack, "fast", 64, o)
        if "c" in only:
            log("(c) 50 ms upstream, c=256")
            res["c"] = scenario_wrk(stack, "delay", 256, o)
        if "d" in only:
            log("(d) streaming")
            res["d"] = scenario_d(stack, o)
        if "bourse" in stack.gateways:
            gw = stack.gateways["bourse"]
            stack.notes.append(
                f"bourse's peak RSS over scenarios (a)-(d): {vm(gw.pid).get('VmHWM', 0) / 1024:.0f} MiB."
            )
            with contextlib.suppress(Exception):
                acct = httpx.get(
                    gw.url.removesuffix("/chat/completions") + "/account", headers=gw.headers, timeout=10
                ).json()
                stack.notes.append(
                    f"Metering check: after (a)-(d) bourse's account `bench` had spent {acct['spent_micros']:,} "
                    f"micro-USD (3 per request), {acct['open_holds_micros']:,} in open holds, "
                    f"{acct['reconciling_micros']:,} reconciling."
                )
        # peers are stopped before (e) and (f): the gateway core is bourse's alone
        es.close()
        if "e" in only:
            log("(e) 10,000 slow streams")
            with nginx(stack):
                res["e"] = scenario_e(stack, o)
        if "f" in only:
            log("(f) ledger")
            res["f"] = guarded(lambda: scenario_f(o))
        if "g" in only:
            log("(g) the stack's alternatives")
            res["g"] = guarded(lambda: scenario_g(o))
        if "h" in only:
            log("(h) the market under overload")
            res["h"] = guarded(lambda: market.scenario(quick=args.quick))
        if "i" in only:
            log("(i) bytes written a request")
            res["i"] = guarded(lambda: disk.scenario(quick=args.quick))
        if "j" in only:
            log("(j) CPU a request, cluster mode against alone")
            res["j"] = guarded(lambda: cluster_cpu.scenario(quick=args.quick))
    (WORK / "results.json").write_text(json.dumps(res, indent=1, default=str))
    write_results(Path(args.out), stack, res, o, started, checks)
    log(f"wrote {args.out} in {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
