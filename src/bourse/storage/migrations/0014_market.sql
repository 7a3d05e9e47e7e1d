-- Version 14: the market's configuration lives in the ledger's database (issue 37): its
-- products, their deployments, floors, slots, default bids and policies, one row per
-- version, as the products' tables of the config file read as JSON (never a secret: an
-- api_key is named by api_key_env and read from each replica's environment). The
-- newest version is in force on every replica; each change (an admin route, the CLI's
-- config apply, SIGHUP, a start with an edited file) writes the next version in one
-- transaction with its audit entry. file_digest is the SHA-256 of the config file's
-- products a version was seeded from (NULL for a change made through the admin API): a
-- start whose file has the digest of the last file applied keeps the database's
-- version, so a price set live survives a restart.
CREATE TABLE market_versions (
    version BIGINT PRIMARY KEY,
    products TEXT NOT NULL,
    file_digest TEXT,
    actor TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
