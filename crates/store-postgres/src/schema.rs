//! The schema: its migrations, applied once each, one instance at a time.

use super::*;

/// The migrations, in order; each runs once, recorded in `og_migrations`.
pub(crate) const MIGRATIONS: &[&str] = &[
    r#"
    CREATE SEQUENCE og_fence;
    CREATE TABLE og_records (
        tenant text NOT NULL,
        namespace text COLLATE "C" NOT NULL,
        key text COLLATE "C" NOT NULL,
        state text NOT NULL,
        run text,
        lease_expires_at bigint,
        expires_at bigint NOT NULL,
        doc text NOT NULL,
        body bytea,
        PRIMARY KEY (tenant, namespace, key)
    );
    CREATE INDEX og_records_expiry ON og_records (expires_at);
    CREATE INDEX og_records_state ON og_records (tenant, state, lease_expires_at);
    CREATE TABLE og_tenants (id text PRIMARY KEY, created_at bigint NOT NULL);
    CREATE TABLE og_api_keys (
        id text PRIMARY KEY,
        tenant text NOT NULL,
        role text NOT NULL,
        label text NOT NULL,
        secret_sha256 text NOT NULL,
        created_at bigint NOT NULL,
        revoked_at bigint
    );
    CREATE INDEX og_api_keys_tenant ON og_api_keys (tenant, created_at);
    CREATE FUNCTION og_lock_get(h bigint, t text, n text, k text) RETURNS TABLE (doc text, body bytea)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(h);
        RETURN QUERY SELECT r.doc, r.body FROM og_records r WHERE r.tenant = t AND r.namespace = n AND r.key = k;
    END $$;
"#,
    r#"
    CREATE TABLE og_runs (
        tenant text NOT NULL,
        run text NOT NULL,
        budget text NOT NULL,
        effects bigint NOT NULL,
        cost bigint NOT NULL,
        created_at bigint NOT NULL,
        updated_at bigint NOT NULL,
        PRIMARY KEY (tenant, run)
    );
    CREATE TABLE og_control (
        kind text NOT NULL,
        tenant text NOT NULL,
        id text NOT NULL,
        body text NOT NULL,
        PRIMARY KEY (kind, tenant, id)
    );
    CREATE TABLE og_rates (tenant text PRIMARY KEY, tat_us bigint NOT NULL);
    CREATE TABLE og_audit (
        tenant text NOT NULL,
        id text COLLATE "C" NOT NULL,
        at bigint NOT NULL,
        actor text NOT NULL,
        action text NOT NULL,
        doc text NOT NULL,
        PRIMARY KEY (tenant, id)
    );
    CREATE INDEX og_audit_action ON og_audit (tenant, action, id);
    CREATE INDEX og_audit_actor ON og_audit (tenant, actor, id);
    -- Takes the tenant's quota lock (class 1), then reads the leases that have not passed at
    -- `since` (on og_records_state); the caller counts those live at each claim's time.
    CREATE FUNCTION og_lock_leases(h integer, t text, since bigint)
    RETURNS TABLE (lease_namespace text, lease_key text, lease_until bigint, live_until bigint)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(1, h);
        RETURN QUERY SELECT r.namespace::text, r.key::text, r.lease_expires_at, r.expires_at FROM og_records r
            WHERE r.tenant = t AND r.state = 'in_progress' AND r.lease_expires_at > since AND r.expires_at > since
              AND (r.doc::json ->> 'unknown') IS NULL;
    END $$;
    -- Takes a run's lock (class 2), then reads the run.
    CREATE FUNCTION og_lock_run(h integer, t text, r text)
    RETURNS TABLE (run_budget text, run_effects bigint, run_cost bigint, run_created_at bigint, run_updated_at bigint)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(2, h);
        RETURN QUERY SELECT u.budget, u.effects, u.cost, u.created_at, u.updated_at FROM og_runs u
            WHERE u.tenant = t AND u.run = r;
    END $$;
"#,
    // Fences per tenant: each tenant draws from a sequence of its own (og_fence_of), made by
    // og_ensure_fence before its first claim, starting above og_fence_floor, the one sequence of
    // earlier versions renamed: no longer drawn from, and an earlier version's instance (during
    // a rolling upgrade) fails to draw from og_fence instead of handing out a fence below one a
    // tenant's sequence gave. A key's fences keep growing across the upgrade, and one tenant's
    // fences tell nothing of another's claims.
    r#"
    ALTER SEQUENCE og_fence RENAME TO og_fence_floor;
    CREATE FUNCTION og_fence_name(t text) RETURNS text LANGUAGE sql IMMUTABLE
        AS $$ SELECT 'og_fence_' || substr(md5(t), 1, 16) $$;
    CREATE FUNCTION og_fence_of(t text) RETURNS regclass LANGUAGE sql STABLE
        AS $$ SELECT og_fence_name(t)::regclass $$;
    CREATE FUNCTION og_ensure_fence(t text) RETURNS void LANGUAGE plpgsql AS $$
    DECLARE
        floor bigint;
    BEGIN
        IF to_regclass(og_fence_name(t)) IS NOT NULL THEN
            RETURN;
        END IF;
        SELECT CASE WHEN is_called THEN last_value ELSE 0 END INTO floor FROM og_fence_floor;
        BEGIN
            EXECUTE format('CREATE SEQUENCE %I START WITH %s', og_fence_name(t), floor + 1);
        EXCEPTION WHEN duplicate_table OR unique_violation THEN
            NULL; -- another instance made it meanwhile
        END;
    END $$;
"#, // Approvals: one kept per key; `kept_until` is `Approval::kept_until`.
    r#"
    CREATE TABLE og_approvals (
        tenant text NOT NULL,
        namespace text NOT NULL,
        key text NOT NULL,
        id text NOT NULL,
        kept_until bigint NOT NULL,
        doc text NOT NULL,
        PRIMARY KEY (tenant, namespace, key)
    );
    CREATE UNIQUE INDEX og_approvals_id ON og_approvals (tenant, id);
    CREATE INDEX og_approvals_kept ON og_approvals (kept_until);
"#, // The store's time, by which every instance decides: the statement's start in milliseconds,
    // or the time given in its place (tests). Inlined by the planner.
    r#"
    CREATE FUNCTION og_now(given bigint) RETURNS bigint LANGUAGE sql STABLE AS $$
        SELECT coalesce(given, (extract(epoch FROM statement_timestamp()) * 1000)::bigint)
    $$;
"#,
    // A run's records, in listing order: what a rollback reads of its run and of its undo run,
    // without reading the rest of the tenant.
    r#"
    CREATE INDEX og_records_run ON og_records (tenant, run, namespace, key) WHERE run IS NOT NULL;
"#,
    // Rollbacks are kept with their runs, no longer as control documents (moved by
    // MOVE_LEGACY_ROLLBACKS).
    r#"
    CREATE TABLE og_rollbacks (
        tenant text NOT NULL,
        run text COLLATE "C" NOT NULL,
        body text NOT NULL,
        PRIMARY KEY (tenant, run)
    );
"#,
    // The lease index holds the records in progress only: a completed or released record (most
    // of them) no longer keeps an entry, and its completion no longer rewrites one. Every query
    // that read og_records_state names state = 'in_progress'. The new index is built in this
    // migration's transaction (writes to og_records wait for it, as for og_records_run).
    r#"
    DROP INDEX og_records_state;
    CREATE INDEX og_records_leases ON og_records (tenant, lease_expires_at) WHERE state = 'in_progress';
"#,
    // Records keep their document packed (`Record::pack`: about 80 bytes instead of about 500 of
    // JSON); the JSON documents of earlier versions still read (`Record::unpack`). A record whose
    // holder reported its outcome unknown holds no lease: its `lease_expires_at` column is NULL
    // (its document keeps the time), so that og_lock_leases no longer reads the document. A claim
    // drawing its fence while it writes puts `og_varint(fence)` in place of the placeholder's
    // bytes. The table is rewritten in this migration's transaction (writes wait for it).
    r#"
    UPDATE og_records SET lease_expires_at = NULL WHERE state = 'in_progress' AND (doc::json ->> 'unknown') IS NOT NULL;
    ALTER TABLE og_records ALTER COLUMN doc TYPE bytea USING convert_to(doc, 'UTF8');
    DROP FUNCTION og_lock_get(bigint, text, text, text);
    CREATE OR REPLACE FUNCTION og_lock_leases(h integer, t text, since bigint)
    RETURNS TABLE (lease_namespace text, lease_key text, lease_until bigint, live_until bigint)
    LANGUAGE plpgsql AS $$
    BEGIN
        PERFORM pg_advisory_xact_lock(1, h);
        RETURN QUERY SELECT r.namespace::text, r.key::text, r.lease_expires_at, r.expires_at FROM og_records r
            WHERE r.tenant = t AND r.state = 'in_progress' AND r.lease_expires_at > since AND r.expires_at > since;
    END $$;
    CREATE FUNCTION og_varint(v bigint) RETURNS bytea LANGUAGE plpgsql IMMUTABLE STRICT AS $$
    DECLARE
        spelt bytea := '\x'::bytea;
    BEGIN
        WHILE v >= 128 LOOP
            spelt := spelt || set_byte('\x00'::bytea, 0, ((v & 127) | 128)::integer);
            v := v >> 7;
        END LOOP;
        RETURN spelt || set_byte('\x00'::bytea, 0, v::integer);
    END $$;
"#,
    // Tripwire counts: per rule, subject and minute (`ControlStore::count_symptoms`).
    r#"
    CREATE TABLE og_symptoms (
        tenant text NOT NULL,
        rule text NOT NULL,
        subject text NOT NULL,
        minute bigint NOT NULL,
        calls bigint NOT NULL,
        bad bigint NOT NULL,
        PRIMARY KEY (tenant, rule, subject, minute)
    );
    CREATE INDEX og_symptoms_minute ON og_symptoms (minute);
"#,
];

