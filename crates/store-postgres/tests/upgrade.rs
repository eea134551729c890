//! Data an earlier version wrote, read by this one: rollbacks that were control documents are
//! kept with their runs once an instance of this version starts, including one written by an
//! instance of an earlier version after the upgrade.

mod common;

use onceguard_core::control::AuditEntry;
use onceguard_core::rollback::Rollback;
use onceguard_core::store::{ControlStore, RunStore};
use onceguard_core::{RunId, TenantId, Timestamp};
use onceguard_store_postgres::{PgOptions, PgStore};

async fn connect(schema: &str) -> PgStore {
    let options = PgOptions { schema: schema.to_owned(), pool_size: 2, writers: 1, ..PgOptions::default() };
    PgStore::connect_with(&common::url(), options).await.expect("the store connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollbacks_kept_as_control_documents_move_to_their_runs() {
    if !common::available("PostgreSQL upgrade tests") {
        return;
    }
    let schema = common::schema("og_upgrade");
    let store = connect(&schema).await;
    let tenant = TenantId::parse("acme").unwrap();
    let rollback = |run: &str| Rollback {
        tenant: tenant.clone(),
        run: RunId::parse(run).unwrap(),
        why: format!("why {run}"),
        started_by: "cli:ops".into(),
        started_at: Timestamp(5),
    };
    // As an earlier version kept them: control documents of kind `rollback`, id the run.
    let (client, connection) = tokio_postgres::connect(&common::url(), tokio_postgres::NoTls).await.unwrap();
    let driver = tokio::spawn(connection);
    let legacy = |run: &str| {
        format!(
            "INSERT INTO {schema}.og_control (kind, tenant, id, body) VALUES ('rollback', 'acme', '{run}', '{}')",
            serde_json::to_string(&rollback(run)).unwrap()
        )
    };
    client.batch_execute(&legacy("run-1")).await.unwrap();
    // The listing of control documents passes over them until they are moved.
    assert!(store.list_control().await.unwrap().is_empty());
    // Already started in the new place: the move keeps the one there.
    let entry = AuditEntry::new(tenant.clone(), Timestamp(6), "admin", "run.rollback", "run-2");
    assert!(store.insert_rollback(&rollback("run-2"), &entry).await.unwrap());
    client.batch_execute(&legacy("run-2").replace("why run-2", "an older why")).await.unwrap();
    drop(store);

    let store = connect(&schema).await;
    assert_eq!(store.get_rollback(&tenant, &RunId::parse("run-1").unwrap()).await.unwrap(), Some(rollback("run-1")));
    let listed = store.list_rollbacks(&tenant, None, 10).await.unwrap();
    assert_eq!(listed.items, vec![rollback("run-1"), rollback("run-2")]);
    let left: i64 = client.query_one(&format!("SELECT count(*) FROM {schema}.og_control"), &[]).await.unwrap().get(0);
    assert_eq!(left, 0, "moved, not copied");
    drop(store);
    drop(client);
    let _ = driver.await;
    common::drop_schema(&schema).await;
}
