-- Version 15: an account's spend cap by period, as a key's (version 5 and 12): at most
-- spend_cap_micros held or charged by all the account's keys together per
-- spend_cap_period ('total', or the UTC 'day', 'week' or 'month' numbered by
-- bourse.domain.periods); spend_micros is what the period numbered spend_period has
-- held or charged so far (holds count whole until they are closed). A hold placed
-- in another period starts the count again, so no job resets it.
ALTER TABLE accounts ADD COLUMN spend_cap_micros BIGINT CHECK (spend_cap_micros IS NULL OR spend_cap_micros > 0);
ALTER TABLE accounts ADD COLUMN spend_cap_period TEXT CHECK (spend_cap_period IS NULL OR spend_cap_period IN ('total', 'day', 'week', 'month'));
ALTER TABLE accounts ADD COLUMN spend_micros BIGINT NOT NULL DEFAULT 0 CHECK (spend_micros >= 0);
ALTER TABLE accounts ADD COLUMN spend_period BIGINT NOT NULL DEFAULT 0;
-- account_period: the period of its account's cap this hold counts against (NULL: not
-- counted), so that its close gives back to that period only
ALTER TABLE holds ADD COLUMN account_period BIGINT;
-- per capped account and period, the charges of its pruned holds (as pruned_key_spend:
-- the account's counter is still what its holds of the period held or charged)
CREATE TABLE pruned_account_spend (
    account_id TEXT NOT NULL,
    spend_period BIGINT NOT NULL,
    charged_micros BIGINT NOT NULL DEFAULT 0 CHECK (charged_micros >= 0),
    PRIMARY KEY (account_id, spend_period)
);
