"""Operators of the admin API: who they are (a name and a role) and the port that
stores them (their keys hashed, never in clear).

Roles are ranked ``viewer`` < ``billing`` < ``admin`` < ``owner``: a role may call
every route its own or a lower role may (:func:`role_at_least`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from bourse.domain.values import immutable
from bourse.ports.stores import AuditEntry

Role = Literal["viewer", "billing", "admin", "owner"]
ROLES: tuple[Role, ...] = ("viewer", "billing", "admin", "owner")
"""Lowest first."""


def role_at_least(role: Role, need: Role) -> bool:
    return ROLES.index(role) >= ROLES.index(need)


@immutable
class Operator:
    id: str
    name: str
    role: Role
    created_at: float
    revoked_at: float | None = None


class UnknownOperator(Exception):
    pass


class OperatorExists(Exception):
    """The name is taken (by a current or a revoked operator)."""


class OperatorStore(Protocol):
    async def create_operator(self, op: Operator, key_hash: str, *, audit: AuditEntry | None = None) -> None:
        """OperatorExists."""

    async def operator_by_hash(self, key_hash: str) -> Operator | None:
        """The operator of a key's hash, revoked ones too."""
        ...

    async def operators(self) -> Sequence[Operator]:
        """Every operator, oldest first (revoked ones too)."""
        ...

    async def revoke_operator(
        self, operator_id: str, now: float, *, audit: AuditEntry | None = None
    ) -> Operator:
        """Revoke for good (again: keeps the first time); UnknownOperator."""
        ...
