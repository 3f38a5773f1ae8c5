//! Routing across providers at the API (docs/routing.md): the route of a
//! new payment, decided before its transaction from the account's rules
//! and the circuits (both read at most every few seconds, never inside
//! the create's transaction), and the account's rules over HTTP
//! (`/v1/routing`).

use crate::error::{ApiError, FieldError};
use crate::extract::{Account, JsonObject};
use crate::{AppState, openapi};
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use cobro_core::routing::{Facts, Route, RuleSet};
use cobro_core::{AccountId, PaymentId};
use cobro_settle::routing::Circuits;
use cobro_store::StoreError;
use serde::Serialize;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// How many accounts' rules a process remembers.
const CAPACITY: usize = 10_000;

/// What the deployment routes across.
#[derive(Clone, Debug, Default)]
pub struct RoutingSettings {
    /// Every provider this deployment has (the providers file's names).
    /// Empty: no routing; a payment goes to its account's provider or
    /// the default one, as before migration 0023.
    pub providers: Vec<String>,
    /// The chain of an account with neither rules nor a provider of its
    /// own (the providers file's `routing.default`, else the default
    /// provider alone).
    pub default_chain: Vec<String>,
    /// How long an account's rules are trusted once read: a change made
    /// in another process applies within this bound.
    pub rules_ttl: Duration,
}

#[derive(Clone)]
enum Profile {
    Rules(Arc<RuleSet>),
    /// The account names one provider (migration 0010).
    Single(String),
    /// The deployment's default chain.
    Default,
}

/// Routes new payments.
pub struct Router {
    settings: RoutingSettings,
    circuits: Arc<Circuits>,
    profiles: quick_cache::sync::Cache<AccountId, (DateTime<Utc>, Profile)>,
}

impl Router {
    pub fn new(settings: RoutingSettings, circuits: Arc<Circuits>) -> Self {
        Self {
            settings,
            circuits,
            profiles: quick_cache::sync::Cache::new(CAPACITY),
        }
    }

    fn known(&self) -> impl Fn(&str) -> bool + '_ {
        |p: &str| self.settings.providers.iter().any(|x| x == p)
    }

    async fn profile(
        &self,
        state: &AppState,
        account: AccountId,
        now: DateTime<Utc>,
    ) -> Result<Profile, ApiError> {
        if let Some((read_at, profile)) = self.profiles.get(&account)
            && now >= read_at
            && (now - read_at)
                .to_std()
                .is_ok_and(|age| age < self.settings.rules_ttl)
        {
            return Ok(profile);
        }
        let stored = state.store.routing_profile(account).await?;
        let profile = match (stored.rules, stored.provider) {
            (Some((rules, _)), _) => {
                // Validated when set and at start; a rule set that no
                // longer parses is a corrupt row, never a silent default.
                let set = RuleSet::parse(&rules, &self.known()).map_err(|e| {
                    ApiError::internal(StoreError::Corrupt(format!(
                        "routing rules of account {account}: {e}"
                    )))
                })?;
                Profile::Rules(Arc::new(set))
            }
            (None, Some(provider)) => Profile::Single(provider),
            (None, None) => Profile::Default,
        };
        if !self.settings.rules_ttl.is_zero() {
            self.profiles.insert(account, (now, profile.clone()));
        }
        Ok(profile)
    }

    /// The provider of a new payment's first attempt and its route;
    /// `None` when this deployment does not route.
    pub async fn route(
        &self,
        state: &AppState,
        account: AccountId,
        payment: PaymentId,
        facts: &Facts<'_>,
    ) -> Result<Option<(String, Route)>, ApiError> {
        if self.settings.providers.is_empty() {
            return Ok(None);
        }
        let now = state.clock.now();
        let open = self.circuits.open().await;
        let is_open = |p: &str| open.contains(p);
        let route = match self.profile(state, account, now).await? {
            Profile::Rules(set) => set.route(facts, payment.as_uuid().as_u128(), &is_open),
            Profile::Single(provider) => Route::single(&provider, "the account's provider"),
            Profile::Default => {
                let set = RuleSet {
                    rules: Vec::new(),
                    default: self.settings.default_chain.clone(),
                };
                let mut route = set.route(facts, 0, &is_open);
                route.reason = route.reason.replace(
                    "no rule matched: the account's default",
                    "the deployment's default",
                );
                route
            }
        };
        let Some(first) = route.chain.first().cloned() else {
            return Ok(None);
        };
        cobro_telemetry::metrics::routing_decision(&first);
        Ok(Some((first, route)))
    }

    /// Forgets what this process read of `account`'s rules.
    fn forget(&self, account: AccountId) {
        self.profiles.remove(&account);
    }
}

pub(crate) fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(get_routing, put_routing, delete_routing))
}

