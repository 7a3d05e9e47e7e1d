-- Version 16: the admin key lives in the database, so that replicas sharing it agree
-- on which key is the admin key and a rotation reaches every one within the
-- authenticator's cache TTL (1 s). One row per admin key ever used, by the key's
-- SHA-256 (never the key). The current key has is_current = 1 (UNIQUE: at most one,
-- so two rotations at once cannot both win) and no valid_until; a rotated-out key
-- keeps working until valid_until (its grace period), then is refused with a message
-- saying when it stopped. The first start seeds the table with BOURSE_ADMIN_KEY or the
-- data folder's admin_key (bourse.services.admin_key).
CREATE TABLE admin_keys (
    key_hash TEXT PRIMARY KEY,
    is_current INTEGER UNIQUE CHECK (is_current = 1),
    created_at DOUBLE PRECISION NOT NULL,
    valid_until DOUBLE PRECISION,
    CHECK ((is_current IS NULL) <> (valid_until IS NULL))
);
-- The secret that signs dashboard sessions: random, made once by the first gateway
-- that needs it and shared by the replicas (sealed with BOURSE_SECRET_KEY like the
-- webhook secrets). Not derived from the admin key: rotating the admin key does not
-- end operators' sessions. One row.
CREATE TABLE dashboard_secret (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    secret TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
