//! Tenants and API keys.
//!
//! An API key is a bearer token `og_<id>_<secret>`: the id (16 hex digits) is stored in clear to
//! find the key, the secret (32 random bytes) only as its SHA-256 digest. Secrets are random and
//! long, so a fast digest is as strong as a password hash here and keeps authentication cheap
//! on every request; the digest is compared in constant time.

use std::fmt;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::domain::{InvalidInput, TenantId, Timestamp};

/// What an API key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Claims and fenced calls, and reading records, in its tenant.
    Agent,
    /// Everything an agent may, plus API keys and purges in its tenant; an admin of the
    /// operator tenant also manages tenants.
    Admin,
}

impl Role {
    /// The role's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Agent => "agent",
            Self::Admin => "admin",
        }
    }

    /// Parses a role name.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        match s {
            "agent" => Ok(Self::Agent),
            "admin" => Ok(Self::Admin),
            _ => Err(InvalidInput::new("role", "must be 'agent' or 'admin'")),
        }
    }
}

/// A tenant: the isolation boundary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    /// Its id.
    pub id: TenantId,
    /// When it was created.
    pub created_at: Timestamp,
}

/// The id of an API key: 16 lowercase hex digits, not secret.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ApiKeyId(String);

impl ApiKeyId {
    /// Parses an API key id.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        if s.len() == 16 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            Ok(Self(s.to_owned()))
        } else {
            Err(InvalidInput::new("api key id", "must be 16 lowercase hex digits"))
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ApiKeyId {
    type Error = InvalidInput;
    fn try_from(s: String) -> Result<Self, InvalidInput> {
        Self::parse(&s)
    }
}

impl From<ApiKeyId> for String {
    fn from(id: ApiKeyId) -> String {
        id.0
    }
}

impl fmt::Display for ApiKeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a store keeps of an API key: never the secret, only its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKey {
    /// The public part of the token.
    pub id: ApiKeyId,
    /// The tenant it acts for.
    pub tenant: TenantId,
    /// What it may do.
    pub role: Role,
    /// A note for people (`ci`, `payments-agent`).
    pub label: String,
    /// SHA-256 of the secret, hex.
    pub secret_sha256: String,
    /// When it was created.
    pub created_at: Timestamp,
    /// When it was revoked; a revoked key authenticates nothing.
    pub revoked_at: Option<Timestamp>,
}

/// A freshly made API key: the stored part, and the token to hand to its user once.
#[derive(Debug)]
pub struct NewApiKey {
    /// What to store.
    pub key: ApiKey,
    /// `og_<id>_<secret>`: shown once, never stored.
    pub token: String,
}

impl ApiKey {
    /// Makes a new random API key for `tenant`.
    pub fn generate(tenant: TenantId, role: Role, label: &str, now: Timestamp) -> NewApiKey {
        let mut rng = rand::rng();
        let mut id = [0u8; 8];
        let mut secret = [0u8; 32];
        rng.fill_bytes(&mut id);
        rng.fill_bytes(&mut secret);
        let id = ApiKeyId(hex::encode(id));
        let secret = URL_SAFE_NO_PAD.encode(secret);
        let token = format!("og_{id}_{secret}");
        let key = ApiKey {
            id,
            tenant,
            role,
            label: label.to_owned(),
            secret_sha256: digest(&secret),
            created_at: now,
            revoked_at: None,
        };
        NewApiKey { key, token }
    }

    /// Whether `secret` is this key's secret (constant time) and the key is not revoked.
    pub fn verify(&self, secret: &str) -> bool {
        let given = digest(secret);
        let equal: bool = given.as_bytes().ct_eq(self.secret_sha256.as_bytes()).into();
        equal && self.revoked_at.is_none()
    }
}

/// Splits a bearer token into its id and secret, if it has the form `og_<id>_<secret>`.
pub fn parse_token(token: &str) -> Option<(ApiKeyId, &str)> {
    let rest = token.strip_prefix("og_")?;
    let (id, secret) = rest.split_once('_')?;
    let id = ApiKeyId::parse(id).ok()?;
    (!secret.is_empty() && secret.len() <= 128).then_some((id, secret))
}

fn digest(secret: &str) -> String {
    crate::domain::lower_hex(&Sha256::digest(secret.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_token_verifies_and_nothing_else_does() {
        let tenant = TenantId::parse("acme").unwrap();
        let new = ApiKey::generate(tenant, Role::Agent, "test", Timestamp(0));
        let (id, secret) = parse_token(&new.token).unwrap();
        assert_eq!(id, new.key.id);
        assert!(new.key.verify(secret));
        assert!(!new.key.verify("wrong"));
        assert!(!new.token.contains(&new.key.secret_sha256));
        let mut revoked = new.key.clone();
        revoked.revoked_at = Some(Timestamp(1));
        assert!(!revoked.verify(secret));
    }

    #[test]
    fn malformed_tokens_are_refused() {
        for bad in ["", "og_", "og_123_abc", "xx_0123456789abcdef_s", "og_0123456789abcdef_", "og_0123456789ABCDEF_s"] {
            assert!(parse_token(bad).is_none(), "{bad:?}");
        }
    }
}
