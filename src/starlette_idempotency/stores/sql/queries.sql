-- Named queries of PostgresStore, loaded once via importlib.resources. A query starts at its
-- "-- name:" line and runs to the next one; "{table}" is replaced by the validated, quoted
-- table name, "{operations}" by that of the table of operation claims beside it. Each query is
-- one statement, so each runs as its own short transaction.
--
-- Expiry is decided on the database clock (now()) only, so pods with skewed clocks agree.
-- A row whose expires_at <= now() is treated as absent by every query.
--
-- The "row parameters" shared by acquire_insert, acquire_takeover and finish:
--   $1 storage key        $2 client key           $3 status          $4 request fingerprint
--   $5 fingerprint vers.  $6 owner token          $7 response status code
--   $8 response headers (JSON text)               $9 response body   $10 response content type
--   $11 the record's created_at                   $12 the record's expires_at (kept as data)
--   $13 seconds from now() until the row expires (the lock or retention TTL)
--   $14 checkpoints (JSON text, NULL for none)
-- Columns read back (get, acquire_takeover): see "record columns" in postgres.py.

-- name: acquire_insert
-- The common case: claim a key nobody holds. One row (true) when inserted; no row when any
-- row, live or expired, already has the key (then acquire_takeover decides). A row the
-- statement's snapshot shows is never inserted over: ON CONFLICT would wait for a transaction
-- still open that wrote the row (an idempotency_transaction's recovery point or outcome, for as
-- long as the app's work in it takes), where the takeover reads the holder at once.
INSERT INTO {table} AS t (
    key, idempotency_key, status, request_fingerprint, fingerprint_version, owner_token,
    response_status_code, response_headers, response_body, response_content_type,
    created_at, record_expires_at, locked_until, expires_at, checkpoints
)
SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::text, $7::integer,
       $8::text::jsonb, $9::bytea, $10::text, $11::timestamptz, $12::timestamptz,
       now() + make_interval(secs => $13), now() + make_interval(secs => $13),
       $14::text::jsonb
WHERE NOT EXISTS (SELECT 1 FROM {table} WHERE key = $1)
ON CONFLICT (key) DO NOTHING
RETURNING true;

-- name: acquire_takeover
-- After acquire_insert hit a row: take it over if it has expired, else read it.
-- With $15 true, also take over ("recover") an InProgress row with checkpoints whose lease
-- (locked_until) has passed, made by the same request ($4, $5): it keeps its checkpoints and
-- retention (which runs on to the new lease's end if that comes later), and only changes owner
-- and lease. Any other row is taken over whole.
-- The row is locked FOR UPDATE, so of many concurrent takers exactly one still sees it
-- takeable and overwrites it. A row another transaction has locked is skipped, not waited for:
-- a concurrent taker's or the owner's statement, or the app's transaction that fenced it
-- (idempotency_transaction), open for as long as the app's work takes.
-- Returns
--   taken_over = true,  the old row's values (its checkpoints with a recovery only)
--                                                              -> the caller now owns the key;
--   taken_over = false, busy = false, live = true, the holder's values -> the key is held (and
--     lease_expired says whether the holder is a dead handler's record with checkpoints);
--   taken_over = false, busy = true, the row's values           -> takeable but not taken: locked
--     by another transaction (a taker's or the owner's statement, for a moment; the app's
--     that fenced an InProgress row, for as long as its work), or changed since the snapshot;
--   no row                                                     -> the key vanished: start again.
WITH prev AS (
    SELECT *, expires_at > now() AS recovering FROM {table}
    WHERE key = $1 AND (
        expires_at <= now()
        OR ($15 AND status = 'InProgress' AND checkpoints IS NOT NULL AND locked_until <= now()
            AND request_fingerprint = $4 AND fingerprint_version = $5)
    )
    FOR UPDATE SKIP LOCKED
), taken AS (
    UPDATE {table} AS t
    SET owner_token = $6,
        locked_until = now() + make_interval(secs => $13),
        idempotency_key = CASE WHEN prev.recovering THEN t.idempotency_key ELSE $2::text END,
        status = CASE WHEN prev.recovering THEN t.status ELSE $3::text END,
        request_fingerprint = CASE WHEN prev.recovering THEN t.request_fingerprint ELSE $4::text END,
        fingerprint_version = CASE WHEN prev.recovering THEN t.fingerprint_version ELSE $5::text END,
        response_status_code = CASE WHEN prev.recovering THEN NULL ELSE $7::integer END,
        response_headers = CASE WHEN prev.recovering THEN NULL ELSE $8::text::jsonb END,
        response_body = CASE WHEN prev.recovering THEN NULL ELSE $9::bytea END,
        response_content_type = CASE WHEN prev.recovering THEN NULL ELSE $10::text END,
        created_at = CASE WHEN prev.recovering THEN t.created_at ELSE $11::timestamptz END,
        record_expires_at = CASE WHEN prev.recovering THEN t.record_expires_at ELSE $12::timestamptz END,
        checkpoints = CASE WHEN prev.recovering THEN t.checkpoints ELSE $14::text::jsonb END,
        expires_at = CASE WHEN prev.recovering
                          THEN greatest(t.expires_at, now() + make_interval(secs => $13))
                          ELSE now() + make_interval(secs => $13) END
    FROM prev
    WHERE t.key = prev.key
    RETURNING t.key
)
SELECT true AS taken_over, false AS busy, true AS live, true AS lease_expired,
       prev.idempotency_key, prev.status, prev.request_fingerprint, prev.fingerprint_version,
       prev.owner_token, prev.response_status_code, prev.response_headers::text AS response_headers,
       prev.response_body, prev.response_content_type, prev.created_at,
       coalesce(prev.record_expires_at, prev.expires_at) AS record_expires_at,
       -- the recovery points go on with a recovery; an expired row's stay behind, as on Redis
       CASE WHEN prev.recovering THEN prev.checkpoints::text END AS checkpoints,
       CASE WHEN prev.checkpoints IS NULL THEN NULL ELSE prev.locked_until END AS lease_until
FROM prev
UNION ALL
SELECT false AS taken_over,
       cur.expires_at <= now()
       OR coalesce($15 AND cur.status = 'InProgress' AND cur.checkpoints IS NOT NULL
                   AND cur.locked_until <= now() AND cur.request_fingerprint = $4
                   AND cur.fingerprint_version = $5, false) AS busy,
       cur.expires_at > now() AS live,
       coalesce(cur.status = 'InProgress' AND cur.checkpoints IS NOT NULL
                AND cur.locked_until <= now(), false) AS lease_expired,
       cur.idempotency_key, cur.status, cur.request_fingerprint, cur.fingerprint_version,
       cur.owner_token, cur.response_status_code, cur.response_headers::text AS response_headers,
       cur.response_body, cur.response_content_type, cur.created_at,
       coalesce(cur.record_expires_at, cur.expires_at) AS record_expires_at,
       cur.checkpoints::text AS checkpoints,
       CASE WHEN cur.checkpoints IS NULL THEN NULL ELSE cur.locked_until END AS lease_until
FROM {table} AS cur
WHERE cur.key = $1 AND NOT EXISTS (SELECT 1 FROM prev);

-- name: finish
-- complete() and fail(): store the final record for $13 seconds if the owner still holds the
-- key, or if nobody does (row absent or expired: the lock lapsed and nobody took it over).
-- Returns one value, a FencedWrite: 1 (WRITTEN) when the owner's live row was overwritten;
-- 2 (RECLAIMED) when the row was absent or expired, and the record was written anyway;
-- 0 (LOST) when another owner holds the key: nothing was written.
-- prev locks the row before anything is written (FOR UPDATE waits for a concurrent writer,
-- then reads its committed version), so the row cannot change between prev's reading and the
-- upsert: prev.held says whether the write replaced the owner's live lock. The upsert selects
-- from prev so that prev runs first. When prev finds no row, a row inserted since the
-- statement's snapshot meets ON CONFLICT, whose WHERE judges its newest version; if written
-- over, the key was free for a while (RECLAIMED), as for an insert.
WITH prev AS MATERIALIZED (
    SELECT owner_token = $6 AND expires_at > clock_timestamp() AS held
    FROM {table}
    WHERE key = $1
    FOR UPDATE
), written AS (
    INSERT INTO {table} AS t (
        key, idempotency_key, status, request_fingerprint, fingerprint_version, owner_token,
        response_status_code, response_headers, response_body, response_content_type,
        created_at, record_expires_at, locked_until, expires_at, checkpoints
    )
    SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::text, $7::integer,
           $8::text::jsonb, $9::bytea, $10::text, $11::timestamptz, $12::timestamptz,
           NULL::timestamptz, clock_timestamp() + make_interval(secs => $13), $14::text::jsonb
    FROM (SELECT count(*) FROM prev) AS prev_first
    ON CONFLICT (key) DO UPDATE
    SET idempotency_key = EXCLUDED.idempotency_key, status = EXCLUDED.status,
        request_fingerprint = EXCLUDED.request_fingerprint,
        fingerprint_version = EXCLUDED.fingerprint_version, owner_token = EXCLUDED.owner_token,
        response_status_code = EXCLUDED.response_status_code,
        response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body,
        response_content_type = EXCLUDED.response_content_type, created_at = EXCLUDED.created_at,
        record_expires_at = EXCLUDED.record_expires_at, locked_until = EXCLUDED.locked_until,
        expires_at = EXCLUDED.expires_at, checkpoints = EXCLUDED.checkpoints
    WHERE t.owner_token = EXCLUDED.owner_token OR t.expires_at <= clock_timestamp()
    RETURNING 1
)
SELECT CASE
    WHEN NOT EXISTS (SELECT FROM written) THEN 0
    WHEN coalesce((SELECT held FROM prev), false) THEN 1
    ELSE 2
END;

-- name: save_progress
-- The owner's InProgress record gets new checkpoints ($3) and a lease of $4 seconds from now()
-- (0 ends it now), and is kept for the retention time ($6 seconds). $1 storage key, $2 owner
-- token, $5 the record's expires_at (kept as data), $7 true in the transaction whose fence
-- locked the row (a lock that lapsed there is still the owner's: nobody could take it over).
-- One row (true) while the owner holds the key InProgress: a late write never turns a finished
-- record back.
UPDATE {table}
SET checkpoints = $3::text::jsonb, locked_until = clock_timestamp() + make_interval(secs => $4),
    record_expires_at = $5, expires_at = clock_timestamp() + make_interval(secs => $6)
WHERE key = $1 AND owner_token = $2 AND status = 'InProgress'
    AND ($7 OR expires_at > clock_timestamp())
RETURNING true;

-- name: fence
-- (fence, save_progress and finish also run inside the app's transaction, where now() is the
-- time the transaction began, maybe long ago: they read the clock with clock_timestamp().)
-- idempotency_transaction's first statement, in the app's own transaction: lock the row of
-- owner token $2 while it is InProgress, so that it stays this request's until the transaction
-- ends. Expiry is not checked: a lapsed lock that nobody took over is still this request's to
-- finish, and nobody can take it over while the row is locked (save_progress's $7 lets the
-- transaction's own recovery points through). A lock, not a write: an acquire's insert meets
-- the row at once and reads the holder (409), where a row written by a transaction still open
-- makes it wait for that transaction's end; a takeover skips the locked row (acquire_takeover).
-- $1 storage key. One row (true) when fenced; none when the key was taken over, finished or
-- is gone.
SELECT true FROM {table}
WHERE key = $1 AND owner_token = $2 AND status = 'InProgress'
FOR UPDATE;

-- name: release
-- Delete the owner's row. $1 storage key, $2 owner token.
-- true when it was deleted or no live row of another owner holds the key; false otherwise.
-- (Both parts read the same snapshot; the second ignores the owner's own row.)
WITH gone AS (
    DELETE FROM {table} WHERE key = $1 AND owner_token = $2 RETURNING key
)
SELECT EXISTS (SELECT 1 FROM gone)
    OR NOT EXISTS (
        SELECT 1 FROM {table}
        WHERE key = $1 AND owner_token <> $2 AND expires_at > now()
    );

-- name: renew
-- Extend the owner's live InProgress lock to $3 seconds from now: for a record with checkpoints,
-- its lease, the row then kept at least until the lease ends and, when $4 is not NULL, for $4
-- seconds from now (the retention time; a later expiry is kept). One row (true) when renewed.
-- The new times are read with clock_timestamp(): the UPDATE may wait for the row while the
-- app's transaction that fenced it is open, and now() is the time the statement began.
UPDATE {table}
SET locked_until = clock_timestamp() + make_interval(secs => $3),
    expires_at = CASE WHEN checkpoints IS NULL THEN clock_timestamp() + make_interval(secs => $3)
                      ELSE greatest(expires_at, clock_timestamp() + make_interval(secs => $3),
                                    clock_timestamp() + make_interval(secs => $4)) END
WHERE key = $1 AND owner_token = $2 AND status = 'InProgress' AND expires_at > now()
RETURNING true;

-- name: abandon
-- Give up a key whose acquire the caller abandoned (cancelled or timed out: it will not run the
-- handler), fenced by the abandoned acquire's owner token $2: its row is deleted, or, when it
-- has checkpoints (a recovery takeover), its lease ends now so that a retry recovers at once.
-- When the key has no row at all, an expired row is left under that token, so that an insert
-- of the abandoned acquire that lands only now conflicts with it and writes nothing (the row
-- counts as absent for everyone else). Row parameters $1 to $14 (the abandoned pending record).
-- Returns whether the owner's row was there.
WITH mine AS (
    SELECT key, checkpoints IS NOT NULL AS recovering FROM {table}
    WHERE key = $1 AND owner_token = $6 AND status = 'InProgress'
    FOR UPDATE
), ended AS (
    UPDATE {table} AS t SET locked_until = now()
    FROM mine WHERE t.key = mine.key AND mine.recovering
    RETURNING 1
), gone AS (
    DELETE FROM {table} AS t
    USING mine WHERE t.key = mine.key AND NOT mine.recovering
    RETURNING 1
), fence AS (
    INSERT INTO {table} AS t (
        key, idempotency_key, status, request_fingerprint, fingerprint_version, owner_token,
        response_status_code, response_headers, response_body, response_content_type,
        created_at, record_expires_at, locked_until, expires_at, checkpoints
    )
    SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::text, $7::integer,
           $8::text::jsonb, $9::bytea, $10::text, $11::timestamptz, $12::timestamptz,
           now(), now() - make_interval(secs => $13), $14::text::jsonb
    WHERE NOT EXISTS (SELECT FROM mine)
    ON CONFLICT (key) DO NOTHING
    RETURNING 1
)
SELECT EXISTS (SELECT FROM mine);

-- name: get
-- The live row under $1, if any.
SELECT idempotency_key, status, request_fingerprint, fingerprint_version, owner_token,
       response_status_code, response_headers::text AS response_headers, response_body,
       response_content_type, created_at,
       coalesce(record_expires_at, expires_at) AS record_expires_at,
       checkpoints::text AS checkpoints,
       CASE WHEN checkpoints IS NULL THEN NULL ELSE locked_until END AS lease_until
FROM {table}
WHERE key = $1 AND expires_at > now();

-- name: purge_batch
-- Delete up to $1 expired rows; returns how many. Rows locked by a concurrent takeover are
-- skipped (and re-checked by FOR UPDATE), so live rows are never touched.
WITH gone AS (
    DELETE FROM {table}
    WHERE key IN (
        SELECT key FROM {table}
        WHERE expires_at <= now()
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*) FROM gone;

-- Operation claims (see OperationClaimingStore): an app claims each operation it guards when it
-- starts, as the code that serves it, and renews the claim while it runs. A claim is taken by
-- "write, then check", two statements, which READ COMMITTED makes safe without locks: each
-- claimer's check starts after its own write committed, so of two claimers of different code
-- at once, the later check sees the other's write. Both may see each other and both refuse
-- (benign: they are started again); never does neither see the other.
-- $1 the operation (with the key prefix), $2 the holder, $3 its code, $4 the claim's lifetime
-- in seconds from now().

-- name: claim_write
-- Claim or renew $2's claim, first dropping the lapsed claims of other holders on the way
-- (this holder's own row is left to the upsert: one statement must not write a row twice).
-- A lapsed claim that a concurrent statement holds is skipped, not waited for: a statement
-- that locks several claims never waits for another's lock (at most the upsert waits for its
-- own row, which purge_claims may hold), so none can deadlock.
WITH lapsed AS (
    DELETE FROM {operations}
    WHERE (operation, holder) IN (
        SELECT operation, holder FROM {operations}
        WHERE operation = $1 AND holder <> $2 AND expires_at <= now()
        FOR UPDATE SKIP LOCKED
    )
)
INSERT INTO {operations} AS c (operation, holder, code, expires_at)
VALUES ($1, $2, $3, now() + make_interval(secs => $4))
ON CONFLICT (operation, holder) DO UPDATE
SET code = EXCLUDED.code, expires_at = EXCLUDED.expires_at;

-- name: claim_check
-- After claim_write: the code of a live claim of another holder naming other code, if any; then
-- $2's own claim is deleted in the same statement, so that it claims nothing. No row: claimed.
WITH other AS (
    SELECT code FROM {operations}
    WHERE operation = $1 AND holder <> $2 AND code <> $3 AND expires_at > now()
    ORDER BY expires_at DESC
    LIMIT 1
), gone AS (
    DELETE FROM {operations}
    WHERE operation = $1 AND holder = $2 AND EXISTS (SELECT FROM other)
)
SELECT code FROM other;

-- name: unclaim
-- End $2's claim on the operation $1 (nothing when it has none).
DELETE FROM {operations} WHERE operation = $1 AND holder = $2;

-- name: purge_claims
-- Delete the lapsed claims of every operation (claim_write drops those of the operation it
-- claims; these are the claims of operations no app serves any more), skipping those that a
-- concurrent statement holds; returns how many.
WITH gone AS (
    DELETE FROM {operations}
    WHERE (operation, holder) IN (
        SELECT operation, holder FROM {operations}
        WHERE expires_at <= now()
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: schema_lock
-- Serialises concurrent create_schema() calls (CREATE ... IF NOT EXISTS alone can race).
SELECT pg_advisory_xact_lock(hashtext('starlette_idempotency.create_schema'));

-- name: default_isolation
-- The isolation a statement runs at unless told otherwise (the store's are written for READ
-- COMMITTED).
SELECT current_setting('default_transaction_isolation');

-- name: table_exists
-- $1 the quoted table name, resolved like the queries resolve it (search_path).
SELECT to_regclass($1) IS NOT NULL;

-- name: check
-- What PostgresStore.check() reports, in one round trip. $1 the quoted table name (resolved
-- as the queries resolve it), $2 the columns the queries use, of which missing_columns lists
-- those the table lacks (all of them when it does not exist). unlogged is NULL then. $3 the
-- quoted name of the table of operation claims, $4 the rights the claims need on it, of which
-- missing_claims_rights lists those the role lacks (NULL when it lacks none, or the table is
-- missing).
SELECT to_regclass($1) IS NOT NULL AS table_exists,
       to_regclass($3) IS NOT NULL AS operations_table_exists,
       (SELECT array_agg(wanted.name ORDER BY wanted.n)
        FROM unnest($4::text[]) WITH ORDINALITY AS wanted (name, n)
        WHERE NOT has_table_privilege(to_regclass($3), wanted.name)) AS missing_claims_rights,
       quote_ident(current_user) AS role,
       (SELECT array_agg(wanted.name ORDER BY wanted.n)
        FROM unnest($2::text[]) WITH ORDINALITY AS wanted (name, n)
        WHERE NOT EXISTS (
            SELECT 1 FROM pg_attribute
            WHERE attrelid = to_regclass($1) AND attname = wanted.name
              AND attnum > 0 AND NOT attisdropped
        )) AS missing_columns,
       (SELECT relpersistence = 'u' FROM pg_class WHERE oid = to_regclass($1)) AS unlogged,
       current_setting('transaction_read_only') = 'on' AS read_only,
       pg_is_in_recovery() AS standby,
       current_setting('synchronous_commit') AS synchronous_commit,
       current_setting('fsync') = 'off' AS fsync_off;
