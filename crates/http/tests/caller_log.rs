//! The warning logged when a caller is let go, in a test binary of its own: the only code here
//! that reaches that log line is this test's, so no other thread settles whether it is wanted
//! before this test's subscriber is in place.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use onceguard_core::{Key, Namespace, Scope, TenantId};
use onceguard_http::caller::{Gone, caller_queue};

#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The warning names the key whose answer the caller was let go from.
#[tokio::test(start_paused = true)]
async fn letting_a_caller_go_names_its_key() {
    let logs = Logs::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let scope =
        Scope::new(TenantId::parse("t1").unwrap(), Namespace::parse("proxy/abc").unwrap(), Key::parse("k-7").unwrap());
    let (queue, _body) = caller_queue(Duration::ZERO);
    let mut queue = queue.for_key(&scope);
    // A caller that takes nothing: the queue fills, then, with no patience, the caller is let go.
    let mut gone = None;
    for _ in 0..64 {
        if let Err(why) = queue.send(Ok(Bytes::from_static(b"x"))).await {
            gone = Some(why);
            break;
        }
    }
    assert_eq!(gone, Some(Gone::LetGo));
    let logged = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(logged.contains("let go") && logged.contains(&scope.to_string()), "{logged}");
}
