-- Version 10: each account's totals on its row, kept by the same transactions that
-- move its money (TigerBeetle's pending and posted amounts), so that reading an
-- account is one row, not four sums over its holds and credits:
--   pending_micros   its open and reconciling holds
--   posted_micros    its settled charges (pruned ones included)
--   credited_micros  its credits
-- For every account, credited = balance + pending + posted (the ledger check in the
-- test suite holds each column to the sums it stands for).
ALTER TABLE accounts ADD COLUMN pending_micros BIGINT NOT NULL DEFAULT 0 CHECK (pending_micros >= 0);
ALTER TABLE accounts ADD COLUMN posted_micros BIGINT NOT NULL DEFAULT 0 CHECK (posted_micros >= 0);
ALTER TABLE accounts ADD COLUMN credited_micros BIGINT NOT NULL DEFAULT 0 CHECK (credited_micros >= 0);
UPDATE accounts SET
    pending_micros = COALESCE((SELECT SUM(amount_micros) FROM holds
        WHERE holds.account_id = accounts.id AND holds.state IN ('open', 'reconciling')), 0),
    posted_micros = COALESCE((SELECT SUM(charged_micros) FROM holds
        WHERE holds.account_id = accounts.id AND holds.state = 'settled'), 0)
        + COALESCE((SELECT charged_micros FROM pruned WHERE pruned.account_id = accounts.id), 0),
    credited_micros = COALESCE((SELECT SUM(amount_micros) FROM credits WHERE credits.account_id = accounts.id), 0);
