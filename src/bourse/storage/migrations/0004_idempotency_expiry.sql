-- Version 4: expired idempotency keys are found by their expiry (the periodic purge).

CREATE INDEX idempotency_expiry ON idempotency(expires_at);
