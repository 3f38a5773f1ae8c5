//! The HTTP floor of ops/bench/floor.sh (issue 50, item 5): the least a
//! server can do to answer cobro's GET and replay, on the same statements.
//!
//! axum and sqlx as published, on cobro's PostgreSQL pool
//! (`cobro_store::pg_pool`: deadpool over sqlx's `PgConnection`s, which
//! takes a connection back without a round trip; sqlx's own pool pings
//! every connection given back, one round trip more per request than
//! cobro makes), the same multi-thread tokio runtime as `cobro serve`
//! (`#[tokio::main]`, one worker per core) and the same allocator
//! (mimalloc), and no middleware at all: no authentication, no request
//! context, no timeout, no tracing, no metrics, no rate limit. What cobro
//! does above this floor is its own HTTP and handler overhead.
//!
//! - `GET /v1/payments/{id}`: cobro's statement for a GET (the payment
//!   joined with its attempts, `Store::payment_with_attempts_for_account`,
//!   the statement of ops/bench/get_payment.sql), for the account
//!   `FLOOR_ACCOUNT` (there is no token: the floor does no
//!   authentication); the rows rendered as a plain JSON object of their
//!   columns, the attempts as an array.
//! - `POST /v1/payments` with an `Idempotency-Key` already completed: the
//!   round trips cobro makes for that replay (`keyed::begin`, then
//!   ops/bench/replay.sql): `BEGIN`, the reservation (the INSERT that
//!   conflicts and the read of the record, one statement), `ROLLBACK`; then
//!   the stored status and body. The request body is read and nothing
//!   else: no parsing, validation or fingerprint (the fingerprint bound is
//!   a constant, which the conflicting INSERT never stores). The floor is
//!   the statements and the HTTP framework, nothing else. A key that is
//!   not completed is rolled back too and answered 422: the floor only
//!   replays.
//!
//! Settings (environment): `FLOOR_DATABASE_URL` (required), `FLOOR_POOL`
//! (16), `FLOOR_ACCOUNT` (required, a uuid), `FLOOR_LISTEN`
//! (`127.0.0.1:0`). Prints `floor listening on http://ADDR` once it
//! accepts connections, and serves until killed.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use cobro_store::pg_pool::PgPool;
use serde_json::{Map, Value};
use sqlx::postgres::{PgConnectOptions, PgRow};
use sqlx::{Column, Row, TypeInfo};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// cobro's GET statement (`Store::payment_with_attempts_for_account`),
/// character for character as cobro formats it.
const GET_PAYMENT: &str = "SELECT p.id, p.account_id, p.order_ref, p.intent, p.amount, p.currency, \
    p.capture_method, p.payment_method, p.description, p.metadata, p.status, p.amount_captured, \
    p.amount_refund_reserved, p.amount_refunded, p.provider_ref, p.provider_sequence, \
    p.failure_code, p.failure_message, p.cancel_requested_at, p.status_changed_at, p.created_at, \
    p.updated_at, p.review_reason, p.review_from, p.provider, a.id AS a_id, \
    a.intent_id AS a_intent_id, a.payment_id AS a_payment_id, a.refund_id AS a_refund_id, \
    a.operation AS a_operation, a.provider_key AS a_provider_key, a.reference AS a_reference, \
    a.state AS a_state, a.send_count AS a_send_count, a.first_send_at AS a_first_send_at, \
    a.last_send_at AS a_last_send_at, a.provider_ref AS a_provider_ref, \
    a.last_error AS a_last_error, a.created_at AS a_created_at, a.updated_at AS a_updated_at, \
    a.provider AS a_provider, a.provider_request_id AS a_provider_request_id, \
    a.provider_replayed AS a_provider_replayed \
    FROM payments p JOIN attempts a ON a.payment_id = p.id \
    WHERE p.id = $1 AND p.account_id = $2 ORDER BY a.created_at, a.id";

/// cobro's reservation on PostgreSQL (`WriteTx::reserve_key`): the INSERT
/// and the read of the record that refused it, one statement.
const RESERVE: &str = "WITH ins AS (INSERT INTO idempotency_records \
    (account_id, operation, idempotency_key, fingerprint, state, status_code, \
    response_body, resource_type, resource_id, created_at) \
    VALUES ($1, $2, $3, $4, 'completed', 0, $5, $6, $7, $8) \
    ON CONFLICT (account_id, operation, idempotency_key) DO NOTHING RETURNING 1) \
    SELECT EXISTS (SELECT 1 FROM ins) AS reserved, r.* FROM (SELECT 1) AS one \
    LEFT JOIN (SELECT fingerprint, status_code, response_body, resource_type, resource_id, \
    created_at FROM idempotency_records \
    WHERE account_id = $1 AND operation = $2 AND idempotency_key = $3) AS r ON true";

struct Floor {
    pool: PgPool,
    account: Uuid,
}

type Answer = Result<Response, (StatusCode, String)>;

