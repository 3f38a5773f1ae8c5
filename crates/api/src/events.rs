//! Events to merchants: the feed (`GET /v1/events`, `GET /v1/events/{id}`)
//! and the endpoints events are pushed to (`/v1/event_endpoints`).
//!
//! The feed is the pull side of the same events the dispatcher pushes:
//! `position` is dense and increasing, and a position becomes visible only
//! once every smaller one is (see `cobro_store::events`), so paging with
//! `after=<last position seen>` from any cursor yields every later event,
//! with no gap. Each read first sequences whatever has committed, so the
//! feed is current even with no dispatcher running.

use crate::error::{ApiError, FieldError};
use crate::extract::{Account, JsonObject, Params};
use crate::{AppState, views};
use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use cobro_core::egress::{EgressPolicy, Host, HostCheck, Refusal};
use cobro_core::{EndpointId, EventId, PaymentStatus, RefundStatus};
use cobro_store::events::{EndpointRow, EventFilter};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// How long the previous secret keeps signing after a rotation.
pub const ROTATION_OVERLAP: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_events))
        .routes(routes!(get_event))
        .routes(routes!(create_endpoint, list_endpoints))
        .routes(routes!(delete_endpoint))
        .routes(routes!(rotate_secret))
}

/// Every event type cobro writes: `payment.created`, `payment.<status>`
/// for each payment status it can move to, `payment.conflict_found`,
/// `payment.rerouted`, `refund.created`,
/// `refund.<status>` for each refund status.
pub fn event_types() -> Vec<String> {
    let mut types = vec!["payment.created".to_owned()];
    types.extend(
        PaymentStatus::ALL
            .iter()
            .map(|s| format!("payment.{}", s.as_str())),
    );
    types.push("payment.conflict_found".to_owned());
    types.push("payment.rerouted".to_owned());
    types.push("refund.created".to_owned());
    types.extend(
        RefundStatus::ALL
            .iter()
            .map(|s| format!("refund.{}", s.as_str())),
    );
    types
}

#[derive(Deserialize)]
struct ListQuery {
    after: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    object: Option<String>,
    limit: Option<String>,
}

/// A page of events.
#[derive(Serialize, ToSchema)]
struct EventList {
    /// Each as `GET /v1/events/{id}` answers it.
    #[schema(value_type = Vec<crate::openapi::schemas::Event>)]
    data: Vec<Value>,
    /// Pass as `after` for the next page: the last position returned (or
    /// the `after` asked for, when the page is empty).
    next_after: i64,
    /// More events were already there when this page was read.
    has_more: bool,
}

crate::openapi::refusals!(
    /// What `list_events` refuses.
    ListEventsRefusals = read [Validation]
);

/// List events
///
/// The account's events in feed order (`position`, dense and
/// increasing), oldest first. A position becomes visible only once
/// every smaller one is: paging with `after` = the previous page's
/// `next_after` from any position yields every later event, with no
/// gap and no repeat.
#[utoipa::path(
    get,
    path = "/v1/events",
    operation_id = "listEvents",
    tag = "events",
    params(
        ("after" = Option<i64>, Query, minimum = 0, description = "Only events after this position; default 0 (from the start)."),
        ("type" = Option<crate::openapi::EventTypeSchema>, Query, description = "Only events of this type."),
        ("object" = Option<String>, Query, format = Uuid, description = "Only events about this payment (its refunds' included) or refund."),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 200, description = "Page size, 1 to 200; default 50."),
    ),
    responses(
        (status = 200, description = "A page of events, oldest first.", body = EventList),
        ListEventsRefusals,
    ),
)]
async fn list_events(
    State(state): State<AppState>,
    account: Account,
    Params(q): Params<ListQuery>,
) -> Result<Json<EventList>, ApiError> {
    let mut errors = Vec::new();
    let after = match q.after.as_deref().map(str::parse::<i64>) {
        None => 0,
        Some(Ok(n)) if n >= 0 => n,
        Some(_) => {
            errors.push(FieldError::new("after", "must be a position (0 or more)"));
            0
        }
    };
    let limit = match q.limit.as_deref().map(str::parse::<u32>) {
        None => 50,
        Some(Ok(n)) if (1..=200).contains(&n) => n,
        Some(_) => {
            errors.push(FieldError::new("limit", "must be from 1 to 200"));
            50
        }
    };
    if let Some(t) = &q.event_type
        && !event_types().contains(t)
    {
        errors.push(FieldError::new("type", "unknown event type"));
    }
    let object = match q.object.as_deref().map(uuid::Uuid::parse_str) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(_)) => {
            errors.push(FieldError::new("object", "must be a payment or refund id"));
            None
        }
    };
    if !errors.is_empty() {
        return Err(ApiError::Validation(errors));
    }
    state.store.sequence_events(state.clock.now()).await?;
    let filter = EventFilter {
        after,
        event_type: q.event_type,
        object,
        limit: limit + 1,
    };
    let mut rows = state.store.events_for_account(account.0, &filter).await?;
    let has_more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let next_after = rows.last().and_then(|r| r.feed_position).unwrap_or(after);
    Ok(Json(EventList {
        data: rows.iter().map(|r| r.to_json()).collect(),
        next_after,
        has_more,
    }))
}

