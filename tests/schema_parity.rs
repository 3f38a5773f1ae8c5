//! The two schemas stay in step: after migrating a fresh PostgreSQL and a
//! fresh SQLite database, their tables, columns (name, nullability, type
//! family), primary keys, unique constraints, foreign keys, CHECK counts,
//! indexes (name, columns, uniqueness, partial predicate), views and
//! triggers are compared, and every difference is named. Where the two
//! legitimately differ, the exception is listed below with its reason.

use cobro_core::{PaymentStatus, RefundStatus};
use cobro_test_support::{Backend, TestDb};
use sqlx::Connection;
use std::collections::BTreeSet;

/// Migration 0013: PostgreSQL's queue indexes carry an always-true term.
const QUEUE_INDEX_ON_POSTGRES: &str = "PostgreSQL's queue index carries an always-true term \
     that look-ups by key never state, so no cached plan scans the queue for them \
     (migration 0013)";
const UNSETTLED_INDEX_ON_POSTGRES: &str = "PostgreSQL's index of the unsettled carries an \
     always-true term that look-ups by key never state, so no plan reads every unsettled row \
     for them (migration 0014)";
const UNSETTLED_INDEX_ON_SQLITE: &str = "SQLite's keeps the predicate without that term: its \
     look-ups use the key anyway (sqlite 0014, as 0013)";
const QUEUE_INDEX_ON_SQLITE: &str = "SQLite's keeps the predicate without that term: its \
     look-ups use the key anyway, and with the term it left the index for the metrics' \
     depth (sqlite 0013)";

/// Differences that are meant, each with why. An entry is the exact line
/// the comparison prints for the difference.
const EXCEPTIONS: &[(&str, &str)] = &[
    (
        "unique constraint: only on SQLite: events (written)",
        "PostgreSQL numbers events.written from a BIGSERIAL sequence; SQLite's \
         trigger takes MAX(written) + 1 under its one writer, and the UNIQUE \
         makes a duplicate fail instead of reordering the feed",
    ),
    (
        "index: only on PostgreSQL: attempts_one_unresolved_per_intent on attempts (account_id, intent_id) unique where state in 'pending','unknown','reconciling','held','awaiting_customer' and intent_id is not null",
        QUEUE_INDEX_ON_POSTGRES,
    ),
    (
        "index: only on PostgreSQL: attempts_uncertain on attempts (state, last_send_at) where state in 'pending','unknown','reconciling' and created_at is not null",
        QUEUE_INDEX_ON_POSTGRES,
    ),
    (
        "index: only on PostgreSQL: event_deliveries_due on event_deliveries (due_at) where state = 'pending' and due_at is not null",
        QUEUE_INDEX_ON_POSTGRES,
    ),
    (
        "index: only on PostgreSQL: outbox_due on outbox (due_at) where state = 'pending' and due_at is not null",
        QUEUE_INDEX_ON_POSTGRES,
    ),
    (
        "index: only on SQLite: attempts_one_unresolved_per_intent on attempts (account_id, intent_id) unique where state in 'pending','unknown','reconciling','held','awaiting_customer'",
        QUEUE_INDEX_ON_SQLITE,
    ),
    (
        "index: only on SQLite: attempts_uncertain on attempts (state, last_send_at) where state in 'pending','unknown','reconciling'",
        QUEUE_INDEX_ON_SQLITE,
    ),
    (
        "index: only on SQLite: event_deliveries_due on event_deliveries (due_at) where state = 'pending'",
        QUEUE_INDEX_ON_SQLITE,
    ),
    (
        "index: only on SQLite: outbox_due on outbox (due_at) where state = 'pending'",
        QUEUE_INDEX_ON_SQLITE,
    ),
    (
        "index: only on PostgreSQL: evidence_conflicts_open on evidence_conflicts (found_at) where resolved_at is null and found_at is not null",
        UNSETTLED_INDEX_ON_POSTGRES,
    ),
    (
        "index: only on PostgreSQL: payments_unsettled on payments (status, status_changed_at) where status in 'processing','requires_action','requires_reconciliation','needs_review','capturing','canceling' and status_changed_at is not null",
        UNSETTLED_INDEX_ON_POSTGRES,
    ),
    (
        "index: only on PostgreSQL: refunds_unsettled on refunds (status, status_changed_at) where status in 'processing','requires_reconciliation','needs_review' and status_changed_at is not null",
        UNSETTLED_INDEX_ON_POSTGRES,
    ),
    (
        "index: only on SQLite: evidence_conflicts_open on evidence_conflicts (found_at) where resolved_at is null",
        UNSETTLED_INDEX_ON_SQLITE,
    ),
    (
        "index: only on SQLite: payments_unsettled on payments (status, status_changed_at) where status in 'processing','requires_action','requires_reconciliation','needs_review','capturing','canceling'",
        UNSETTLED_INDEX_ON_SQLITE,
    ),
    (
        "index: only on SQLite: refunds_unsettled on refunds (status, status_changed_at) where status in 'processing','requires_reconciliation','needs_review'",
        UNSETTLED_INDEX_ON_SQLITE,
    ),
    (
        "view: only on SQLite: cobro_random_uuid",
        "SQLite has no gen_random_uuid(): 0006's triggers build event ids \
         from this view over randomblob",
    ),
];

