//! Column types that mean the same on both backends.
//!
//! PostgreSQL has native `uuid` and `timestamptz`. SQLite stores both as
//! TEXT: ids hyphenated, times as fixed-width RFC 3339 in UTC with
//! microseconds, so that comparing the text compares the instants (sqlx's own
//! SQLite encoding of `DateTime` varies its width and would not sort).

use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgTypeInfo, PgValueRef};
use sqlx::sqlite::{SqliteTypeInfo, SqliteValueRef};
use sqlx::{Database, Decode, Encode, Postgres, Sqlite, Type};
use uuid::Uuid;

/// A UUID column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DbId(pub Uuid);

/// A point in time, always UTC, microsecond precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DbTime(pub DateTime<Utc>);

const SQLITE_TIME_FORMAT: &str = "%Y-%m-%dT%H:%M:%S%.6fZ";

impl DbTime {
    fn to_sqlite_text(self) -> String {
        self.0.format(SQLITE_TIME_FORMAT).to_string()
    }
}

impl From<DateTime<Utc>> for DbTime {
    fn from(t: DateTime<Utc>) -> Self {
        DbTime(t)
    }
}

impl<T: Into<Uuid>> From<T> for DbId {
    fn from(id: T) -> Self {
        DbId(id.into())
    }
}

impl Type<Postgres> for DbId {
    fn type_info() -> PgTypeInfo {
        <Uuid as Type<Postgres>>::type_info()
    }
}
impl<'q> Encode<'q, Postgres> for DbId {
    fn encode_by_ref(
        &self,
        buf: &mut <Postgres as Database>::ArgumentBuffer<'q>,
    ) -> Result<IsNull, BoxDynError> {
        <Uuid as Encode<'q, Postgres>>::encode_by_ref(&self.0, buf)
    }
}
impl<'r> Decode<'r, Postgres> for DbId {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(DbId(<Uuid as Decode<'r, Postgres>>::decode(value)?))
    }
}

impl Type<Sqlite> for DbId {
    fn type_info() -> SqliteTypeInfo {
        <String as Type<Sqlite>>::type_info()
    }
}
impl<'q> Encode<'q, Sqlite> for DbId {
    fn encode_by_ref(
        &self,
        buf: &mut <Sqlite as Database>::ArgumentBuffer<'q>,
    ) -> Result<IsNull, BoxDynError> {
        <String as Encode<'q, Sqlite>>::encode(self.0.hyphenated().to_string(), buf)
    }
}
impl<'r> Decode<'r, Sqlite> for DbId {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        let text = <&str as Decode<'r, Sqlite>>::decode(value)?;
        Ok(DbId(Uuid::parse_str(text)?))
    }
}

impl Type<Postgres> for DbTime {
    fn type_info() -> PgTypeInfo {
        <DateTime<Utc> as Type<Postgres>>::type_info()
    }
}
impl<'q> Encode<'q, Postgres> for DbTime {
    fn encode_by_ref(
        &self,
        buf: &mut <Postgres as Database>::ArgumentBuffer<'q>,
    ) -> Result<IsNull, BoxDynError> {
        <DateTime<Utc> as Encode<'q, Postgres>>::encode_by_ref(&self.0, buf)
    }
}
impl<'r> Decode<'r, Postgres> for DbTime {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        Ok(DbTime(<DateTime<Utc> as Decode<'r, Postgres>>::decode(
            value,
        )?))
    }
}

impl Type<Sqlite> for DbTime {
    fn type_info() -> SqliteTypeInfo {
        <String as Type<Sqlite>>::type_info()
    }
}
impl<'q> Encode<'q, Sqlite> for DbTime {
    fn encode_by_ref(
        &self,
        buf: &mut <Sqlite as Database>::ArgumentBuffer<'q>,
    ) -> Result<IsNull, BoxDynError> {
        <String as Encode<'q, Sqlite>>::encode(self.to_sqlite_text(), buf)
    }
}
impl<'r> Decode<'r, Sqlite> for DbTime {
    fn decode(value: SqliteValueRef<'r>) -> Result<Self, BoxDynError> {
        let text = <&str as Decode<'r, Sqlite>>::decode(value)?;
        let naive = NaiveDateTime::parse_from_str(text, SQLITE_TIME_FORMAT)?;
        Ok(DbTime(naive.and_utc()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn sqlite_time_text_sorts_like_the_instants() {
        let base = Utc
            .with_ymd_and_hms(2026, 11, 30, 10, 0, 5)
            .single()
            .expect("valid");
        let later = base + chrono::Duration::microseconds(500_000);
        let whole = DbTime(base).to_sqlite_text();
        let fraction = DbTime(later).to_sqlite_text();
        assert_eq!(whole, "2026-11-30T10:00:05.000000Z");
        assert!(whole < fraction);
    }
}
