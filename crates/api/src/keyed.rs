//! The decision table for a POST with an Idempotency-Key
//! (docs/http-api.md §5), shared by every keyed operation.
//!
//! `begin` opens the transaction and reserves the key as its first
//! statement; the handler does its local work in the same transaction;
//! `commit` stores the answer with the key and commits. Only then is the
//! answer sent. Anything that returns early without `commit` drops the
//! transaction, which rolls it back and leaves the key free.

use crate::error::{ApiError, problem_response};
use crate::extract::Account;
use crate::{AppState, HoldPoint, TestHold};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cobro_core::{Fingerprint, IdempotencyKey, Operation, PaymentId, RefundId};
use cobro_store::idempotency::ResourceType;
use cobro_store::{KeyScope, Reservation, StoreError, StoredRecord, WriteTx};
use std::collections::BTreeMap;
use uuid::Uuid;

pub const REPLAYED: &str = "idempotent-replayed";

/// A keyed request: its scope and its fingerprint.
pub struct Keyed {
    pub scope: KeyScope,
    pub fingerprint: Fingerprint,
}

impl Keyed {
    pub fn new(
        account: Account,
        operation: Operation,
        key: IdempotencyKey,
        path: &BTreeMap<&str, String>,
        normalised_body: &impl serde::Serialize,
    ) -> Result<Self, ApiError> {
        let fingerprint = Fingerprint::compute(operation.as_str(), path, normalised_body)
            .map_err(ApiError::internal)?;
        Ok(Self {
            scope: KeyScope {
                account: account.0,
                operation,
                key,
            },
            fingerprint,
        })
    }
}

/// What `begin` found.
pub enum Begun {
    /// The key is reserved; do the work in this transaction.
    Fresh(WriteTx),
    /// The key was already answered: here is the answer.
    Answered(Response),
}

/// Opens the transaction and reserves the key, in span
/// `idempotency.reserve` (`result`: reserved, replayed, key_reused,
/// in_progress, unavailable).
#[tracing::instrument(
    name = "idempotency.reserve",
    skip_all,
    fields(
        account_id = %keyed.scope.account,
        operation = keyed.scope.operation.as_str(),
        idempotency_key_hash = %keyed.scope.key.hash(),
        result = tracing::field::Empty,
    )
)]
pub async fn begin(
    state: &AppState,
    keyed: &Keyed,
    resource: (ResourceType, Uuid),
) -> Result<Begun, ApiError> {
    let begun = reserve(state, keyed, resource).await;
    let result = match &begun {
        Ok(Begun::Fresh(_)) => "reserved",
        Ok(Begun::Answered(_)) => "replayed",
        Err(ApiError::KeyReused { .. }) => "key_reused",
        Err(ApiError::InProgress { .. }) => "in_progress",
        Err(_) => "unavailable",
    };
    tracing::Span::current().record("result", result);
    begun
}

async fn reserve(
    state: &AppState,
    keyed: &Keyed,
    resource: (ResourceType, Uuid),
) -> Result<Begun, ApiError> {
    let now = state.clock.now();
    // Waiting for the write lock (SQLite) or for a concurrent holder of the
    // same key (PostgreSQL) is bounded; running out means the key is busy.
    // On SQLite a busy write lock says nothing about this key (one writer
    // for the whole database; a holder of the same key would have been
    // waited for and replayed): it is 503, not 409.
    let sqlite = state.store.backend() == cobro_store::BackendKind::Sqlite;
    let in_progress = |e: StoreError| match e {
        StoreError::Busy if sqlite => ApiError::Unavailable(None),
        StoreError::Busy => ApiError::InProgress {
            idempotency_key: keyed.scope.key.as_str().to_owned(),
        },
        other => other.into(),
    };
    let mut tx = state.store.begin().await.map_err(in_progress)?;
    match tx
        .reserve_key(&keyed.scope, &keyed.fingerprint, resource, now)
        .await
        .map_err(in_progress)?
    {
        Reservation::Reserved => Ok(Begun::Fresh(tx)),
        Reservation::Taken(record) => {
            tx.rollback().await?;
            answer_existing(state, keyed, record)
                .await
                .map(Begun::Answered)
        }
    }
}

