//! The control documents every instance reads whole and caches: switches and settings
//! ([`ControlDoc`]), and what they say once decoded ([`Controls`]).

use crate::domain::{Namespace, RunId, Scope, TenantId};
use crate::limits::Limits;
use crate::protocol::ClaimRequest;
use crate::record::Denial;
use crate::tripwire::Tripwire;

use super::{Effective, SettingsEntry, Switch, SwitchTarget, effective};

crate::label::vocabulary! {
    /// The kinds of control documents.
    pub enum ControlKind {
        /// An engaged [`Switch`]; its id is [`SwitchTarget::id`].
        Switch => "switch",
        /// A [`SettingsEntry`]; its id is [`SettingsEntry::id`].
        Settings => "settings",
        /// A [`Tripwire`] rule; its id is its name.
        Tripwire => "tripwire",
    }
}

/// The kind of the control documents in which earlier versions kept rollbacks (now kept with
/// their runs, [`crate::store::RunStore::insert_rollback`]). Each store moves them to its runs
/// when it opens, and its listing of control documents passes over any written since by an
/// instance of an earlier version (moved at the next open).
pub const LEGACY_ROLLBACK_KIND: &str = "rollback";

/// A small document every server instance reads whole: a switch or settings. Stores
/// keep it by (kind, tenant, id) and never look inside `body` (JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlDoc {
    /// Its kind.
    pub kind: ControlKind,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its id within the kind and tenant.
    pub id: String,
    /// The JSON of the [`Switch`] or [`SettingsEntry`].
    pub body: String,
}

impl ControlDoc {
    /// Whether `other` is kept in the same place (kind, tenant and id), whatever its body.
    pub fn same_place(&self, other: &ControlDoc) -> bool {
        (self.kind, &self.tenant, &self.id) == (other.kind, &other.tenant, &other.id)
    }

    /// The document of an engaged switch.
    pub fn of_switch(switch: &Switch) -> Self {
        Self {
            kind: ControlKind::Switch,
            tenant: switch.tenant.clone(),
            id: switch.target.id(),
            body: serde_json::to_string(switch).unwrap_or_default(),
        }
    }

    /// The document of a tripwire rule.
    pub fn of_tripwire(rule: &Tripwire) -> Self {
        Self {
            kind: ControlKind::Tripwire,
            tenant: rule.tenant.clone(),
            id: rule.name.clone(),
            body: serde_json::to_string(rule).unwrap_or_default(),
        }
    }

    /// The document of settings.
    pub fn of_settings(entry: &SettingsEntry) -> Self {
        Self {
            kind: ControlKind::Settings,
            tenant: entry.tenant.clone(),
            id: entry.id(),
            body: serde_json::to_string(entry).unwrap_or_default(),
        }
    }
}

/// Every switch, settings entry and tripwire rule, as read from the store at one time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Controls {
    /// Engaged switches.
    pub switches: Vec<Switch>,
    /// Settings entries.
    pub settings: Vec<SettingsEntry>,
    /// Tripwire rules.
    pub tripwires: Vec<Tripwire>,
}

impl Controls {
    /// Decodes documents; a document that does not decode is an error (stores never hold one).
    pub fn decode(docs: &[ControlDoc]) -> Result<Self, String> {
        let mut out = Self::default();
        for doc in docs {
            let bad = |e: serde_json::Error| format!("{} {}/{}: {e}", doc.kind.as_str(), doc.tenant, doc.id);
            match doc.kind {
                ControlKind::Switch => out.switches.push(serde_json::from_str(&doc.body).map_err(bad)?),
                ControlKind::Settings => out.settings.push(serde_json::from_str(&doc.body).map_err(bad)?),
                ControlKind::Tripwire => out.tripwires.push(serde_json::from_str(&doc.body).map_err(bad)?),
            }
        }
        Ok(out)
    }

    /// The first engaged switch covering a key in `namespace` of `tenant` claimed for `run`.
    pub fn switch_for(&self, tenant: &TenantId, namespace: &Namespace, run: Option<&RunId>) -> Option<&Switch> {
        self.switches.iter().find(|s| &s.tenant == tenant && s.target.covers(namespace, run))
    }

    /// Applies the switches to a claim about to be tried: the refusal of a switch covering its
    /// key (tenant, namespace prefix) or the run it names, if any; otherwise the claim carries
    /// the tenant's switched-off runs into the store's atomic claim
    /// ([`ClaimRequest::refused_runs`]), which refuses taking over a record of one of them.
    pub fn apply_switches(&self, req: &mut ClaimRequest) -> Option<Denial> {
        let scope = &req.scope;
        if let Some(switch) = self.switch_for(&scope.tenant, &scope.namespace, req.run.as_ref()) {
            return Some(switch.denial());
        }
        req.refused_runs = self.refused_runs(&scope.tenant);
        None
    }

    /// The tenant's runs under an engaged switch, each with its refusal (for
    /// [`ClaimRequest::refused_runs`]); empty (no allocation) when there are none.
    pub fn refused_runs(&self, tenant: &TenantId) -> Vec<(RunId, Denial)> {
        self.switches
            .iter()
            .filter(|s| &s.tenant == tenant)
            .filter_map(|s| match &s.target {
                SwitchTarget::Run { run } => Some((run.clone(), s.denial())),
                _ => None,
            })
            .collect()
    }

    /// The settings in force for a key of `scope`; under a canary, its mode is the key's side
    /// ([`super::canary_mode`]).
    pub fn effective(&self, limits: &Limits, scope: &Scope) -> Effective {
        let mut out = effective(limits, self.settings.iter().filter(|e| e.tenant == scope.tenant), &scope.namespace);
        if let Some(percent) = out.enforce_percent {
            out.mode = super::canary_mode(scope, percent);
        }
        out
    }
}