crate::openapi::refusals!(
    /// What `get_event` refuses.
    GetEventRefusals = read [NotFound]
);

/// Read an event
#[utoipa::path(
    get,
    path = "/v1/events/{id}",
    operation_id = "getEvent",
    tag = "events",
    params(("id" = String, Path, format = Uuid, description = "The event id. Not a UUID, or another account's: 404.")),
    responses(
        (status = 200, description = "The event.", body = crate::openapi::schemas::Event),
        GetEventRefusals,
    ),
)]
async fn get_event(
    State(state): State<AppState>,
    account: Account,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let id: EventId = id.parse().map_err(|_| ApiError::NotFound)?;
    state.store.sequence_events(state.clock.now()).await?;
    let row = state
        .store
        .event_for_account(account.0, id)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(Json(row.to_json()))
}

/// Where events are pushed.
// As the API shows an endpoint: never its secret, except in the answers
// that create or rotate it (`secret`, shown once).
#[derive(Serialize, ToSchema)]
#[schema(as = EventEndpoint)]
pub(crate) struct EndpointView {
    #[schema(format = Uuid)]
    id: String,
    url: String,
    /// `["*"]` for every type.
    event_types: Vec<String>,
    /// `false` once it failed every attempt for 3 days.
    enabled: bool,
    disabled_reason: Option<String>,
    #[schema(format = DateTime)]
    created_at: String,
    /// The signing secret: only in the answers that create or rotate it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    secret: Option<String>,
}

fn endpoint_view(row: &EndpointRow, with_secret: bool) -> EndpointView {
    EndpointView {
        id: row.id.to_string(),
        url: row.url.clone(),
        event_types: row.types(),
        enabled: row.enabled,
        disabled_reason: row.disabled_reason.clone(),
        created_at: views::time(row.created_at.0),
        secret: with_secret.then(|| row.secret.clone()),
    }
}

