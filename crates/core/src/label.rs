//! The one way a set of names is declared ([`vocabulary!`]): the answers' and reasons' label
//! vocabularies in [`crate::vocabulary`], and the states and kinds of settings, approvals,
//! rollbacks and control documents beside their types.

/// Declares a label vocabulary: an enum, its names (in the API, the stored documents, metrics
/// labels and the dashboard), `ALL` in declaration order (the order the dashboard shows them in),
/// `parse`, and serde by name. A name is written once, beside its variant.
macro_rules! vocabulary {
    ($(#[$meta:meta])* pub enum $name:ident { $($(#[$vmeta:meta])* $variant:ident => $label:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: [Self; [$($label),+].len()] = [$(Self::$variant),+];

            /// The name used in the API, metrics labels and the dashboard.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $label,)+
                }
            }

            /// The position in [`Self::ALL`].
            pub const fn index(self) -> usize {
                self as usize
            }

            /// The value of a name, if it is one.
            pub fn parse(s: &str) -> Option<Self> {
                Self::ALL.into_iter().find(|v| v.as_str() == s)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let name = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                Self::parse(&name).ok_or_else(|| {
                    let names: Vec<&str> = Self::ALL.iter().map(|v| v.as_str()).collect();
                    serde::de::Error::custom(format!("unknown {} `{name}`: one of {}", stringify!($name), names.join(", ")))
                })
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

pub(crate) use vocabulary;
