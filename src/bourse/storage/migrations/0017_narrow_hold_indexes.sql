-- Version 17: fewer index pages written a request (issue 40). Each write transaction
-- logs every page it touches, whole (SQLite: to the WAL, then again at the checkpoint;
-- PostgreSQL: a full page after each checkpoint, a record otherwise). The indexes on
-- (owner, state), (account_id, state) and (state, updated_at) moved every hold's
-- entry twice, at its placing and at its close: three pages each a request. Now:
-- the open holds by owner (the sweeper's and the shutdown's look-ups), a small index
-- a hold enters at its placing and leaves at its close;
CREATE INDEX holds_open ON holds(owner) WHERE state = 'open';
-- the reconciling holds by account (an account's totals; none in the normal path);
CREATE INDEX holds_reconciling ON holds(account_id, state) WHERE state = 'reconciling';
-- the closed holds by the time they were closed (retention), entered once, at the close;
CREATE INDEX holds_closed ON holds(updated_at) WHERE state IN ('settled', 'released');
-- an account's holds, newest first (the admin's list), entered once, at the placing.
CREATE INDEX holds_account_time ON holds(account_id, created_at);
DROP INDEX holds_owner;
DROP INDEX holds_account;
DROP INDEX holds_state_age;
