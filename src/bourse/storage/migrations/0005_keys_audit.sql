-- Version 5: the life of an API key (name, expiry, revocation, last use, rotation with
-- a grace period, a spend cap), the key each hold was placed with, and the audit log
-- of admin actions.

ALTER TABLE api_keys ADD COLUMN name TEXT;
ALTER TABLE api_keys ADD COLUMN last_used_at DOUBLE PRECISION;
ALTER TABLE api_keys ADD COLUMN expires_at DOUBLE PRECISION;
ALTER TABLE api_keys ADD COLUMN revoked_at DOUBLE PRECISION;
-- the spend cap: at most spend_cap_micros held or charged per period ('total': period 0
-- for ever; 'day': spend_period is the UTC day number); spend_micros is what the
-- current period has held or charged so far (holds count until they are closed)
ALTER TABLE api_keys ADD COLUMN spend_cap_micros BIGINT CHECK (spend_cap_micros IS NULL OR spend_cap_micros > 0);
ALTER TABLE api_keys ADD COLUMN spend_cap_period TEXT CHECK (spend_cap_period IS NULL OR spend_cap_period IN ('total', 'day'));
ALTER TABLE api_keys ADD COLUMN spend_micros BIGINT NOT NULL DEFAULT 0 CHECK (spend_micros >= 0);
ALTER TABLE api_keys ADD COLUMN spend_period BIGINT NOT NULL DEFAULT 0;
CREATE INDEX api_keys_account ON api_keys(account_id, created_at);
CREATE INDEX api_keys_created ON api_keys(created_at);
-- the secrets a rotation replaced, each valid until its grace period ends
CREATE TABLE api_key_grace (
    key_hash TEXT PRIMARY KEY,
    key_id TEXT NOT NULL REFERENCES api_keys(id),
    valid_until DOUBLE PRECISION NOT NULL
);
CREATE INDEX api_key_grace_key ON api_key_grace(key_id);
-- spend_period: the key's cap period this hold counts against (NULL: not counted)
ALTER TABLE holds ADD COLUMN key_id TEXT;
ALTER TABLE holds ADD COLUMN spend_period BIGINT;
CREATE TABLE audit_log (
    id TEXT PRIMARY KEY,
    at DOUBLE PRECISION NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX audit_log_at ON audit_log(at, id);
CREATE INDEX audit_log_action ON audit_log(action, at);
CREATE INDEX audit_log_target ON audit_log(target, at);
