-- The PostgresStore tables, created by PostgresStore.create_schema() and `starlette-idempotency
-- migrate`, and printed for migration tools by `starlette-idempotency migrate --sql`. Safe to
-- run again: every statement is IF NOT EXISTS. The table and index names are validated and
-- quoted when they are filled in.
--
-- key                   storage key ("<prefix>:<middleware key>"), the only uniqueness that matters
-- idempotency_key       the client's Idempotency-Key, kept for inspection
-- status                InProgress | Completed | Failed
-- owner_token           fences every write after the acquire
-- response_*            the stored response; headers as a JSON list of [name, value] pairs
-- created_at            the record's created_at, as the middleware set it
-- record_expires_at     the record's expires_at, as the middleware set it: returned as stored,
--                       never used to decide anything (a pod's clock may be off); when NULL
--                       (a row written by hand), expires_at is returned instead
-- locked_until          end of the in-progress lock (NULL once finished); for a record with
--                       checkpoints, the lease a retry must wait out before taking it over
-- checkpoints           recovery points (JSON list), NULL until a handler records one
-- expires_at            when the row stops counting, on the database clock: the lock's end
--                       while InProgress, the end of the retention time once finished. Expired
--                       rows are ignored by every query at once; purge_expired() deletes them.

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
    record_expires_at     timestamptz,
    locked_until          timestamptz,
    checkpoints           jsonb,
    expires_at            timestamptz NOT NULL
);

-- Tables created by 0.1 before recovery points existed.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS checkpoints jsonb;

-- purge_expired() walks expired rows in expiry order.
CREATE INDEX IF NOT EXISTS {index} ON {table} (expires_at);

-- Claims on the operations that apps guard (see OperationClaimingStore), beside the records:
-- one row per app (holder) and operation, so that two services never share one operation.
--
-- operation             the claimed operation ("<prefix>:<method> <template>"): several key
--                       prefixes may share one table
-- holder                the app that claims it, from its startup to its shutdown (a random token)
-- code                  the handler that serves it in that app (module:qualname)
-- expires_at            when the claim lapses unless renewed, on the database clock
CREATE TABLE IF NOT EXISTS {operations} (
    operation             text        NOT NULL,
    holder                text        NOT NULL,
    code                  text        NOT NULL,
    expires_at            timestamptz NOT NULL,
    PRIMARY KEY (operation, holder)
);
