-- Version 7: stored responses of the Responses API (GET /v1/responses/{id}, previous_response_id).
-- body: the response object as last known; input_items: this request's input;
-- context: the conversation through this response (what previous_response_id prepends).

CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    account_id TEXT NOT NULL,
    status TEXT NOT NULL,
    job_id TEXT,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    context TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX responses_expiry ON responses(expires_at);
