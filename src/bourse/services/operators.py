"""The operator use cases of :class:`bourse.services.accounts.AdminService`: create
an operator (its key shown once, its hash stored), list them, revoke one; each
audited (``operator.create``, ``operator.revoke``) in the change's transaction."""

from __future__ import annotations

import os
from typing import Any

from bourse.domain.errors import GatewayError
from bourse.ports.operators import Operator, OperatorExists, OperatorStore, Role, UnknownOperator
from bourse.ports.stores import audit_entry
from bourse.services.auth import OPERATOR_PREFIX, Authenticator, hash_key, new_secret


def operator_view(op: Operator) -> dict[str, Any]:
    return {
        "object": "operator",
        "id": op.id,
        "name": op.name,
        "role": op.role,
        "created_at": op.created_at,
        "revoked_at": op.revoked_at,
    }


class OperatorAdmin:
    store: OperatorStore
    auth: Authenticator

    async def create_operator(self, name: str, role: Role, actor: str) -> dict[str, Any]:
        secret = new_secret(OPERATOR_PREFIX)
        op = Operator("op_" + os.urandom(10).hex(), name, role, self.auth.clock())
        audit = audit_entry(actor, "operator.create", op.id, {"name": name, "role": role})
        try:
            await self.store.create_operator(op, hash_key(secret), audit=audit)
        except OperatorExists:
            raise GatewayError(
                409, "operator_exists", f"An operator named '{name}' exists.", param="name"
            ) from None
        return {**operator_view(op), "key": secret}

    async def list_operators(self) -> list[dict[str, Any]]:
        return [operator_view(op) for op in await self.store.operators()]

    async def revoke_operator(self, operator_id: str, actor: str) -> dict[str, Any]:
        audit = audit_entry(actor, "operator.revoke", operator_id)
        try:
            op = await self.store.revoke_operator(operator_id, self.auth.clock(), audit=audit)
        except UnknownOperator:
            raise GatewayError(404, "not_found", f"No operator '{operator_id}'.") from None
        self.auth.forget_operator(operator_id)
        return operator_view(op)
