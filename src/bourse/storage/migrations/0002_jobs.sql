-- Version 2: detached requests (jobs) and their results.

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
