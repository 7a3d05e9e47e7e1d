-- Version 6: the operator's views across accounts (dashboard, CSV exports) read usage and jobs by time.
CREATE INDEX usage_time ON usage(created_at, request_id);
CREATE INDEX jobs_time ON jobs(created_at, id);