/// Triggers are compared by the table they fire on. SQLite has no trigger
/// functions and no statement triggers, so one PostgreSQL trigger can be
/// several SQLite ones (one per event): the names differ by design.
/// PostgreSQL-only objects that are not compared at all: the trigger
/// functions (SQLite repeats the body in each trigger) and sequences (none
/// are used; ids are UUIDs).
#[derive(Debug, Default)]
struct Schema {
    /// `table.column type nullable`
    columns: BTreeSet<String>,
    /// `table (columns)`
    primary_keys: BTreeSet<String>,
    /// `table (columns)`: unique constraints, named by their columns (the
    /// backends name them differently: `x_key` vs `sqlite_autoindex_x_1`).
    unique_constraints: BTreeSet<String>,
    /// `table (column) -> table (column) on delete ACTION`
    foreign_keys: BTreeSet<String>,
    /// `table: n CHECK constraints`
    checks: BTreeSet<String>,
    /// `name on table (columns) [unique] [where predicate]`
    indexes: BTreeSet<String>,
    views: BTreeSet<String>,
    /// `table has triggers`
    triggers: BTreeSet<String>,
}

/// The family a declared type belongs to, by the mapping of
/// migrations/README.md (UUID and TIMESTAMPTZ are TEXT on SQLite; BIGINT
/// and BOOLEAN are INTEGER; BYTEA is BLOB).
fn family(declared: &str) -> String {
    let t = declared.to_ascii_lowercase();
    let f = match t.as_str() {
        "uuid" | "text" | "timestamp with time zone" | "character varying" | "jsonb" | "json" => {
            "text"
        }
        "bigint" | "integer" | "smallint" | "boolean" | "int" => "integer",
        "bytea" | "blob" => "blob",
        "double precision" | "real" => "real",
        other => return format!("?{other}"),
    };
    f.to_owned()
}

/// A partial index's predicate in one spelling: PostgreSQL's deparsed
/// `(status <> ALL (ARRAY['a'::text, 'b'::text]))` and SQLite's
/// `status NOT IN ('a', 'b')` both become `status not in 'a','b'`.
fn predicate(raw: &str) -> String {
    let mut p = raw.to_ascii_lowercase();
    for cast in ["::text[]", "::text", "::bigint", "::integer"] {
        p = p.replace(cast, "");
    }
    p = p
        .replace("<> all (array[", " not in (")
        .replace("= any (array[", " in (")
        .replace("])", ")");
    let p: String = p.chars().filter(|c| !matches!(c, '(' | ')')).collect();
    p.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace(", ", ",")
}

fn index_line(name: &str, table: &str, columns: &str, unique: bool, pred: Option<&str>) -> String {
    let mut line = format!("{name} on {table} ({columns})");
    if unique {
        line.push_str(" unique");
    }
    if let Some(p) = pred {
        line.push_str(&format!(" where {}", predicate(p)));
    }
    line
}

/// kind, table, columns, referenced table, referenced columns, on delete.
type ConstraintRow = (
    String,
    String,
    String,
    Option<String>,
    Option<String>,
    String,
);

