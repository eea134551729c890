//! Which calls are guarded: the configuration per tool, and the `readOnlyHint` annotations the
//! gateway learns by reading the upstream's `tools/list` answers as they pass through.

use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;

use onceguard_http::config::{McpGuard, McpNoKey, McpToolConfig};
use serde_json::Value;

/// Most tools whose annotations are remembered (a listing beyond it is not learned from).
pub const MAX_KNOWN_TOOLS: usize = 10_000;

/// How a call of one tool is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Guarded: claimed, stored, replayed.
    Guarded,
    /// Passed through: the upstream annotates the tool `readOnlyHint: true`.
    ReadOnly,
    /// Passed through: configured `guard = "never"`.
    Unguarded,
}

/// The per-tool configuration and the annotations learned so far.
#[derive(Debug)]
pub struct ToolPolicy {
    tools: BTreeMap<String, McpToolConfig>,
    default_no_key: McpNoKey,
    read_only: RwLock<HashMap<String, bool>>,
}

impl ToolPolicy {
    /// A policy from the `[mcp]` section's `tools` and `no_key`.
    pub fn new(tools: BTreeMap<String, McpToolConfig>, default_no_key: McpNoKey) -> Self {
        Self { tools, default_no_key, read_only: RwLock::new(HashMap::new()) }
    }

    /// How calls of `tool` are treated: its configured `guard`, else (`auto`) guarded unless the
    /// upstream listed it with `readOnlyHint: true`. A tool not seen in a listing yet is guarded.
    pub fn treatment(&self, tool: &str) -> Treatment {
        match self.tools.get(tool).map(|t| t.guard).unwrap_or_default() {
            McpGuard::Always => Treatment::Guarded,
            McpGuard::Never => Treatment::Unguarded,
            McpGuard::Auto if self.is_read_only(tool) => Treatment::ReadOnly,
            McpGuard::Auto => Treatment::Guarded,
        }
    }

    /// What a guarded call of `tool` without a key does.
    pub fn no_key(&self, tool: &str) -> McpNoKey {
        self.tools.get(tool).and_then(|t| t.no_key).unwrap_or(self.default_no_key)
    }

    fn is_read_only(&self, tool: &str) -> bool {
        self.read_only.read().map(|known| known.get(tool).copied().unwrap_or(false)).unwrap_or(false)
    }

    /// Whether a call of `tool` without a key should wait for the upstream's listing: its
    /// treatment depends on annotations (`guard = "auto"`) not seen yet, and its `no_key` policy
    /// would not simply pass it.
    pub fn needs_listing(&self, tool: &str) -> bool {
        let auto = self.tools.get(tool).map(|t| t.guard).unwrap_or_default() == McpGuard::Auto;
        auto && self.no_key(tool) != McpNoKey::Pass && !self.knows(tool)
    }

    /// Whether `tool`'s annotations are known.
    pub fn knows(&self, tool: &str) -> bool {
        self.read_only.read().map(|known| known.contains_key(tool)).unwrap_or(false)
    }

    /// Learns from a `tools/list` result: each listed tool's `annotations.readOnlyHint`
    /// (absent: `false`). Answers how many tools it read.
    pub fn learn(&self, result: &Value) -> usize {
        let Some(tools) = result.get("tools").and_then(Value::as_array) else { return 0 };
        let Ok(mut known) = self.read_only.write() else { return 0 };
        let mut learned = 0;
        for tool in tools {
            let Some(name) = tool.get("name").and_then(Value::as_str) else { continue };
            if known.len() >= MAX_KNOWN_TOOLS && !known.contains_key(name) {
                tracing::warn!(max = MAX_KNOWN_TOOLS, "too many tools to remember their annotations");
                break;
            }
            let read_only = tool.pointer("/annotations/readOnlyHint").and_then(Value::as_bool).unwrap_or(false);
            known.insert(name.to_owned(), read_only);
            learned += 1;
        }
        learned
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn annotations_and_configuration_decide() {
        let mut tools = BTreeMap::new();
        tools.insert("lookup".to_owned(), McpToolConfig { guard: McpGuard::Always, no_key: None });
        tools.insert("log".to_owned(), McpToolConfig { guard: McpGuard::Never, no_key: None });
        tools.insert("send".to_owned(), McpToolConfig { guard: McpGuard::Auto, no_key: Some(McpNoKey::Derive) });
        let policy = ToolPolicy::new(tools, McpNoKey::Require);
        assert_eq!(policy.treatment("count"), Treatment::Guarded, "unknown tools are guarded");
        let listing = json!({"tools":[
            {"name":"count","annotations":{"readOnlyHint":true}},
            {"name":"lookup","annotations":{"readOnlyHint":true}},
            {"name":"send","annotations":{"readOnlyHint":false,"destructiveHint":true}},
            {"name":"plain"},
            {"nameless":true}
        ]});
        assert_eq!(policy.learn(&listing), 4);
        assert!(policy.knows("plain") && !policy.knows("other"));
        assert!(policy.needs_listing("other") && !policy.needs_listing("plain") && !policy.needs_listing("lookup"));
        assert_eq!(policy.treatment("count"), Treatment::ReadOnly);
        assert_eq!(policy.treatment("lookup"), Treatment::Guarded, "configuration wins over annotations");
        assert_eq!(policy.treatment("log"), Treatment::Unguarded);
        assert_eq!(policy.treatment("send"), Treatment::Guarded);
        assert_eq!(policy.treatment("plain"), Treatment::Guarded);
        assert_eq!(policy.no_key("send"), McpNoKey::Derive);
        assert_eq!(policy.no_key("plain"), McpNoKey::Require);
        // A later listing changes what was learned.
        policy.learn(&json!({"tools":[{"name":"count","annotations":{"readOnlyHint":false}}]}));
        assert_eq!(policy.treatment("count"), Treatment::Guarded);
        assert_eq!(policy.learn(&json!({"nextCursor":"x"})), 0);
    }
}
