-- Version 18: an account's sealed webhook secret in a table of its own (issue 40). The
-- account's row is written twice a request (at the hold and at its close), and each
-- write logs the row again (SQLite: its page; PostgreSQL: the new row version, whole
-- or from the first changed column to the last): the sealed secret, ~170 bytes, was
-- more than half of it and never changes with the money. Secrets are set at the
-- account's creation and by POST /admin/accounts/{id}/webhook_secret and the re-seal,
-- and read when a webhook is signed. An account without a row here has no secret.
CREATE TABLE webhook_secrets (
    account_id TEXT PRIMARY KEY REFERENCES accounts(id),
    secret TEXT NOT NULL
);
INSERT INTO webhook_secrets (account_id, secret)
    SELECT id, webhook_secret FROM accounts WHERE webhook_secret IS NOT NULL;
ALTER TABLE accounts DROP COLUMN webhook_secret;
