-- Version 8: retention ([storage] retention_s). Usage records and closed holds older
-- than the retention are deleted; what they added up to is kept here, per account, so
-- the ledger still balances:
--   credits = balances + open and reconciling holds + settled charges + pruned.charged_micros
-- and the usage records' costs plus pruned.usage_cost_micros still equal the revenue.
CREATE TABLE pruned (
    account_id TEXT PRIMARY KEY,
    charged_micros BIGINT NOT NULL DEFAULT 0 CHECK (charged_micros >= 0),
    usage_cost_micros BIGINT NOT NULL DEFAULT 0,
    holds BIGINT NOT NULL DEFAULT 0,
    usage_records BIGINT NOT NULL DEFAULT 0,
    updated_at DOUBLE PRECISION NOT NULL
);
-- and, per capped key and spend period, the charges of its pruned holds (a key's spend
-- counter is still what its holds of the period held or charged, these included)
CREATE TABLE pruned_key_spend (
    key_id TEXT NOT NULL,
    spend_period BIGINT NOT NULL,
    charged_micros BIGINT NOT NULL DEFAULT 0 CHECK (charged_micros >= 0),
    PRIMARY KEY (key_id, spend_period)
);
-- the prune finds closed holds by age, and a request's other holds by its id; the
-- (state, updated_at) index also serves every look-up by state alone
CREATE INDEX holds_state_age ON holds(state, updated_at);
DROP INDEX holds_state;
CREATE INDEX holds_request ON holds(request_id);
