//! Arbitrary bytes into every decoder of untrusted bytes: the `/v1` request bodies, a stored
//! proxy response and a stored record document (packed, or JSON as earlier versions wrote it).
//! None may panic; a decoded stored response or record re-encodes to a form that decodes to the
//! same.

#![no_main]

use libfuzzer_sys::fuzz_target;
use onceguard_core::{Key, Namespace, Record, Scope, TenantId};
use onceguard_proxy::stored;
use onceguard_server::api::{
    ApiKeyBody, CheckpointBody, ClaimBody, CompleteBody, ExtendBody, FailBody, ReportUnknownBody, TenantBody,
};

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<ClaimBody>(data);
    let _ = serde_json::from_slice::<CompleteBody>(data);
    let _ = serde_json::from_slice::<FailBody>(data);
    let _ = serde_json::from_slice::<ExtendBody>(data);
    let _ = serde_json::from_slice::<CheckpointBody>(data);
    let _ = serde_json::from_slice::<ReportUnknownBody>(data);
    let _ = serde_json::from_slice::<TenantBody>(data);
    let _ = serde_json::from_slice::<ApiKeyBody>(data);

    if let Ok(response) = stored::decode(data) {
        let again = stored::decode(&response.encode()).expect("an encoded response decodes");
        assert_eq!(again, response);
    }

    let scope = Scope::new(
        TenantId::parse("acme").unwrap(),
        Namespace::parse("proxy/0123").unwrap(),
        Key::parse("k").unwrap(),
    );
    if let Ok(record) = Record::unpack(scope.clone(), data, Some(b"body".to_vec())) {
        // A JSON document names its own scope; a packed one takes the one it is read under.
        let (doc, body) = record.clone().pack();
        assert_eq!(Record::unpack(record.scope.clone(), &doc, body).ok(), Some(record));
    }

    if let Ok(doc) = std::str::from_utf8(data) {
        let _ = Record::from_doc(doc, None);
        if let Ok(record) = Record::from_doc(doc, Some(data.to_vec())) {
            let (doc, body) = record.clone().into_doc().expect("a record serializes");
            assert_eq!(Record::from_doc(&doc, body).ok(), Some(record));
        }
    }
});