/// A fresh signing secret: `whsec_` and 32 random bytes in hex.
pub fn new_secret() -> String {
    format!(
        "whsec_{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// The URLs an endpoint may have, as the document states them
/// ([`endpoint_url_ok`] is the same grammar in code): `http` or `https`, a
/// host name whose last label starts with a letter or a dotted IPv4
/// address (no IPv6 literal), an optional port, an optional path of
/// unreserved characters; no user, query or fragment.
pub(crate) const ENDPOINT_URL_PATTERN: &str = "^https?://(([A-Za-z0-9-]+\\.)*[A-Za-z][A-Za-z0-9-]*|(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])(\\.(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])){3})(:(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))?(/[A-Za-z0-9._~/-]*)?$";

/// [`ENDPOINT_URL_PATTERN`], in code, and at most 2048 characters.
pub fn endpoint_url_ok(url: &str) -> bool {
    let label =
        |l: &str| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let Some(rest) = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
    else {
        return false;
    };
    if url.len() > 2048 {
        return false;
    }
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let (host, port) = match authority.split_once(':') {
        Some((host, port)) => (host, Some(port)),
        None => (authority, None),
    };
    let labels: Vec<&str> = host.split('.').collect();
    let last_is_a_name = labels
        .last()
        .and_then(|l| l.bytes().next())
        .is_some_and(|b| b.is_ascii_alphabetic());
    let octet = |l: &str| {
        !l.is_empty()
            && l.len() <= 3
            && l.bytes().all(|b| b.is_ascii_digit())
            && (l == "0" || !l.starts_with('0'))
            && l.parse::<u8>().is_ok()
    };
    let ipv4 = labels.len() == 4 && labels.iter().all(|l| octet(l));
    let port_ok = port.is_none_or(|p| {
        !p.starts_with('0') && p.len() <= 5 && p.parse::<u16>().is_ok_and(|n| n > 0)
    });
    let path_ok = path
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._~/-".contains(&b));
    (ipv4 || (labels.iter().all(|l| label(l)) && last_is_a_name)) && port_ok && path_ok
}

/// How long a registration waits for the endpoint's host name to resolve.
const RESOLVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether events may go to `url` (well formed: [`endpoint_url_ok`]) under
/// `policy`: its scheme, then its host; a host name is resolved and EVERY
/// address it has must be allowed (one private address among public ones
/// refuses it), and a name that does not resolve is refused too. The
/// dispatcher checks again at each connection (DNS can change after this
/// answer), so this is the merchant's early, clear answer, not the guard.
pub async fn check_endpoint_url(policy: &EgressPolicy, url: &str) -> Result<(), Refusal> {
    let parsed = url::Url::parse(url).map_err(|_| Refusal::Malformed)?;
    policy.check_scheme(parsed.scheme())?;
    let port = parsed.port_or_known_default().ok_or(Refusal::Malformed)?;
    let name = match parsed.host() {
        Some(url::Host::Domain(name)) => name,
        Some(url::Host::Ipv4(ip)) => return policy.check_host(Host::Ip(ip.into())).map(|_| ()),
        Some(url::Host::Ipv6(ip)) => return policy.check_host(Host::Ip(ip.into())).map(|_| ()),
        None => return Err(Refusal::Malformed),
    };
    if policy.check_host(Host::Name(name))? == HostCheck::Allowed {
        return Ok(());
    }
    let unresolved = || Refusal::Unresolved {
        host: name.to_owned(),
    };
    let addresses: Vec<std::net::IpAddr> =
        tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((name, port)))
            .await
            .map_err(|_| unresolved())?
            .map_err(|_| unresolved())?
            .map(|address| address.ip())
            .collect();
    policy.check_resolved(name, &addresses)
}

/// Body of `POST /v1/event_endpoints`.
// In the code: the request after validation (read field by field by
// `parse_endpoint`, which refuses unknown fields); no types is every type.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = CreateEventEndpointRequest)]
struct NewEndpoint {
    /// `http://` or `https://` with a host name or IPv4 address (no
    /// IPv6 literal, user, query or fragment), at most 2048 characters.
    /// `https://` to a public address unless the operator allows more
    /// (else 422 `endpoint-url-not-allowed`).
    #[schema(value_type = crate::openapi::EndpointUrlSchema)]
    url: String,
    /// Event types to send; absent or `["*"]`: all.
    #[schema(value_type = Option<Vec<crate::openapi::EventTypeSchema>>)]
    event_types: Vec<String>,
}

/// `url` ([`endpoint_url_ok`]) and `event_types` (known types, or absent / `["*"]`
/// for all).
fn parse_endpoint(body: JsonObject) -> Result<NewEndpoint, ApiError> {
    let mut errors = Vec::new();
    for field in body.0.keys() {
        if !matches!(field.as_str(), "url" | "event_types") {
            errors.push(FieldError::new(field, "unknown field"));
        }
    }
    let url = match body.0.get("url") {
        Some(Value::String(url)) if endpoint_url_ok(url) => Some(url.clone()),
        Some(_) => {
            errors.push(FieldError::new(
                "url",
                "must be an http or https URL with a host name or IPv4 address (no IPv6 literal, user, query or fragment), at most 2048 characters",
            ));
            None
        }
        None => {
            errors.push(FieldError::new("url", "is required"));
            None
        }
    };
    let known = event_types();
    let types = match body.0.get("event_types") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => {
            let mut types = Vec::new();
            for item in items {
                match item.as_str() {
                    Some("*") => {}
                    Some(t) if known.iter().any(|k| k == t) => types.push(t.to_owned()),
                    _ => errors.push(FieldError::new("event_types", "unknown event type")),
                }
            }
            if items.iter().any(|i| i == "*") {
                types.clear();
            }
            types
        }
        Some(_) => {
            errors.push(FieldError::new(
                "event_types",
                "must be a list of event types",
            ));
            Vec::new()
        }
    };
    match url {
        Some(url) if errors.is_empty() => Ok(NewEndpoint {
            url,
            event_types: types,
        }),
        _ => Err(ApiError::Validation(errors)),
    }
}

crate::openapi::refusals!(
    /// What `create_endpoint` refuses.
    CreateEndpointRefusals = read [BodyTooLarge, Validation, EndpointUrlNotAllowed]
);

