-- Version 11: an account's status. A suspended account's keys are refused new
-- requests (403 account_suspended) until it is resumed; a closed one's keys are
-- revoked and it cannot be resumed. status_reason is the operator's note (never
-- shown to the account's callers).
ALTER TABLE accounts ADD COLUMN status TEXT NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'suspended', 'closed'));
ALTER TABLE accounts ADD COLUMN status_reason TEXT;