/// An account's routing rules, and what they route across.
#[derive(Serialize, ToSchema)]
struct RoutingRulesView {
    /// The rule set (see docs/routing.md); `null`: the account has none,
    /// and its payments follow `default`.
    #[schema(value_type = Option<Object>)]
    rules: Option<Value>,
    /// Counts the changes of the account's rules; 0: never set.
    version: i64,
    /// The providers a rule may name.
    providers: Vec<String>,
    /// The chain of a payment of this account when it has no rules.
    default: Vec<String>,
}

async fn view(state: &AppState, account: AccountId) -> Result<RoutingRulesView, ApiError> {
    let profile = state.store.routing_profile(account).await?;
    let default = match &profile.provider {
        Some(p) => vec![p.clone()],
        None => state.routing.settings.default_chain.clone(),
    };
    let (rules, version) = match profile.rules {
        Some((text, version)) => (
            Some(serde_json::from_str(&text).map_err(ApiError::internal)?),
            version,
        ),
        None => (None, 0),
    };
    Ok(RoutingRulesView {
        rules,
        version,
        providers: state.routing.settings.providers.clone(),
        default,
    })
}

/// An account an operator pinned to one provider (`cobro accounts create
/// --provider`) keeps it: its token cannot route its payments elsewhere
/// (providers may be different merchants' contracts); its routing is the
/// operator's (`cobro routing set`).
async fn refuse_pinned(state: &AppState, account: AccountId) -> Result<(), ApiError> {
    match state.store.routing_profile(account).await?.provider {
        Some(provider) => Err(ApiError::Validation(vec![FieldError::new(
            "body",
            format!(
                "this account is pinned to provider {provider:?} by an operator; \
                 its routing is changed by an operator (cobro routing set)"
            ),
        )])),
        None => Ok(()),
    }
}

openapi::refusals!(
    /// What `get_routing` refuses.
    GetRoutingRefusals = read []
);

/// Show the account's routing rules
#[utoipa::path(
    get,
    path = "/v1/routing",
    operation_id = "getRouting",
    tag = "routing",
    responses(
        (status = 200, description = "The account's rules and what they route across.", body = RoutingRulesView),
        GetRoutingRefusals,
    ),
)]
async fn get_routing(
    State(state): State<AppState>,
    account: Account,
) -> Result<Response, ApiError> {
    Ok(Json(view(&state, account.0).await?).into_response())
}

openapi::refusals!(
    /// What `put_routing` refuses.
    PutRoutingRefusals = read [BodyTooLarge, Validation]
);

/// Set the account's routing rules
///
/// Replaces the rules as a whole; validated against the providers this
/// deployment has (400 `validation-error` naming the problem, and nothing
/// changes). New payments follow them within a few seconds in every
/// process; payments already created keep their route. Not money-moving,
/// so no `Idempotency-Key`: the same rules twice are the same rules.
#[utoipa::path(
    put,
    path = "/v1/routing",
    operation_id = "putRouting",
    tag = "routing",
    request_body(content = Object, content_type = "application/json",
        description = "{\"rules\": [{\"name\", \"when\": {\"currencies\", \"amount_min\", \"amount_max\", \"capture_method\", \"payment_methods\", \"brands\"}, \"providers\": [...], \"weights\": {...}}], \"default\": [...]}"),
    responses(
        (status = 200, description = "The rules now in force.", body = RoutingRulesView),
        PutRoutingRefusals,
    ),
)]
async fn put_routing(
    State(state): State<AppState>,
    account: Account,
    body: JsonObject,
) -> Result<Response, ApiError> {
    refuse_pinned(&state, account.0).await?;
    let text = Value::Object(body.0).to_string();
    let set = RuleSet::parse(&text, &state.routing.known())
        .map_err(|e| ApiError::Validation(vec![FieldError::new("body", e.to_string())]))?;
    let canonical = serde_json::to_string(&set).map_err(ApiError::internal)?;
    state
        .store
        .set_routing_rules(account.0, Some(&canonical), "api", state.clock.now())
        .await?;
    state.routing.forget(account.0);
    tracing::info!(account_id = %account.0, rules = set.rules.len(), "routing rules set");
    Ok(Json(view(&state, account.0).await?).into_response())
}

openapi::refusals!(
    /// What `delete_routing` refuses.
    DeleteRoutingRefusals = read [Validation]
);

/// Remove the account's routing rules
///
/// Its new payments follow the default chain again.
#[utoipa::path(
    delete,
    path = "/v1/routing",
    operation_id = "deleteRouting",
    tag = "routing",
    responses(
        (status = 200, description = "The account without rules.", body = RoutingRulesView),
        DeleteRoutingRefusals,
    ),
)]
async fn delete_routing(
    State(state): State<AppState>,
    account: Account,
) -> Result<Response, ApiError> {
    refuse_pinned(&state, account.0).await?;
    state
        .store
        .set_routing_rules(account.0, None, "api", state.clock.now())
        .await?;
    state.routing.forget(account.0);
    Ok(Json(view(&state, account.0).await?).into_response())
}