/// Create an event endpoint
///
/// Not money-moving, so no `Idempotency-Key`: a repeated request makes
/// a second endpoint (delete it). The answer carries the signing
/// `secret`, shown only here and in a rotation's answer. The endpoint
/// receives the events written from its creation on.
///
/// The URL must be `https://` and its host a public address, or a name
/// whose every address is public (the operator may allow plain http and
/// list private networks or hosts); otherwise 422
/// `endpoint-url-not-allowed` and nothing is created.
#[utoipa::path(
    post,
    path = "/v1/event_endpoints",
    operation_id = "createEventEndpoint",
    tag = "events",
    request_body(content = NewEndpoint, content_type = "application/json"),
    responses(
        (status = 201, description = "Created, with its secret.", body = EndpointView),
        CreateEndpointRefusals,
    ),
)]
async fn create_endpoint(
    State(state): State<AppState>,
    account: Account,
    body: JsonObject,
) -> Result<Response, ApiError> {
    let endpoint = parse_endpoint(body)?;
    if let Err(reason) = check_endpoint_url(&state.settings.event_endpoints, &endpoint.url).await {
        // The reason names the host and its range, never the URL's path
        // (which may carry a merchant's own token).
        tracing::warn!(account_id = %account.0, reason = %reason, "event endpoint refused");
        return Err(ApiError::EndpointUrlNotAllowed { reason });
    }
    let row = state
        .store
        .create_endpoint(
            account.0,
            &endpoint.url,
            &new_secret(),
            &endpoint.event_types,
            state.clock.now(),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(endpoint_view(&row, true))).into_response())
}

#[derive(Serialize, ToSchema)]
#[schema(as = EventEndpointList)]
struct EndpointList {
    data: Vec<EndpointView>,
}

crate::openapi::refusals!(
    /// What `list_endpoints` refuses.
    ListEndpointsRefusals = read []
);

/// List event endpoints
#[utoipa::path(
    get,
    path = "/v1/event_endpoints",
    operation_id = "listEventEndpoints",
    tag = "events",
    responses(
        (status = 200, description = "The account's endpoints, without secrets.", body = EndpointList),
        ListEndpointsRefusals,
    ),
)]
async fn list_endpoints(
    State(state): State<AppState>,
    account: Account,
) -> Result<Json<EndpointList>, ApiError> {
    let rows = state.store.list_endpoints(Some(account.0)).await?;
    Ok(Json(EndpointList {
        data: rows.iter().map(|r| endpoint_view(r, false)).collect(),
    }))
}

crate::openapi::refusals!(
    /// What `delete_endpoint` and `rotate_secret` refuse.
    EndpointRefusals = read [NotFound]
);

/// Delete an event endpoint
///
/// Its pending deliveries are dropped; the events stay in the feed.
#[utoipa::path(
    delete,
    path = "/v1/event_endpoints/{id}",
    operation_id = "deleteEventEndpoint",
    tag = "events",
    params(("id" = String, Path, format = Uuid, description = "The endpoint id.")),
    responses((status = 204, description = "Deleted."), EndpointRefusals),
)]
async fn delete_endpoint(
    State(state): State<AppState>,
    account: Account,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let id: EndpointId = id.parse().map_err(|_| ApiError::NotFound)?;
    if state.store.delete_endpoint(Some(account.0), id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound)
    }
}

/// Rotate an endpoint's secret
///
/// A new secret signs from now on; the previous one also signs (a
/// second `v1`) for 24 h, so a receiver can switch at its own pace.
#[utoipa::path(
    post,
    path = "/v1/event_endpoints/{id}/rotate_secret",
    operation_id = "rotateEventEndpointSecret",
    tag = "events",
    params(("id" = String, Path, format = Uuid, description = "The endpoint id.")),
    responses(
        (status = 200, description = "The endpoint with its new secret.", body = EndpointView),
        EndpointRefusals,
    ),
)]
async fn rotate_secret(
    State(state): State<AppState>,
    account: Account,
    Path(id): Path<String>,
) -> Result<Json<EndpointView>, ApiError> {
    let id: EndpointId = id.parse().map_err(|_| ApiError::NotFound)?;
    let now = state.clock.now();
    let overlap = chrono::Duration::from_std(ROTATION_OVERLAP).unwrap_or(chrono::Duration::zero());
    let row = state
        .store
        .rotate_endpoint_secret(Some(account.0), id, &new_secret(), now + overlap, now)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok(Json(endpoint_view(&row, true)))
}