fn failed(e: impl std::fmt::Display) -> (StatusCode, String) {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// One column as JSON, by its PostgreSQL type.
fn column(row: &PgRow, i: usize) -> Result<Value, sqlx::Error> {
    Ok(match row.column(i).type_info().name() {
        "UUID" => serde_json::json!(row.try_get::<Option<Uuid>, _>(i)?),
        "TEXT" | "VARCHAR" => serde_json::json!(row.try_get::<Option<String>, _>(i)?),
        "INT8" => serde_json::json!(row.try_get::<Option<i64>, _>(i)?),
        "INT4" => serde_json::json!(row.try_get::<Option<i32>, _>(i)?),
        "BOOL" => serde_json::json!(row.try_get::<Option<bool>, _>(i)?),
        "TIMESTAMPTZ" => {
            serde_json::json!(row.try_get::<Option<chrono::DateTime<chrono::Utc>>, _>(i)?)
        }
        "JSON" | "JSONB" => row.try_get::<Option<Value>, _>(i)?.unwrap_or(Value::Null),
        other => {
            return Err(sqlx::Error::Decode(
                format!("the floor does not render {other}").into(),
            ));
        }
    })
}

/// The columns of `row` whose name starts (`prefixed`) or does not start
/// with `a_`, the prefix taken off.
fn object(row: &PgRow, prefixed: bool) -> Result<Map<String, Value>, sqlx::Error> {
    let mut object = Map::new();
    for (i, c) in row.columns().iter().enumerate() {
        let name = c.name();
        match (name.strip_prefix("a_"), prefixed) {
            (Some(name), true) => object.insert(name.to_owned(), column(row, i)?),
            (None, false) => object.insert(name.to_owned(), column(row, i)?),
            _ => None,
        };
    }
    Ok(object)
}

async fn get_payment(State(floor): State<Arc<Floor>>, Path(id): Path<Uuid>) -> Answer {
    let rows: Vec<PgRow> = sqlx::query(GET_PAYMENT)
        .bind(id)
        .bind(floor.account)
        .fetch_all(&floor.pool)
        .await
        .map_err(failed)?;
    let Some(first) = rows.first() else {
        return Ok(StatusCode::NOT_FOUND.into_response());
    };
    let mut payment = object(first, false).map_err(failed)?;
    let attempts = rows
        .iter()
        .map(|row| object(row, true).map(Value::Object))
        .collect::<Result<Vec<_>, _>>()
        .map_err(failed)?;
    payment.insert("attempts".to_owned(), Value::Array(attempts));
    let body = serde_json::to_vec(&Value::Object(payment)).map_err(failed)?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// The request body is read (axum's `Bytes`) and not looked at: the floor
/// is the statements and the HTTP framework (module doc).
async fn replay(State(floor): State<Arc<Floor>>, headers: HeaderMap, _body: Bytes) -> Answer {
    let key = headers
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .ok_or((StatusCode::BAD_REQUEST, "no Idempotency-Key".to_owned()))?;
    let mut tx = floor.pool.begin().await.map_err(failed)?;
    let row = sqlx::query(RESERVE)
        .bind(floor.account)
        .bind("payment.authorize")
        .bind(key)
        .bind("floor: never stored")
        .bind(Vec::<u8>::new())
        .bind("payment")
        .bind(Uuid::now_v7())
        .bind(chrono::Utc::now())
        .fetch_one(&mut tx)
        .await
        .map_err(failed)?;
    tx.rollback().await.map_err(failed)?;
    let reserved: bool = row.try_get("reserved").map_err(failed)?;
    let status: Option<i32> = row.try_get("status_code").map_err(failed)?;
    let (false, Some(status)) = (reserved, status) else {
        return Ok((StatusCode::UNPROCESSABLE_ENTITY, "the floor only replays").into_response());
    };
    let body: Option<Vec<u8>> = row.try_get("response_body").map_err(failed)?;
    let resource: Uuid = row.try_get("resource_id").map_err(failed)?;
    let status = u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| failed(format!("stored status {status}")))?;
    let location = HeaderValue::from_str(&format!("/v1/payments/{resource}")).map_err(failed)?;
    Ok((
        status,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (header::LOCATION, location),
            (
                header::HeaderName::from_static("idempotent-replayed"),
                HeaderValue::from_static("true"),
            ),
        ],
        body.unwrap_or_default(),
    )
        .into_response())
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

#[tokio::main]
async fn main() {
    let url = env("FLOOR_DATABASE_URL").expect("FLOOR_DATABASE_URL");
    let account: Uuid = env("FLOOR_ACCOUNT")
        .expect("FLOOR_ACCOUNT")
        .parse()
        .expect("FLOOR_ACCOUNT is a uuid");
    let pool_size: u32 = env("FLOOR_POOL").map_or(16, |p| p.parse().expect("FLOOR_POOL"));
    let listen = env("FLOOR_LISTEN").unwrap_or_else(|| "127.0.0.1:0".to_owned());
    // cobro's connection options (`Store::connect`): sent once when a
    // connection opens, nothing per request.
    let options = PgConnectOptions::from_str(&url)
        .expect("FLOOR_DATABASE_URL")
        .options([
            ("lock_timeout", "2000ms"),
            ("idle_in_transaction_session_timeout", "60000ms"),
        ]);
    // cobro's defaults: 5 s to take a connection, 10 s per round trip.
    let pool = PgPool::connect(
        options,
        pool_size,
        Duration::from_secs(5),
        Duration::from_secs(10),
    )
    .await
    .expect("connect to PostgreSQL");
    let router = Router::new()
        .route("/v1/payments/{id}", get(get_payment))
        .route("/v1/payments", post(replay))
        .with_state(Arc::new(Floor { pool, account }));
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .expect("bind FLOOR_LISTEN");
    let address = listener.local_addr().expect("local address");
    println!("floor listening on http://{address}");
    // As cobro's accept loop does: small answers are not held back by Nagle.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router).await.expect("serve");
}