/// Moves the rollbacks kept as control documents (by earlier versions) to og_rollbacks: run at
/// every start, after the migrations, so that one written by an instance of an earlier version
/// meanwhile is moved too.
const MOVE_LEGACY_ROLLBACKS: &str = r#"
    WITH moved AS (DELETE FROM og_control WHERE kind = 'rollback' RETURNING tenant, id, body)
    INSERT INTO og_rollbacks (tenant, run, body) SELECT tenant, id, body FROM moved
    ON CONFLICT (tenant, run) DO NOTHING;
"#;

/// Serializes migrations of all instances (a session advisory lock key).
pub(crate) const MIGRATION_LOCK: i64 = 0x6f6e_6365_6775_6172; // "onceguar"

/// Creates the schema and applies pending migrations, one instance at a time.
pub(crate) async fn migrate(
    config: &tokio_postgres::Config,
    tls: &crate::tls::Tls,
    schema: &str,
) -> Result<(), StoreError> {
    let (mut client, driver) = crate::tls::with_tls!(tls, |connector| {
        let (client, connection) = config.connect(connector).await.map_err(unavailable)?;
        (client, tokio::spawn(async move { connection.await.map(drop) }))
    });
    let result = async {
        client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK]).await.map_err(unavailable)?;
        let applied = async {
            client.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}")).await.map_err(unavailable)?;
            client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {schema}.og_migrations (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
                ))
                .await
                .map_err(unavailable)?;
            let done: i32 = client
                .query_one(&format!("SELECT coalesce(max(version), 0) FROM {schema}.og_migrations"), &[])
                .await
                .map_err(unavailable)?
                .get(0);
            let done = usize::try_from(done).map_err(corrupt)?;
            if done > MIGRATIONS.len() {
                return Err(corrupt(format!("schema {schema} is at version {done}, newer than this onceguard knows")));
            }
            for (i, sql) in MIGRATIONS.iter().enumerate().skip(done) {
                let tx = client.transaction().await.map_err(unavailable)?;
                tx.batch_execute(&format!("SET LOCAL search_path = {schema}")).await.map_err(unavailable)?;
                tx.batch_execute(sql).await.map_err(unavailable)?;
                let version = i32::try_from(i + 1).map_err(corrupt)?;
                tx.execute("INSERT INTO og_migrations (version) VALUES ($1)", &[&version]).await.map_err(unavailable)?;
                tx.commit().await.map_err(unavailable)?;
                tracing::info!(schema, version, "applied a migration");
            }
            let tx = client.transaction().await.map_err(unavailable)?;
            tx.batch_execute(&format!("SET LOCAL search_path = {schema}")).await.map_err(unavailable)?;
            tx.batch_execute(MOVE_LEGACY_ROLLBACKS).await.map_err(unavailable)?;
            tx.commit().await.map_err(unavailable)?;
            Ok(())
        }
        .await;
        let _ = client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK]).await;
        applied
    }
    .await;
    drop(client);
    let _ = driver.await;
    result
}
