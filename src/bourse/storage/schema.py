"""Versioned migrations, one SQL text per version, valid on SQLite and PostgreSQL.

Each version is applied once, in order, inside a transaction, and recorded in
``schema_migrations``. Add a version; never edit one that has shipped.
Money columns are integer micro-USD with CHECK constraints that make an overdraft
or an over-charge impossible at the database level.
"""

from __future__ import annotations

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
CREATE TABLE accounts (
    id TEXT PRIMARY KEY,
    balance_micros BIGINT NOT NULL CHECK (balance_micros >= 0),
    created_at DOUBLE PRECISION NOT NULL,
    webhook_secret TEXT
);
CREATE TABLE credits (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    amount_micros BIGINT NOT NULL CHECK (amount_micros > 0),
    memo TEXT NOT NULL DEFAULT '',
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX credits_account ON credits(account_id);
CREATE TABLE holds (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    request_id TEXT NOT NULL,
    amount_micros BIGINT NOT NULL CHECK (amount_micros >= 0),
    charged_micros BIGINT NOT NULL DEFAULT 0 CHECK (charged_micros >= 0 AND charged_micros <= amount_micros),
    state TEXT NOT NULL CHECK (state IN ('open', 'settled', 'released', 'reconciling')),
    owner TEXT NOT NULL,
    product TEXT NOT NULL DEFAULT '',
    note TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX holds_state ON holds(state);
CREATE INDEX holds_owner ON holds(owner, state);
CREATE INDEX holds_account ON holds(account_id, state);
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    account_id TEXT NOT NULL REFERENCES accounts(id),
    products TEXT,
    rpm INTEGER,
    tpm INTEGER,
    max_streams INTEGER,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE usage (
    request_id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    product TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    outcome TEXT NOT NULL,
    cost_micros BIGINT NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX usage_account_time ON usage(account_id, created_at);
CREATE TABLE idempotency (
    account_id TEXT NOT NULL,
    key TEXT NOT NULL,
    body_hash TEXT NOT NULL,
    state TEXT NOT NULL,
    status INTEGER,
    headers TEXT,
    body BYTEA,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (account_id, key)
);
CREATE TABLE instances (
    id TEXT PRIMARY KEY,
    started_at DOUBLE PRECISION NOT NULL,
    lease_until DOUBLE PRECISION NOT NULL
);
""",
    ),
    (
        2,
        """
CREATE TABLE jobs (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    key_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    body TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'canceled', 'expired')),
    request_id TEXT NOT NULL,
    bid DOUBLE PRECISION NOT NULL,
    hold_id TEXT,
    webhook_url TEXT,
    webhook_state TEXT NOT NULL DEFAULT 'none',
    result TEXT,
    error TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION
);
CREATE INDEX jobs_account ON jobs(account_id, created_at);
CREATE INDEX jobs_status ON jobs(status, expires_at);
""",
    ),
    (
        3,
        """
ALTER TABLE jobs ADD COLUMN owner TEXT;
""",
    ),
    (
        4,
        """
CREATE INDEX usage_time ON usage(created_at, request_id);
CREATE INDEX jobs_time ON jobs(created_at, id);
""",
    ),
]
