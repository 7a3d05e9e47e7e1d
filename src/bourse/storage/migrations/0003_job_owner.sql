-- Version 3: the gateway instance running each job (replicas take over a lapsed one's).

ALTER TABLE jobs ADD COLUMN owner TEXT;
