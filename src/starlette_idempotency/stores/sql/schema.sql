-- The PostgresStore table, created by PostgresStore.create_schema() and `starlette-idempotency
-- migrate`. Safe to run again: every statement is IF NOT EXISTS. "{table}" and "{index}" are
-- replaced by the validated, quoted table and index names.
--
-- key                   storage key ("<prefix>:<middleware key>"), the only uniqueness that matters
-- idempotency_key       the client's Idempotency-Key, kept for inspection
-- status                InProgress | Completed | Failed
-- owner_token           fences every write after the acquire
-- response_*            the stored response; headers as a JSON list of [name, value] pairs
-- locked_until          end of the in-progress lock (NULL once finished)
-- expires_at            when the row stops counting: the lock's end while InProgress, the end
--                       of the retention time once finished. Expired rows are ignored by every
--                       query at once and deleted later by purge_expired().

CREATE TABLE IF NOT EXISTS {table} (
    key                   text        PRIMARY KEY,
    idempotency_key       text        NOT NULL,
    status                text        NOT NULL
                          CHECK (status IN ('InProgress', 'Completed', 'Failed')),
    request_fingerprint   text        NOT NULL,
    fingerprint_version   text        NOT NULL DEFAULT '1',
    owner_token           text        NOT NULL,
    response_status_code  integer,
    response_headers      jsonb,
    response_body         bytea,
    response_content_type text,
    created_at            timestamptz NOT NULL,
    locked_until          timestamptz,
    expires_at            timestamptz NOT NULL
);

-- purge_expired() walks expired rows in expiry order.
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);
