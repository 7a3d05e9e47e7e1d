-- Version 9: the key that seals webhook secrets, named by its fingerprint (an HMAC of a
-- fixed text under the key, never the key): a replica whose keys do not include it
-- refuses to start, so replicas of one database cannot seal with different keys. One row.
-- And why a job's webhook is failed or held (a secret that cannot be opened is held).

CREATE TABLE sealing_key (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    fingerprint TEXT NOT NULL,
    set_at DOUBLE PRECISION NOT NULL
);
ALTER TABLE jobs ADD COLUMN webhook_error TEXT;