#[cfg(test)]
mod url_tests {
    use super::{check_endpoint_url, endpoint_url_ok};
    use cobro_core::egress::{EgressPolicy, Refusal};

    /// The grammar only: a URL it accepts may still be refused by the
    /// egress rule ([`check_endpoint_url`], below).
    #[test]
    fn endpoint_urls_follow_the_documented_grammar() {
        for good in [
            "https://shop.example/cobro",
            "http://localhost:8080/hooks",
            "https://a-b.c1.example:65535",
            "https://x",
            "http://127.0.0.1:4242/hook",
            "http://10.0.0.255",
        ] {
            assert!(endpoint_url_ok(good), "{good}");
        }
        for bad in [
            "",
            "https://",
            "ftp://shop.example",
            "https://127.0.0.256/hook",
            "https://127.0.01/hook",
            "https://1.2.3/hook",
            "https://[::1]/",
            "https://user@shop.example/",
            "https://shop.example/?a=b",
            "https://shop.example:0",
            "https://shop.example:65536",
            "https://shop.example:080",
            "https://shop..example",
            "https://shop.example/a b",
            "https://shop.example/\0",
        ] {
            assert!(!endpoint_url_ok(bad), "{bad}");
        }
    }

    /// The URLs of issue 48, each a way into cobro's own network.
    const INSIDE: &[&str] = &[
        "https://127.0.0.1:8080/internal/admin",
        "https://169.254.169.254/latest/meta-data",
        "https://10.0.0.1:2375/containers/create",
        "https://localhost:6379/",
        "https://192.168.1.1/",
        "https://172.16.0.1/",
        "https://100.64.0.1/",
        "https://0.0.0.0:8080/",
        "https://255.255.255.255/",
        "https://224.0.0.1/",
        "https://198.18.0.1/",
        "https://192.0.2.1/",
        "https://240.0.0.1/",
        "https://api.localhost/hook",
    ];

    #[tokio::test]
    async fn production_refuses_every_url_into_cobros_own_network() {
        let policy = EgressPolicy::default();
        for url in INSIDE {
            assert!(endpoint_url_ok(url), "{url} is well formed");
            let refused = check_endpoint_url(&policy, url).await;
            assert!(
                matches!(
                    refused,
                    Err(Refusal::Address { .. } | Refusal::Localhost { .. })
                ),
                "{url}: {refused:?}"
            );
        }
        for url in INSIDE {
            let http = url.replacen("https://", "http://", 1);
            assert_eq!(
                check_endpoint_url(&policy, &http).await,
                Err(Refusal::PlainHttp),
                "{http}"
            );
        }
        assert_eq!(
            check_endpoint_url(&policy, "https://8.8.8.8/hook").await,
            Ok(())
        );
    }

    #[tokio::test]
    async fn the_allow_list_and_plain_http_are_the_operators_to_give() {
        let policy = EgressPolicy {
            allow_http: true,
            allow: ["127.0.0.1/32", "hooks.internal"]
                .iter()
                .map(|e| e.parse().expect("entry"))
                .collect(),
        };
        for url in [
            "http://127.0.0.1:4242/hook",
            "https://127.0.0.1/hook",
            // A listed name is not resolved: it need not exist in DNS.
            "http://hooks.internal/cobro",
        ] {
            assert_eq!(check_endpoint_url(&policy, url).await, Ok(()), "{url}");
        }
        for url in [
            "http://127.0.0.2:4242/hook",
            "http://10.0.0.1/",
            "http://localhost:4242/",
        ] {
            assert!(check_endpoint_url(&policy, url).await.is_err(), "{url}");
        }
    }

    #[test]
    fn generated_endpoint_secrets_are_far_above_the_minimum() {
        let secret = super::new_secret();
        assert!(secret.len() >= 4 * cobro_core::signature::MIN_SECRET_BYTES);
        assert_eq!(cobro_core::signature::check_secret_length(&secret), Ok(()));
        assert_ne!(secret, super::new_secret());
    }

    #[tokio::test]
    async fn a_name_that_does_not_resolve_is_refused() {
        let refused = check_endpoint_url(
            &EgressPolicy::default(),
            "https://no-such-host.invalid/hook",
        )
        .await;
        assert_eq!(
            refused,
            Err(Refusal::Unresolved {
                host: "no-such-host.invalid".into()
            })
        );
    }
}
