//! Domain values stored as text: the one place their spelling is defined.
//!
//! [`string_enum!`] gives an enum its names once (`as_str`, `parse`,
//! `Display`, serde); with the `sqlx` feature, [`sqlx_text!`] makes a type a
//! TEXT column on PostgreSQL and SQLite. Decoding a stored value that is no
//! known name is an error, never a default: a row cobro cannot read is
//! corrupt, and guessing its state would move money on a guess.

macro_rules! string_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
        pub enum $name { $($(#[$vdoc])* #[serde(rename = $text)] $variant),+ }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(&self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }

            pub fn parse(raw: &str) -> Option<Self> {
                match raw { $($text => Some($name::$variant),)+ _ => None }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        $crate::stored::sqlx_text!($name, |raw| $name::parse(raw), |v| v.as_str());
    };
}

/// `$parse`: `|&str| -> Option<Self>`; `$show`: `|&Self| -> &str`.
#[cfg(feature = "sqlx")]
macro_rules! sqlx_text {
    ($name:ty, |$raw:ident| $parse:expr, |$v:ident| $show:expr) => {
        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }
        impl<'q> sqlx::Encode<'q, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                let $v = self;
                <&str as sqlx::Encode<'q, sqlx::Postgres>>::encode_by_ref(&$show, buf)
            }
        }
        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $name {
            fn decode(
                value: sqlx::postgres::PgValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let $raw = <&str as sqlx::Decode<'r, sqlx::Postgres>>::decode(value)?;
                $parse.ok_or_else(|| {
                    format!("{:?} is not a known {}", $raw, stringify!($name)).into()
                })
            }
        }
        impl sqlx::Type<sqlx::Sqlite> for $name {
            fn type_info() -> sqlx::sqlite::SqliteTypeInfo {
                <&str as sqlx::Type<sqlx::Sqlite>>::type_info()
            }
            fn compatible(ty: &sqlx::sqlite::SqliteTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Sqlite>>::compatible(ty)
            }
        }
        impl<'q> sqlx::Encode<'q, sqlx::Sqlite> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut Vec<sqlx::sqlite::SqliteArgumentValue<'q>>,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                let $v = self;
                <String as sqlx::Encode<'q, sqlx::Sqlite>>::encode(($show).to_owned(), buf)
            }
        }
        impl<'r> sqlx::Decode<'r, sqlx::Sqlite> for $name {
            fn decode(
                value: sqlx::sqlite::SqliteValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let $raw = <&str as sqlx::Decode<'r, sqlx::Sqlite>>::decode(value)?;
                $parse.ok_or_else(|| {
                    format!("{:?} is not a known {}", $raw, stringify!($name)).into()
                })
            }
        }
    };
}

#[cfg(not(feature = "sqlx"))]
macro_rules! sqlx_text {
    ($($t:tt)*) => {};
}

/// A UUID newtype (`$name(Uuid)`) as a column: PostgreSQL's `uuid`, and on
/// SQLite hyphenated TEXT (as the store's `DbId`, so that rows read and
/// bound either way agree).
#[cfg(feature = "sqlx")]
macro_rules! sqlx_uuid {
    ($name:ident) => {
        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <uuid::Uuid as sqlx::Type<sqlx::Postgres>>::type_info()
            }
        }
        impl<'q> sqlx::Encode<'q, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <uuid::Uuid as sqlx::Encode<'q, sqlx::Postgres>>::encode_by_ref(&self.0, buf)
            }
        }
        impl<'r> sqlx::Decode<'r, sqlx::Postgres> for $name {
            fn decode(
                value: sqlx::postgres::PgValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                Ok($name(
                    <uuid::Uuid as sqlx::Decode<'r, sqlx::Postgres>>::decode(value)?,
                ))
            }
        }
        impl sqlx::Type<sqlx::Sqlite> for $name {
            fn type_info() -> sqlx::sqlite::SqliteTypeInfo {
                <String as sqlx::Type<sqlx::Sqlite>>::type_info()
            }
        }
        impl<'q> sqlx::Encode<'q, sqlx::Sqlite> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut Vec<sqlx::sqlite::SqliteArgumentValue<'q>>,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <String as sqlx::Encode<'q, sqlx::Sqlite>>::encode(
                    self.0.hyphenated().to_string(),
                    buf,
                )
            }
        }
        impl<'r> sqlx::Decode<'r, sqlx::Sqlite> for $name {
            fn decode(
                value: sqlx::sqlite::SqliteValueRef<'r>,
            ) -> Result<Self, sqlx::error::BoxDynError> {
                let text = <&str as sqlx::Decode<'r, sqlx::Sqlite>>::decode(value)?;
                Ok($name(uuid::Uuid::parse_str(text)?))
            }
        }
    };
}

#[cfg(not(feature = "sqlx"))]
macro_rules! sqlx_uuid {
    ($($t:tt)*) => {};
}

pub(crate) use {sqlx_text, sqlx_uuid, string_enum};
