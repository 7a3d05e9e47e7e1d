-- Version 1: accounts, credits, holds, API keys, usage records, idempotency keys and
-- gateway instances (the ledger and what surrounds it).

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
