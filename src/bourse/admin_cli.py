"""``bourse admin …``: the admin API from the command line (over HTTP)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from bourse.settings import read_environment


def add_parser(sub: Any) -> None:
    a = sub.add_parser("admin", help="call the admin API of a running gateway")
    a.add_argument("--url", help="the gateway (default $BOURSE_URL or http://127.0.0.1:8080)")
    a.add_argument("--admin-key", help="default $BOURSE_ADMIN_KEY, else DATA_DIR/admin_key")
    a.add_argument("--data-dir", default="./data", help="where to find admin_key (default ./data)")
    objs = a.add_subparsers(dest="object", required=True)

    acc = objs.add_parser("accounts").add_subparsers(dest="action", required=True)
    c = acc.add_parser("create", help="create an account")
    c.add_argument("id")
    c.add_argument("--credit-usd", type=float, default=0.0)
    c = acc.add_parser("credit", help="add credit to an account")
    c.add_argument("id")
    c.add_argument("--amount-usd", type=float, required=True)
    c = acc.add_parser("show", help="balance, holds and spend of an account")
    c.add_argument("id")

    keys = objs.add_parser("keys").add_subparsers(dest="action", required=True)
    k = keys.add_parser("create", help="create an API key (shown once)")
    k.add_argument("--account", required=True)
    k.add_argument("--products", help="comma-separated products the key may use (default: all)")
    k.add_argument("--rpm", type=int)
    k.add_argument("--tpm", type=int)
    k.add_argument("--max-streams", type=int)

    holds = objs.add_parser("holds").add_subparsers(dest="action", required=True)
    h = holds.add_parser("list", help="list holds (default: reconciling)")
    h.add_argument("--state", default="reconciling", choices=["open", "settled", "released", "reconciling"])
    h.add_argument("--account")
    h = holds.add_parser(
        "settle", help="settle a hold (default amount: its usage estimate, else the whole hold)"
    )
    h.add_argument("id")
    h.add_argument("--amount-micros", type=int)
    h = holds.add_parser("release", help="release a hold (charge nothing)")
    h.add_argument("id")
    a.set_defaults(func=run)


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None, dict[str, str] | None]:
    o, act = args.object, args.action
    if o == "accounts":
        if act == "create":
            return "POST", "/admin/accounts", {"id": args.id, "credit_usd": args.credit_usd}, None
        if act == "credit":
            return "POST", f"/admin/accounts/{args.id}/credit", {"amount_usd": args.amount_usd}, None
        return "GET", f"/admin/accounts/{args.id}", None, None
    if o == "keys":
        body: dict[str, Any] = {"account": args.account}
        if args.products:
            body["products"] = [p.strip() for p in args.products.split(",") if p.strip()]
        for name in ("rpm", "tpm", "max_streams"):
            if getattr(args, name) is not None:
                body[name] = getattr(args, name)
        return "POST", "/admin/keys", body, None
    if act == "list":
        params = {"state": args.state}
        if args.account:
            params["account"] = args.account
        return "GET", "/admin/holds", None, params
    if act == "settle":
        return (
            "POST",
            f"/admin/holds/{args.id}/settle",
            ({} if args.amount_micros is None else {"amount_micros": args.amount_micros}),
            None,
        )
    return "POST", f"/admin/holds/{args.id}/release", {}, None


def run(args: argparse.Namespace) -> int:
    env = read_environment()
    url = (args.url or env.url or "http://127.0.0.1:8080").rstrip("/")
    key = args.admin_key or env.admin_key
    if not key:
        path = Path(args.data_dir) / "admin_key"
        if not path.exists():
            print(f"bourse admin: no admin key: pass --admin-key, set BOURSE_ADMIN_KEY, or run where {path} exists",
                  file=sys.stderr)  # fmt: skip
            return 2
        key = path.read_text().strip()
    method, path_, body, params = _request(args)
    # an unreachable server raises: bourse.cli.main reports it in one line, exit 2
    r = httpx.request(method, url + path_, json=body, params=params,
                      headers={"authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
    try:
        doc = r.json()
    except ValueError:
        doc = {"status": r.status_code, "body": r.text[:500]}
    print(json.dumps(doc, indent=2))
    return 0 if r.is_success else 1
