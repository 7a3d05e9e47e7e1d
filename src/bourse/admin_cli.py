"""``bourse admin …``: the admin API from the command line (over HTTP).

Human-readable tables by default; ``--json`` prints the API's JSON as it is. Every
failure (no admin key, the gateway unreachable, an API error) is one line on stderr
and exit status 2. With the admin key, actions are audited as ``admin:cli``
(``--actor`` names someone else); ``--admin-key`` may be an operator key (``bo_…``),
audited as ``operator:<name>`` with that operator's role. ``admin-key rotate`` prints
the new admin key once (the gateway also writes it into its data folder's
``admin_key`` when its key came from there).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from bourse.admin_cli_render import render
from bourse.domain.periods import CAP_PERIODS
from bourse.settings import read_environment

Request = tuple[str, str, dict[str, Any] | None, dict[str, str] | None]
"""method, path, JSON body, query parameters"""

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


def duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``12h`` or ``30d``: seconds."""
    match = _DURATION.match(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 15m, 12h or 30d, got {text!r}")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _or_none(word: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A value parsed by ``parse``, or None for ``word`` (which clears the field)."""

    def convert(text: str) -> Any:
        return None if text.strip().lower() == word else parse(text)

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _product_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


_EDIT_OPTIONS = {
    "name": "name",
    "products": "products",
    "rpm": "rpm",
    "tpm": "tpm",
    "max_streams": "max_streams",
    "cap_usd": "spend_cap_usd",
    "cap_period": "spend_cap_period",
    "expires_in": "expires_in_s",
}
"""``keys update`` option (argparse dest) -> the field of ``PATCH /admin/keys/{id}``."""


def _add_key_update(keys: Any, leaf: Callable[[Any, str, str], argparse.ArgumentParser]) -> None:
    k = leaf(
        keys, "update", "edit a key's products, limits, name, expiry or spend cap (only the options given)"
    )
    k.add_argument("id")
    unset = argparse.SUPPRESS
    k.add_argument("--name", default=unset, help="a new label")
    k.add_argument("--products", type=_or_none("all", _product_list), default=unset,
                   help="comma-separated products the key may use, or 'all'")  # fmt: skip
    for flag in ("--rpm", "--tpm", "--max-streams"):
        k.add_argument(flag, type=_or_none("none", int), default=unset, help="a new limit, or 'none'")
    k.add_argument("--cap-usd", type=_or_none("none", float), default=unset,
                   help="a new spend cap in USD, or 'none' (no cap)")  # fmt: skip
    k.add_argument("--cap-period", choices=CAP_PERIODS, default=unset,
                   help="a new period for the cap (its count starts at zero)")  # fmt: skip
    k.add_argument("--expires-in", type=_or_none("never", duration), default=unset,
                   help="e.g. 30d from now, or 'never'")  # fmt: skip


def add_parser(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print the JSON answer"
    )
    a = sub.add_parser("admin", help="call the admin API of a running gateway", parents=[common])
    a.add_argument("--url", help="the gateway (default $BOURSE_URL or http://127.0.0.1:8080)")
    a.add_argument(
        "--admin-key",
        help="the admin key or an operator key (default $BOURSE_ADMIN_KEY, else DATA_DIR/admin_key)",
    )
    a.add_argument("--data-dir", default="./data", help="where to find admin_key (default ./data)")
    a.add_argument("--actor", default="cli", help="who to name in the audit log (default: cli)")
    objs = a.add_subparsers(dest="object", required=True)

    def leaf(group: Any, name: str, help_: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = group.add_parser(name, help=help_, parents=[common])
        return p

    def paged(p: argparse.ArgumentParser) -> None:
        p.add_argument("--limit", type=int, default=100, help="rows per page (default 100)")
        p.add_argument("--after", help="the next_after of the previous page")

    acc = objs.add_parser("accounts").add_subparsers(dest="action", required=True)
    c = leaf(acc, "create", "create an account")
    c.add_argument("id")
    c.add_argument("--credit-usd", type=float, default=0.0)
    c.add_argument("--cap-usd", type=float,
                   help="spend cap: at most this much held or charged by all its keys per period")  # fmt: skip
    c.add_argument("--cap-period", choices=CAP_PERIODS, default="total",
                   help="of the cap: total, or the calendar day, week (from Monday) or month in UTC")  # fmt: skip
    c = leaf(acc, "update", "set or remove an account's spend cap, or change its period")
    c.add_argument("id")
    c.add_argument("--cap-usd", type=_or_none("none", float), default=argparse.SUPPRESS,
                   help="a new spend cap in USD, or 'none' (no cap)")  # fmt: skip
    c.add_argument("--cap-period", choices=CAP_PERIODS, default=argparse.SUPPRESS,
                   help="a new period for the cap (its count starts at zero)")  # fmt: skip
    c = leaf(acc, "credit", "add credit to an account")
    c.add_argument("id")
    c.add_argument("--amount-usd", type=float, required=True)
    for action, help_ in (
        ("debit", "take money from an account's balance, for a reason (a ledger entry)"),
        ("refund", "give money back to an account, for a reason (a credit, audited as a refund)"),
    ):
        c = leaf(acc, action, help_)
        c.add_argument("id")
        c.add_argument("--amount-usd", type=float, required=True)
        c.add_argument("--reason", required=True, help="why (kept in the ledger and the audit log)")
    c = leaf(acc, "show", "balance, holds and spend of an account")
    c.add_argument("id")
    paged(leaf(acc, "list", "list accounts (in id order)"))
    for action, help_ in (
        ("suspend", "refuse an account's keys new requests (running ones finish)"),
        ("resume", "let a suspended account's keys work again"),
        ("close", "close an account for good: its keys revoked, its balance reported"),
    ):
        c = leaf(acc, action, help_)
        c.add_argument("id")
        c.add_argument("--reason", help="a note for the audit log")
    c = leaf(acc, "webhook-secret", "give an account a new webhook secret (shown once); held webhooks go out")
    c.add_argument("id")

    secrets = objs.add_parser("webhook-secrets").add_subparsers(dest="action", required=True)
    leaf(
        secrets, "reseal", "seal every webhook secret with the first key of this gateway's BOURSE_SECRET_KEY"
    )

    keys = objs.add_parser("keys").add_subparsers(dest="action", required=True)
    k = leaf(keys, "create", "create an API key (its secret is shown once)")
    k.add_argument("--account", required=True)
    k.add_argument("--name", help="a label for the key")
    k.add_argument("--products", help="comma-separated products the key may use (default: all)")
    k.add_argument("--rpm", type=int)
    k.add_argument("--tpm", type=int)
    k.add_argument("--max-streams", type=int)
    k.add_argument("--expires-in", type=duration, help="e.g. 30d: refused after that")
    k.add_argument("--cap-usd", type=float, help="spend cap: at most this much held or charged per period")
    k.add_argument(
        "--cap-period",
        choices=CAP_PERIODS,
        default="total",
        help="of the cap: total, or the calendar day, week (from Monday) or month in UTC (default total)",
    )
    k = leaf(keys, "list", "list API keys, newest first")
    k.add_argument("--account")
    paged(k)
    _add_key_update(keys, leaf)
    k = leaf(keys, "revoke", "revoke a key for good (refused within a second everywhere)")
    k.add_argument("id")
    k.add_argument("--reason")
    k = leaf(keys, "rotate", "give a key a new secret (shown once)")
    k.add_argument("id")
    k.add_argument(
        "--grace", type=duration, default=0.0, help="how long the old secret still works (e.g. 1h)"
    )

    holds = objs.add_parser("holds").add_subparsers(dest="action", required=True)
    h = leaf(holds, "list", "list holds (default: reconciling)")
    h.add_argument("--state", default="reconciling", choices=["open", "settled", "released", "reconciling"])
    h.add_argument("--account")
    h = leaf(holds, "settle", "settle a hold (default amount: its usage estimate, else the whole hold)")
    h.add_argument("id")
    h.add_argument("--amount-micros", type=int)
    h = leaf(holds, "release", "release a hold (charge nothing)")
    h.add_argument("id")

    ops = objs.add_parser("operators").add_subparsers(dest="action", required=True)
    o = leaf(ops, "create", "add an operator with a role (owner only); its key is shown once")
    o.add_argument("name")
    o.add_argument("--role", required=True, choices=["viewer", "billing", "admin", "owner"])
    leaf(ops, "list", "the operators and their roles (revoked ones too)")
    o = leaf(ops, "revoke", "revoke an operator's key for good (owner only)")
    o.add_argument("id")

    r = leaf(objs.add_parser("admin-key").add_subparsers(dest="action", required=True), "rotate",
             "give the admin key a new value (shown once); the old one works for the grace")  # fmt: skip
    r.add_argument("--grace-s", type=duration, default=3600.0,
                   help="how long the old admin key still works: 90, 15m, 12h (default 3600; 0: stops now)")  # fmt: skip

    conf = objs.add_parser("config").add_subparsers(dest="action", required=True)
    f = leaf(
        conf, "apply", "make a config file's products the market in force on every replica (shows the diff)"
    )
    f.add_argument("file", type=Path)
    f.add_argument("--dry-run", action="store_true", help="show what it would change, change nothing")
    leaf(conf, "show", "the market in force: its version and every product's table")
    prods = objs.add_parser("products").add_subparsers(dest="action", required=True)
    f = leaf(prods, "set", 'change a product\'s terms live (KEY=VALUE, VALUE in TOML: 2.5, "text", null)')
    f.add_argument("product")
    f.add_argument("terms", nargs="+", metavar="KEY=VALUE")
    f = leaf(prods, "remove", "take a product off the exchange (what runs there finishes)")
    f.add_argument("product")
    f = leaf(objs.add_parser("deployments").add_subparsers(dest="action", required=True), "set",
             "change a deployment's terms live: floor=2.5 slots=8 (null: back to the default)")  # fmt: skip
    f.add_argument("product")
    f.add_argument("deployment")
    f.add_argument("terms", nargs="+", metavar="KEY=VALUE")

    audit = objs.add_parser("audit").add_subparsers(dest="action", required=True)
    u = leaf(audit, "list", "the audit log of admin actions, newest first")
    u.add_argument("--action", dest="audit_action", help="e.g. key.revoke")
    u.add_argument("--target", help="an account, key or hold id")
    paged(u)
    a.set_defaults(func=run)  # not json: the parents share the --json action (its default stays SUPPRESS)


def _page_params(args: argparse.Namespace, **extra: str | None) -> dict[str, str]:
    params = {"limit": str(args.limit)}
    if args.after:
        params["after"] = args.after
    params.update({k: v for k, v in extra.items() if v})
    return params


def _accounts(args: argparse.Namespace) -> Request:
    act = args.action
    if act == "create":
        body: dict[str, Any] = {"id": args.id, "credit_usd": args.credit_usd}
        if args.cap_usd is not None:
            body |= {"spend_cap_usd": args.cap_usd, "spend_cap_period": args.cap_period}
        return "POST", "/admin/accounts", body, None
    if act == "update":
        edit = {field: getattr(args, dest) for dest, field in _EDIT_OPTIONS.items() if dest.startswith("cap_")
                and hasattr(args, dest)}  # fmt: skip
        return "PATCH", f"/admin/accounts/{args.id}", edit, None
    if act == "credit":
        return "POST", f"/admin/accounts/{args.id}/credit", {"amount_usd": args.amount_usd}, None
    if act in ("debit", "refund"):
        return (
            "POST",
            f"/admin/accounts/{args.id}/{act}",
            {"amount_usd": args.amount_usd, "reason": args.reason},
            None,
        )
    if act == "list":
        return "GET", "/admin/accounts", None, _page_params(args)
    if act in ("suspend", "resume", "close"):
        return (
            "POST",
            f"/admin/accounts/{args.id}/{act}",
            {} if args.reason is None else {"reason": args.reason},
            None,
        )
    if act == "webhook-secret":
        return "POST", f"/admin/accounts/{args.id}/webhook_secret", {}, None
    return "GET", f"/admin/accounts/{args.id}", None, None


def _webhook_secrets(args: argparse.Namespace) -> Request:
    return "POST", "/admin/webhook_secrets/reseal", {}, None


def _new_key_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"account": args.account}
    if args.products:
        body["products"] = [p.strip() for p in args.products.split(",") if p.strip()]
    options = {
        "rpm": args.rpm,
        "tpm": args.tpm,
        "max_streams": args.max_streams,
        "name": args.name,
        "expires_in_s": args.expires_in,
        "spend_cap_usd": args.cap_usd,
    }
    body.update({k: v for k, v in options.items() if v is not None})
    if args.cap_usd is not None:
        body["spend_cap_period"] = args.cap_period
    return body


def _keys(args: argparse.Namespace) -> Request:
    act = args.action
    if act == "create":
        return "POST", "/admin/keys", _new_key_body(args), None
    if act == "list":
        return "GET", "/admin/keys", None, _page_params(args, account=args.account)
    if act == "update":
        body = {field: getattr(args, dest) for dest, field in _EDIT_OPTIONS.items() if hasattr(args, dest)}
        return "PATCH", f"/admin/keys/{args.id}", body, None
    if act == "revoke":
        return (
            "POST",
            f"/admin/keys/{args.id}/revoke",
            {} if args.reason is None else {"reason": args.reason},
            None,
        )
    return "POST", f"/admin/keys/{args.id}/rotate", {"grace_s": args.grace}, None


def _holds(args: argparse.Namespace) -> Request:
    act = args.action
    if act == "list":
        params = {"state": args.state}
        if args.account:
            params["account"] = args.account
        return "GET", "/admin/holds", None, params
    if act == "settle":
        body = {} if args.amount_micros is None else {"amount_micros": args.amount_micros}
        return "POST", f"/admin/holds/{args.id}/settle", body, None
    return "POST", f"/admin/holds/{args.id}/release", {}, None


def _operators(args: argparse.Namespace) -> Request:
    if args.action == "create":
        return "POST", "/admin/operators", {"name": args.name, "role": args.role}, None
    if args.action == "list":
        return "GET", "/admin/operators", None, None
    return "POST", f"/admin/operators/{args.id}/revoke", {}, None


def _audit(args: argparse.Namespace) -> Request:
    return "GET", "/admin/audit", None, _page_params(args, action=args.audit_action, target=args.target)


def terms(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs, each VALUE a TOML value (``null``: back to the default)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        if value.strip() == "null":
            out[key.strip()] = None
            continue
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value  # a bare word: a string
    return out


def _config(args: argparse.Namespace) -> Request:
    if args.action == "show":
        return "GET", "/admin/market", None, None
    try:
        doc = tomllib.loads(args.file.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{args.file}: {exc}") from None
    if not isinstance(doc.get("products"), dict):
        raise ValueError(f"{args.file}: no [products] table")
    return "POST", "/admin/market", {"products": doc["products"], "dry_run": args.dry_run}, None


def _products(args: argparse.Namespace) -> Request:
    if args.action == "remove":
        return "DELETE", f"/admin/products/{args.product}", None, None
    return "PATCH", f"/admin/products/{args.product}", {"set": terms(args.terms)}, None


def _deployments(args: argparse.Namespace) -> Request:
    body = {"deployments": {args.deployment: terms(args.terms)}}
    return "PATCH", f"/admin/products/{args.product}", body, None


_REQUESTS: dict[str, Callable[[argparse.Namespace], Request]] = {
    "config": _config,
    "products": _products,
    "deployments": _deployments,
    "accounts": _accounts,
    "keys": _keys,
    "holds": _holds,
    "audit": _audit,
    "operators": _operators,
    "webhook-secrets": _webhook_secrets,
    "admin-key": lambda args: ("POST", "/admin/admin_key/rotate", {"grace_s": args.grace_s}, None),
}


def _request(args: argparse.Namespace) -> Request:
    return _REQUESTS[args.object](args)


# -- running ---------------------------------------------------------------------------------


def _fail(message: str) -> int:
    print(f"bourse admin: {message}", file=sys.stderr)
    return 2


def _admin_key(args: argparse.Namespace, env_key: str | None) -> str | None:
    key: str | None = args.admin_key or env_key
    if key:
        return key
    path = Path(args.data_dir) / "admin_key"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _error_line(status: int, doc: Any) -> str:
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        return f"{status} {err.get('code')}: {err.get('message')}"
    return f"{status}: {str(doc)[:300]}"


def run(args: argparse.Namespace) -> int:
    env = read_environment()
    url = (args.url or env.url or "http://127.0.0.1:8080").rstrip("/")
    key = _admin_key(args, env.admin_key)
    if not key:
        where = Path(args.data_dir) / "admin_key"
        return _fail(f"no admin key: pass --admin-key, set BOURSE_ADMIN_KEY, or run where {where} exists")
    try:
        method, path, body, params = _request(args)
    except ValueError as exc:
        return _fail(str(exc))
    headers = {"authorization": f"Bearer {key}", "x-bourse-actor": args.actor}
    try:
        r = httpx.request(method, url + path, json=body, params=params, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        return _fail(f"cannot reach {url}: {exc}")
    try:
        doc = r.json()
    except ValueError:
        doc = {"status": r.status_code, "body": r.text[:500]}
    as_json = getattr(args, "json", False)
    if as_json:
        print(json.dumps(doc, indent=2))
    if not r.is_success:
        return _fail(_error_line(r.status_code, doc))
    if not as_json:
        print(render(args.object, doc))
    return 0
