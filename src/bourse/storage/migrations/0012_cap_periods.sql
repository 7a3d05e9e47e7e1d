-- Version 12: a key's spend cap may count per calendar 'week' (ISO, from Monday 00:00
-- UTC) and 'month' (UTC) as well as 'total' and 'day' (bourse.domain.periods numbers
-- them; spend_period keeps the number of the period spend_micros counts).
--
-- The CHECK of version 5 allows 'total' and 'day' only. SQLite cannot alter or drop a
-- CHECK, and a migration is one file for both databases, so the column is replaced
-- by the same statements on each: a new column with the wider CHECK, every key's
-- period copied into it, the old column dropped (its CHECK with it) and the new one
-- renamed. ALTER TABLE DROP COLUMN is in SQLite from 3.35 (the version the store's
-- RETURNING already needs) and RENAME COLUMN from 3.25, and in every supported
-- PostgreSQL; no index, view, trigger or other CHECK names the column.
-- A rebuild of api_keys would have had to move the foreign keys that name it
-- (api_key_grace) and differs per dialect. The migration runs in one transaction, so
-- a key is never seen without its period.
ALTER TABLE api_keys ADD COLUMN cap_period_new TEXT CHECK (cap_period_new IS NULL OR cap_period_new IN ('total', 'day', 'week', 'month'));
UPDATE api_keys SET cap_period_new = spend_cap_period;
ALTER TABLE api_keys DROP COLUMN spend_cap_period;
ALTER TABLE api_keys RENAME COLUMN cap_period_new TO spend_cap_period;
