-- Version 13: named operators of the admin API, each with a role and an own key
-- (its SHA-256 kept, the secret shown once). owner > admin > billing > viewer; the
-- least role of each admin route is in bourse.http.admin_roles. A name is taken
-- for good (revoked operators included): the audit log's actor operator:<name>
-- names one person. A revoked operator's key is refused (401).
CREATE TABLE operators (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    role TEXT NOT NULL CHECK (role IN ('owner', 'admin', 'billing', 'viewer')),
    key_hash TEXT NOT NULL UNIQUE,
    created_at DOUBLE PRECISION NOT NULL,
    revoked_at DOUBLE PRECISION
);