/// `table has triggers` for each table that has any.
fn trigger_lines(tables: Vec<(String,)>) -> BTreeSet<String> {
    tables
        .into_iter()
        .map(|(t,)| format!("{t} has triggers"))
        .collect()
}

async fn postgres_schema(url: &str) -> Schema {
    let mut c = sqlx::PgConnection::connect(url).await.expect("connect");
    let mut s = Schema::default();
    let rows: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text \
         FROM information_schema.columns c WHERE table_schema = 'public' \
         AND table_name IN (SELECT table_name FROM information_schema.tables \
             WHERE table_schema = 'public' AND table_type = 'BASE TABLE') \
         AND table_name <> '_sqlx_migrations'",
    )
    .fetch_all(&mut c)
    .await
    .expect("columns");
    for (t, col, ty, nullable) in rows {
        let null = if nullable == "YES" {
            "null"
        } else {
            "not null"
        };
        s.columns
            .insert(format!("{t}.{col} {} {null}", family(&ty)));
    }
    // Constraints with their columns in key order.
    let rows: Vec<ConstraintRow> = sqlx::query_as(
        "SELECT c.contype::text, c.conrelid::regclass::text, \
                (SELECT string_agg(a.attname, ', ' ORDER BY k.i) FROM unnest(c.conkey) \
                    WITH ORDINALITY k(n, i) JOIN pg_attribute a \
                    ON a.attrelid = c.conrelid AND a.attnum = k.n), \
                c.confrelid::regclass::text, \
                (SELECT string_agg(a.attname, ', ' ORDER BY k.i) FROM unnest(c.confkey) \
                    WITH ORDINALITY k(n, i) JOIN pg_attribute a \
                    ON a.attrelid = c.confrelid AND a.attnum = k.n), \
                c.confdeltype::text \
             FROM pg_constraint c WHERE c.connamespace = 'public'::regnamespace \
             AND c.conrelid::regclass::text <> '_sqlx_migrations'",
    )
    .fetch_all(&mut c)
    .await
    .expect("constraints");
    let mut checks = std::collections::BTreeMap::<String, usize>::new();
    for (kind, table, cols, ref_table, ref_cols, on_delete) in rows {
        match kind.as_str() {
            "p" => {
                s.primary_keys.insert(format!("{table} ({cols})"));
            }
            "u" => {
                s.unique_constraints.insert(format!("{table} ({cols})"));
            }
            "f" => {
                let action = match on_delete.as_str() {
                    "c" => "CASCADE",
                    "n" => "SET NULL",
                    "d" => "SET DEFAULT",
                    "r" => "RESTRICT",
                    _ => "NO ACTION",
                };
                s.foreign_keys.insert(format!(
                    "{table} ({cols}) -> {} ({}) on delete {action}",
                    ref_table.unwrap_or_default(),
                    ref_cols.unwrap_or_default()
                ));
            }
            "c" => *checks.entry(table).or_default() += 1,
            _ => {}
        }
    }
    for (table, n) in checks {
        s.checks.insert(format!("{table}: {n} CHECK constraints"));
    }
    // Indexes that no constraint owns (those are compared above).
    let rows: Vec<(String, String, bool, String, Option<String>)> = sqlx::query_as(
        "SELECT i.relname::text, t.relname::text, x.indisunique, \
            (SELECT string_agg(pg_get_indexdef(x.indexrelid, k.i::int, true) || \
                CASE WHEN x.indoption[k.i - 1] & 1 = 1 THEN ' DESC' ELSE '' END, ', ' ORDER BY k.i) \
             FROM generate_series(1, x.indnkeyatts) k(i)), \
            pg_get_expr(x.indpred, x.indrelid, true) \
         FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid \
         JOIN pg_class t ON t.oid = x.indrelid \
         JOIN pg_namespace n ON n.oid = t.relnamespace AND n.nspname = 'public' \
         WHERE NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = x.indexrelid) \
         AND t.relname <> '_sqlx_migrations'",
    )
    .fetch_all(&mut c)
    .await
    .expect("indexes");
    for (name, table, unique, cols, pred) in rows {
        s.indexes
            .insert(index_line(&name, &table, &cols, unique, pred.as_deref()));
    }
    let views: Vec<(String,)> = sqlx::query_as(
        "SELECT table_name::text FROM information_schema.views WHERE table_schema = 'public'",
    )
    .fetch_all(&mut c)
    .await
    .expect("views");
    s.views = views.into_iter().map(|(v,)| v).collect();
    let triggers: Vec<(String,)> = sqlx::query_as(
        "SELECT DISTINCT c.relname::text FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'public' \
         WHERE NOT t.tgisinternal",
    )
    .fetch_all(&mut c)
    .await
    .expect("triggers");
    s.triggers = trigger_lines(triggers);
    s
}

