"""The few PromQL forms docs/operating.md's metric queries use, evaluated over scraped
samples the way Prometheus would over one scrape of each target (every sample carries
its target's ``instance`` label, as Prometheus adds it).

Forms: ``sum|max|min by (l, …) (E)``, ``rate(name[w])`` (read as the counter's value:
over a window from the start, the increase is the value, so a sum or max of rates
counts each series as the sum or max of values does), ``name`` and ``name{l="v", …}``,
and ``E / E`` (one-to-one on equal label sets).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from prometheus_client.samples import Sample

Labels = tuple[tuple[str, str], ...]
Vector = dict[Labels, float]

AGGREGATION = re.compile(r"^(sum|max|min) by \(([\w, ]*)\) \((.*)\)$", re.S)
SELECTOR = re.compile(r"^(?:rate\()?([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?(?:\[\w+\]\))?$")
MATCHER = re.compile(r'(\w+)="([^"]*)"')
AGGREGATE: dict[str, Callable[[list[float]], float]] = {"sum": sum, "max": max, "min": min}


def evaluate(query: str, samples: Iterable[Sample]) -> Vector:
    """The instant vector ``query`` gives over ``samples``."""
    return _eval(" ".join(query.split()), list(samples))


def _eval(q: str, samples: list[Sample]) -> Vector:
    left, right = _split_division(q)
    if right is not None:
        num, den = _eval(left, samples), _eval(right, samples)
        return {k: v / den[k] for k, v in num.items() if k in den and den[k] != 0}
    if q.startswith("(") and q.endswith(")") and _split_division(q[1:-1])[1] is not None:
        return _eval(q[1:-1], samples)
    m = AGGREGATION.match(q)
    if m is not None:
        op, by, inner = m.group(1), [b.strip() for b in m.group(2).split(",") if b.strip()], m.group(3)
        groups: dict[Labels, list[float]] = {}
        for labels, value in _eval(inner, samples).items():
            d = dict(labels)
            key = tuple((b, d.get(b, "")) for b in by)
            groups.setdefault(key, []).append(value)
        return {k: AGGREGATE[op](vs) for k, vs in groups.items()}
    m = SELECTOR.match(q)
    if m is None:
        raise ValueError(f"not a form this evaluator knows: {q}")
    name, matchers = m.group(1), dict(MATCHER.findall(m.group(2) or ""))
    out: Vector = {}
    for s in samples:
        if s.name == name and all(s.labels.get(k, "") == v for k, v in matchers.items()):
            key = tuple(sorted(s.labels.items()))
            assert key not in out, f"two samples of one series: {s}"
            out[key] = s.value
    return out


def _split_division(q: str) -> tuple[str, str | None]:
    """``q`` split at its one top-level `` / ``, or (q, None)."""
    depth = 0
    for i, ch in enumerate(q):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and q.startswith(" / ", i):
            return q[:i], q[i + 3 :]
    return q, None
