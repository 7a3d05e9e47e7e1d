-- Version 19: a hold enters the indexes by request and by account at its close, not
-- at its placing and again at its close (issue 40). A close changes `state`, which
-- the partial indexes name, so on PostgreSQL it is no HOT update: its new row version
-- gets an entry in every index whose predicate it meets, the non-partial ones included,
-- though the placing had made one in each already (~170 bytes of WAL a request at c=1).
-- Now each is partial, the closed holds only; the open and reconciling holds, few, are
-- found by their own partial indexes (holds_open, holds_reconciling):
-- the closed holds by request (retention's check that a request's holds are all old
-- and its delete);
CREATE INDEX holds_closed_request ON holds(request_id) WHERE state IN ('settled', 'released');
-- the closed holds of an account, newest first (the admin's list).
CREATE INDEX holds_closed_account ON holds(account_id, created_at) WHERE state IN ('settled', 'released');
DROP INDEX holds_request;
DROP INDEX holds_account_time;