async fn sqlite_schema(url: &str) -> Schema {
    let mut c = sqlx::SqliteConnection::connect(url).await.expect("connect");
    let mut s = Schema::default();
    let tables: Vec<(String, String)> = sqlx::query_as(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' \
         AND name NOT LIKE 'sqlite_%' AND name <> '_sqlx_migrations'",
    )
    .fetch_all(&mut c)
    .await
    .expect("tables");
    for (table, sql) in &tables {
        let cols: Vec<(String, String, i64, i64)> =
            sqlx::query_as("SELECT name, type, \"notnull\", pk FROM pragma_table_info($1)")
                .bind(table)
                .fetch_all(&mut c)
                .await
                .expect("columns");
        let mut pk: Vec<(i64, String)> = Vec::new();
        for (col, ty, notnull, key) in cols {
            // A primary key column is NOT NULL on PostgreSQL by definition;
            // SQLite (for a non-INTEGER key) would take a NULL, but cobro
            // always binds ids, so the key counts as NOT NULL here.
            let null = if notnull == 1 || key > 0 {
                "not null"
            } else {
                "null"
            };
            s.columns
                .insert(format!("{table}.{col} {} {null}", family(&ty)));
            if key > 0 {
                pk.push((key, col));
            }
        }
        pk.sort();
        if !pk.is_empty() {
            let cols: Vec<_> = pk.into_iter().map(|(_, c)| c).collect();
            s.primary_keys
                .insert(format!("{table} ({})", cols.join(", ")));
        }
        let fks: Vec<(i64, i64, String, String, Option<String>, String)> = sqlx::query_as(
            "SELECT id, seq, \"table\", \"from\", \"to\", on_delete \
             FROM pragma_foreign_key_list($1) ORDER BY id, seq",
        )
        .bind(table)
        .fetch_all(&mut c)
        .await
        .expect("foreign keys");
        let mut by_id =
            std::collections::BTreeMap::<i64, (String, Vec<String>, Vec<String>, String)>::new();
        for (id, _, ref_table, from, to, on_delete) in fks {
            let e = by_id
                .entry(id)
                .or_insert_with(|| (ref_table, Vec::new(), Vec::new(), on_delete));
            e.1.push(from);
            // `REFERENCES t` without a column means t's primary key.
            e.2.push(to.unwrap_or_else(|| "id".to_owned()));
        }
        for (_, (ref_table, from, to, on_delete)) in by_id {
            s.foreign_keys.insert(format!(
                "{table} ({}) -> {ref_table} ({}) on delete {on_delete}",
                from.join(", "),
                to.join(", ")
            ));
        }
        let n = sql.to_ascii_uppercase().matches("CHECK").count();
        if n > 0 {
            s.checks.insert(format!("{table}: {n} CHECK constraints"));
        }
        let indexes: Vec<(String, i64, String, i64)> =
            sqlx::query_as("SELECT name, \"unique\", origin, partial FROM pragma_index_list($1)")
                .bind(table)
                .fetch_all(&mut c)
                .await
                .expect("index list");
        for (name, unique, origin, _) in indexes {
            let cols: Vec<(String, i64)> = sqlx::query_as(
                "SELECT name, \"desc\" FROM pragma_index_xinfo($1) WHERE key = 1 ORDER BY seqno",
            )
            .bind(&name)
            .fetch_all(&mut c)
            .await
            .expect("index columns");
            let cols = cols
                .into_iter()
                .map(|(c, desc)| if desc == 1 { format!("{c} DESC") } else { c })
                .collect::<Vec<_>>()
                .join(", ");
            match origin.as_str() {
                "pk" => {}
                "u" => {
                    s.unique_constraints.insert(format!("{table} ({cols})"));
                }
                _ => {
                    let sql: Option<String> =
                        sqlx::query_scalar("SELECT sql FROM sqlite_master WHERE name = $1")
                            .bind(&name)
                            .fetch_one(&mut c)
                            .await
                            .expect("index sql");
                    let pred = sql.as_deref().and_then(|q| {
                        let upper = q.to_ascii_uppercase();
                        upper.rfind(" WHERE ").map(|at| q[at + 7..].to_owned())
                    });
                    s.indexes.insert(index_line(
                        &name,
                        table,
                        &cols,
                        unique == 1,
                        pred.as_deref(),
                    ));
                }
            }
        }
    }
    let views: Vec<(String,)> =
        sqlx::query_as("SELECT name FROM sqlite_master WHERE type = 'view'")
            .fetch_all(&mut c)
            .await
            .expect("views");
    s.views = views.into_iter().map(|(v,)| v).collect();
    let triggers: Vec<(String,)> =
        sqlx::query_as("SELECT DISTINCT tbl_name FROM sqlite_master WHERE type = 'trigger'")
            .fetch_all(&mut c)
            .await
            .expect("triggers");
    s.triggers = trigger_lines(triggers);
    s
}