/// Stores the answer against the key, commits, and builds the response.
/// `hold`: the test-only pause ([`TestHold`]) before or after the commit.
pub async fn commit(
    mut tx: WriteTx,
    keyed: &Keyed,
    answer: (StatusCode, Vec<u8>, &'static str),
    location: Option<String>,
    hold: Option<&TestHold>,
) -> Result<Response, ApiError> {
    let (status, body, content_type) = answer;
    let key = keyed.scope.key.as_str();
    tx.complete_key(&keyed.scope, status.as_u16(), &body)
        .await?;
    TestHold::at(hold, HoldPoint::BeforeCommit, key).await;
    tx.commit().await?;
    TestHold::at(hold, HoldPoint::AfterCommit, key).await;
    Ok(build(status, body, content_type, location, false))
}

/// Stores a final business refusal against the key (e.g. a capture of a
/// payment that is not capturable): the same key will get the same answer.
pub async fn commit_refusal(
    tx: WriteTx,
    keyed: &Keyed,
    error: ApiError,
) -> Result<Response, ApiError> {
    let (status, _) = error.status_and_code();
    commit(
        tx,
        keyed,
        (status, error.problem_bytes(), "application/problem+json"),
        None,
        None,
    )
    .await
}

fn build(
    status: StatusCode,
    body: Vec<u8>,
    content_type: &'static str,
    location: Option<String>,
    replayed: bool,
) -> Response {
    let mut response = if content_type == "application/problem+json" {
        problem_response(status, body)
    } else {
        let mut r = (status, body).into_response();
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        r
    };
    let headers = response.headers_mut();
    headers.insert(
        REPLAYED,
        HeaderValue::from_static(if replayed { "true" } else { "false" }),
    );
    if let Some(location) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        headers.insert(header::LOCATION, location);
    }
    response
}

fn location(record: &StoredRecord) -> Option<String> {
    (record.status_code == 201 && record.resource_type == ResourceType::Payment)
        .then(|| format!("/v1/payments/{}", record.resource_id))
}

async fn answer_existing(
    state: &AppState,
    keyed: &Keyed,
    record: StoredRecord,
) -> Result<Response, ApiError> {
    if record.fingerprint != keyed.fingerprint {
        return Err(ApiError::KeyReused {
            idempotency_key: keyed.scope.key.as_str().to_owned(),
        });
    }
    let status = StatusCode::from_u16(record.status_code).map_err(ApiError::internal)?;
    let location = location(&record);
    if let Some(body) = record.response_body {
        // Byte for byte what the first execution answered.
        let content_type = if status.is_success() {
            "application/json"
        } else {
            "application/problem+json"
        };
        return Ok(build(status, body, content_type, location, true));
    }
    // A tombstone: the original status with the resource as it is now.
    if !status.is_success() {
        let body = serde_json::to_vec(&serde_json::json!({
            "type": "/problems/refusal-compacted",
            "title": "Refusal compacted",
            "status": status.as_u16(),
            "detail": "this key was refused earlier; the refusal is older than the idempotency retention and its body is no longer stored",
            "code": "refusal-compacted",
        }))
        .map_err(ApiError::internal)?;
        return Ok(build(status, body, "application/problem+json", None, true));
    }
    let account = keyed.scope.account;
    let body = match record.resource_type {
        ResourceType::Payment => {
            let id = PaymentId::from_uuid(record.resource_id);
            let view = crate::payments::load_payment(state, account, id).await?;
            serde_json::to_vec(&view.ok_or(ApiError::NotFound)?)
        }
        ResourceType::Refund => {
            let id = RefundId::from_uuid(record.resource_id);
            let view = crate::payments::load_refund_by_id(state, account, id).await?;
            serde_json::to_vec(&view.ok_or(ApiError::NotFound)?)
        }
    }
    .map_err(ApiError::internal)?;
    Ok(build(status, body, "application/json", location, true))
}
