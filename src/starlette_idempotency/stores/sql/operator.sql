-- Read-only queries for operators (`starlette-idempotency list`), loaded like queries.sql;
-- never run by the middleware. "{table}" is replaced by the validated, quoted table name.

-- name: in_progress
-- Live InProgress rows under the store's prefix ($3), oldest first, at most $2; with $1 true,
-- only those whose recovery points' lease has run out on the database clock. Returns the
-- "record columns" of postgres.py, the storage key and lease_expired. Scans the table: for an
-- operator's shell, not for a request.
SELECT key, idempotency_key, status, request_fingerprint, fingerprint_version, owner_token,
       response_status_code, response_headers::text AS response_headers, response_body,
       response_content_type, created_at,
       coalesce(record_expires_at, expires_at) AS record_expires_at,
       checkpoints::text AS checkpoints,
       CASE WHEN checkpoints IS NULL THEN NULL ELSE locked_until END AS lease_until,
       coalesce(checkpoints IS NOT NULL AND locked_until <= now(), false) AS lease_expired
FROM {table}
WHERE status = 'InProgress' AND expires_at > now() AND starts_with(key, $3)
  AND (NOT $1 OR (checkpoints IS NOT NULL AND locked_until <= now()))
ORDER BY created_at
LIMIT $2;