/// Every line one side has and the other lacks, as `what: only on X: line`.
fn differences(pg: &Schema, lite: &Schema) -> Vec<String> {
    let parts: [(&str, &BTreeSet<String>, &BTreeSet<String>); 8] = [
        ("column", &pg.columns, &lite.columns),
        ("primary key", &pg.primary_keys, &lite.primary_keys),
        (
            "unique constraint",
            &pg.unique_constraints,
            &lite.unique_constraints,
        ),
        ("foreign key", &pg.foreign_keys, &lite.foreign_keys),
        ("checks", &pg.checks, &lite.checks),
        ("index", &pg.indexes, &lite.indexes),
        ("view", &pg.views, &lite.views),
        ("trigger", &pg.triggers, &lite.triggers),
    ];
    let mut out = Vec::new();
    for (what, a, b) in parts {
        for line in a.difference(b) {
            out.push(format!("{what}: only on PostgreSQL: {line}"));
        }
        for line in b.difference(a) {
            out.push(format!("{what}: only on SQLite: {line}"));
        }
    }
    out
}

#[tokio::test]
async fn the_postgres_and_sqlite_schemas_say_the_same_thing() {
    let pg = TestDb::new(Backend::Postgres).await;
    let lite = TestDb::new(Backend::Sqlite).await;
    let (pg_schema, lite_schema) = (
        postgres_schema(&pg.url).await,
        sqlite_schema(&lite.url).await,
    );
    assert!(!pg_schema.columns.is_empty() && !lite_schema.columns.is_empty());
    // The partial indexes of the unsettled statuses list exactly core's
    // UNSETTLED (the queries build their IN lists from it; PostgreSQL uses
    // the index only when the two agree).
    let quoted = |names: Vec<&str>| {
        names
            .iter()
            .map(|n| format!("'{n}'"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // PostgreSQL's predicates carry the always-true term of migration 0014.
    let unsettled = |name: &str, table: &str, statuses: Vec<&str>| {
        let on = |term: &str| {
            index_line(
                name,
                table,
                "status, status_changed_at",
                false,
                Some(&format!("status IN ({}){term}", quoted(statuses.clone()))),
            )
        };
        (on(" AND status_changed_at IS NOT NULL"), on(""))
    };
    let unsettled = [
        unsettled(
            "payments_unsettled",
            "payments",
            PaymentStatus::UNSETTLED
                .iter()
                .map(|s| s.as_str())
                .collect(),
        ),
        unsettled(
            "refunds_unsettled",
            "refunds",
            RefundStatus::UNSETTLED.iter().map(|s| s.as_str()).collect(),
        ),
    ];
    for (on_postgres, on_sqlite) in &unsettled {
        assert!(
            pg_schema.indexes.contains(on_postgres),
            "PostgreSQL lacks {on_postgres}"
        );
        assert!(
            lite_schema.indexes.contains(on_sqlite),
            "SQLite lacks {on_sqlite}"
        );
    }
    let found = differences(&pg_schema, &lite_schema);
    let excused: BTreeSet<&str> = EXCEPTIONS.iter().map(|(line, _)| *line).collect();
    let unexcused: Vec<_> = found
        .iter()
        .filter(|d| !excused.contains(d.as_str()))
        .collect();
    let stale: Vec<_> = excused
        .iter()
        .filter(|e| !found.iter().any(|d| d == *e))
        .collect();
    assert!(
        unexcused.is_empty() && stale.is_empty(),
        "the schemas differ:\n{}\nexceptions that no longer apply (remove them):\n{}",
        unexcused
            .iter()
            .map(|d| format!("  {d}"))
            .collect::<Vec<_>>()
            .join("\n"),
        stale
            .iter()
            .map(|d| format!("  {d}"))
            .collect::<Vec<_>>()
            .join("\n"),
    );
}

/// Tables with no `account_id`, each with why. Everything else carries its
/// account, so a distributed PostgreSQL (Citus with `account_id` as the
/// distribution column, ops/SCALING.md) can keep one account's rows on one
/// node and send each statement to one shard.
const GLOBAL_TABLES: &[(&str, &str)] = &[
    (
        "accounts",
        "the distribution key's own table: small, read on every request (the \
         token's account, its provider); a reference table under Citus, copied \
         to every node",
    ),
    (
        "webhook_events",
        "a provider's event ids are unique per provider, not per account, and \
         an event is deduplicated before its payload is matched to a payment \
         (payment_id is NULL when it matches none); under Citus it is \
         distributed on event_id on its own",
    ),
    (
        "reconciliation_runs",
        "one row per reconciler run, and a run sweeps every account (the \
         operators' log); under Citus a table of the coordinator",
    ),
    (
        "books_runs",
        "one row per books run of a provider, and a run lists the provider's \
         whole ledger, every account's objects (docs/books.md); under Citus \
         a table of the coordinator",
    ),
    (
        "books_cursors",
        "how far a provider's ledger was read: one row per provider, whose \
         credentials every account shares; under Citus a table of the \
         coordinator",
    ),
    (
        "provider_health",
        "a provider's calls per second and per process, every account's \
         together: a provider's health is one for all the accounts that use \
         its credentials (docs/routing.md); under Citus a table of the \
         coordinator",
    ),
    (
        "provider_circuits",
        "one circuit per provider, shared by every account and process \
         (docs/routing.md); under Citus a table of the coordinator",
    ),
    (
        "books_listed",
        "the provider's ids a books run listed, every account's objects (a \
         run lists the provider's whole ledger), kept for the run's missing \
         check and deleted at its end; keyed by run and object; under Citus \
         a table of the coordinator",
    ),
];

/// Unique keys that do not name `account_id` (besides primary keys on a
/// row's own `id`, see below, and the keys of GLOBAL_TABLES), each with why.
/// An entry is `table (columns)`, as the schemas list it.
const UNKEYED_UNIQUE_KEYS: &[(&str, &str)] = &[
    (
        "books_orphans (provider, object_id)",
        "an orphan is an object at the provider that no attempt of cobro's \
         has: its account_id is only what its metadata claims (text, maybe \
         absent), so the provider's own id is the key; under Citus a table \
         of the coordinator",
    ),
    (
        "api_tokens (token_hash)",
        "a token is looked up by its hash before its account is known; under \
         Citus api_tokens is a reference table, like accounts",
    ),
    (
        "attempts (provider_key)",
        "a random v4 UUID sent as the provider's idempotency key: unique across \
         accounts by construction, and it must stay so at the provider, whose \
         key scope is the API key all accounts share. A table constraint, which \
         SQLite cannot change without rebuilding attempts; under Citus it \
         becomes UNIQUE (account_id, provider_key) (ops/SCALING.md)",
    ),
    (
        "outbox (attempt_id)",
        "one outbox row per attempt (attempt ids are UUIDv7, unique across \
         accounts); a table constraint, under Citus UNIQUE (account_id, attempt_id)",
    ),
    (
        "events (feed_position)",
        "the position the sequencer gives an event in the feed, one counter for \
         all accounts on one database; under Citus one counter per account, \
         UNIQUE (account_id, feed_position) (ops/SCALING.md)",
    ),
    (
        "events (payment_id, sequence)",
        "a payment's own event sequence (payment ids are unique across \
         accounts); a table constraint, under Citus UNIQUE (account_id, \
         payment_id, sequence)",
    ),
    (
        "events (written)",
        "SQLite only (see EXCEPTIONS): insertion order under its one writer",
    ),
    (
        "event_deliveries (event_id, endpoint_id)",
        "the primary key of one event to one endpoint, both unique across \
         accounts; under Citus (account_id, event_id, endpoint_id)",
    ),
];

/// `table (columns)` of every unique key of a schema: primary keys, unique
/// constraints and unique indexes.
fn unique_keys(s: &Schema) -> BTreeSet<String> {
    let indexes = s.indexes.iter().filter_map(|line| {
        // `name on table (columns) unique [where ...]`
        let (_, rest) = line.split_once(" on ")?;
        let (key, tail) = rest.split_once(')')?;
        tail.starts_with(" unique").then(|| format!("{key})"))
    });
    s.primary_keys
        .iter()
        .chain(&s.unique_constraints)
        .cloned()
        .chain(indexes)
        .collect()
}

/// What keeps a schema from being keyed by account: tables without
/// `account_id`, unique keys that do not name it; and allowlist entries
/// that no longer match anything (to be removed).
fn unkeyed(s: &Schema) -> Vec<String> {
    let global: BTreeSet<&str> = GLOBAL_TABLES.iter().map(|(t, _)| *t).collect();
    let tables: BTreeSet<&str> = s
        .columns
        .iter()
        .filter_map(|c| c.split_once('.').map(|(t, _)| t))
        .collect();
    let mut out = Vec::new();
    for table in &tables {
        let keyed = s
            .columns
            .iter()
            .any(|c| c.starts_with(&format!("{table}.account_id ")));
        if keyed && global.contains(table) {
            out.push(format!(
                "{table} has account_id now: take it off GLOBAL_TABLES"
            ));
        }
        if !keyed && !global.contains(table) {
            out.push(format!("{table} has no account_id"));
        }
    }
    for (table, _) in GLOBAL_TABLES {
        if !tables.contains(table) {
            out.push(format!("GLOBAL_TABLES names {table}, which does not exist"));
        }
    }
    let keys = unique_keys(s);
    let allowed: BTreeSet<&str> = UNKEYED_UNIQUE_KEYS.iter().map(|(k, _)| *k).collect();
    for key in &keys {
        let Some((table, cols)) = key.split_once(" (") else {
            continue;
        };
        let names_account = cols
            .trim_end_matches(')')
            .split(", ")
            .any(|c| c == "account_id");
        // A primary key on the row's own id: cobro generates ids as UUIDs
        // (v7), unique across accounts by construction. Under Citus each
        // becomes (account_id, id), a change of constraint only.
        let own_id = s.primary_keys.contains(key) && cols == "id)";
        if !names_account && !own_id && !global.contains(table) && !allowed.contains(key.as_str()) {
            out.push(format!("unique key {key} does not name account_id"));
        }
    }
    out
}

#[tokio::test]
async fn every_table_and_unique_key_names_its_account_on_both_backends() {
    let pg = TestDb::new(Backend::Postgres).await;
    let lite = TestDb::new(Backend::Sqlite).await;
    let (pg_schema, lite_schema) = (
        postgres_schema(&pg.url).await,
        sqlite_schema(&lite.url).await,
    );
    assert!(
        unique_keys(&pg_schema).contains("payments (account_id, order_ref)"),
        "the reading of unique indexes found the one active payment per order"
    );
    let mut problems: Vec<String> = unkeyed(&pg_schema)
        .into_iter()
        .map(|p| format!("PostgreSQL: {p}"))
        .chain(
            unkeyed(&lite_schema)
                .into_iter()
                .map(|p| format!("SQLite: {p}")),
        )
        .collect();
    // An allowlisted key that neither schema has any more is stale.
    let (pg_keys, lite_keys) = (unique_keys(&pg_schema), unique_keys(&lite_schema));
    for (key, _) in UNKEYED_UNIQUE_KEYS {
        if !pg_keys.contains(*key) && !lite_keys.contains(*key) {
            problems.push(format!(
                "UNKEYED_UNIQUE_KEYS names {key}, which neither schema has"
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "the schema is not keyed by account:\n{}",
        problems
            .iter()
            .map(|p| format!("  {p}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
