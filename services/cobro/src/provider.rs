//! The provider registry: every provider this deployment sends to, with its
//! kind, where it is, its secrets and its documented contract, and the
//! default one for accounts that name none. The worker's key window and
//! the reconciler's "not found" rule read the contract of the provider an
//! attempt went to.
//!
//! Two sources, one result ([`Registry`]):
//! - `COBRO_PROVIDERS_FILE` (`--providers-file`): a TOML file, read and
//!   validated at start ([`Registry::parse`]; its format is in README.md,
//!   "Configuration");
//! - without it, today's environment (`COBRO_PROVIDER_URL`,
//!   `COBRO_PROVIDER_API_KEY`, `COBRO_PROVIDER_KEY_RETENTION`,
//!   `COBRO_PROVIDER_SEARCH_LAG`, `COBRO_WEBHOOK_SECRET`, ...) defines the
//!   one provider [`ENV_PROVIDER`] (kind `fake`), exactly as before; no URL
//!   there means the embedded fake provider in `serve`.
//!
//! [`connect`] turns a registry into clients ([`Connector`]), starting the
//! embedded fake provider when the environment asks for it.

use crate::settings::{
    BooksSettings, KeyWindowSettings, ProviderSettings, ReconcileSettings, parse_duration,
};
use anyhow::{Context, bail};
use cobro_provider::{
    Connector, Credentials, HttpProvider, HttpProviderConfig, Provider, StripeConfig,
    StripeProvider, StripeSecretKey, WebhookSecret,
};
use cobro_reconciler::ReconcilerConfig;
use cobro_store::ProviderScope;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The name of the single provider the environment defines (no providers
/// file), and of the provider of rows older than migration 0010.
pub const ENV_PROVIDER: &str = "fake";

/// The length of every provider idempotency key cobro makes (a hyphenated
/// UUID): checked against each provider's documented maximum at start.
pub const PROVIDER_KEY_LENGTH: usize = 36;

/// What a provider is, which decides its client and its webhook scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderKind {
    /// cobro's own fake provider's API (`fake-provider/`), JSON over HTTP.
    Fake,
    /// Stripe's API (Stripe itself, the fake provider's Stripe dialect, or
    /// localstripe).
    Stripe,
}

impl ProviderKind {
    fn parse(text: &str) -> Option<Self> {
        match text {
            "fake" => Some(ProviderKind::Fake),
            "stripe" => Some(ProviderKind::Stripe),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Fake => "fake",
            ProviderKind::Stripe => "stripe",
        }
    }

    /// The contract as the provider documents it, used where the file
    /// says nothing.
    fn documented(self) -> Contract {
        match self {
            // fake-provider/README.md: keys per API key, 24 h by default.
            ProviderKind::Fake => Contract {
                key_retention: Duration::from_secs(24 * 3600),
                key_safety_margin: Duration::from_secs(3600),
                search_lag: Duration::from_secs(60),
                clock_skew: Duration::from_secs(10),
                request_timeout: Duration::from_secs(10),
                connect_timeout: Duration::from_secs(2),
                idempotency_key_max_length: 255,
                idempotency_key_scope: "per API key".into(),
            },
            // Stripe: keys are kept at least 24 hours, per account and mode
            // (test/live), up to 255 characters; the Search API is
            // eventually consistent, "up to a minute" under normal load.
            ProviderKind::Stripe => Contract {
                key_retention: Duration::from_secs(24 * 3600),
                key_safety_margin: Duration::from_secs(3600),
                search_lag: Duration::from_secs(60),
                clock_skew: Duration::from_secs(10),
                request_timeout: Duration::from_secs(30),
                connect_timeout: Duration::from_secs(2),
                idempotency_key_max_length: 255,
                idempotency_key_scope: "per Stripe account and mode (test or live)".into(),
            },
        }
    }
}

/// What a provider promises, which bounds what cobro may do with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Contract {
    /// How long the provider remembers an idempotency key: no send later
    /// than first send + this - `key_safety_margin`.
    pub key_retention: Duration,
    /// Kept before the end of the key window.
    pub key_safety_margin: Duration,
    /// How far the provider's search may lag behind (documentation, shown
    /// in the logs at start): no proof depends on it, since a search that
    /// finds nothing never proves absence (docs/proof-of-absence.md).
    pub search_lag: Duration,
    /// The clock skew allowed between cobro's hosts, its database and the
    /// provider: the window a consistent list must cover is widened by it
    /// on both sides.
    pub clock_skew: Duration,
    /// A whole call; after it the outcome is unknown.
    pub request_timeout: Duration,
    /// A connection; a failure here proves nothing was sent.
    pub connect_timeout: Duration,
    /// The longest idempotency key the provider takes.
    pub idempotency_key_max_length: usize,
    /// Whose keys collide (documentation, shown in the logs at start):
    /// two deployments sharing one API key share one key space.
    pub idempotency_key_scope: String,
}

/// A secret read from the environment or a file. `Debug` shows `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the client that sends it; never for logs.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// One configured provider, validated.
#[derive(Clone, Debug)]
pub struct ProviderSpec {
    /// Its name: what accounts, payments and attempts record, and the
    /// `{provider}` of `POST /v1/webhooks/{provider}`.
    pub name: String,
    pub kind: ProviderKind,
    /// `None`: the embedded fake provider (environment setup of `serve`).
    pub base_url: Option<String>,
    /// cobro's API key there (it scopes the provider's idempotency keys).
    pub secret: Secret,
    /// The webhook signing secret; `None`: its webhooks are refused (404).
    pub webhook_secret: Option<WebhookSecret>,
    /// The previous signing secret while rotating.
    pub webhook_secret_previous: Option<WebhookSecret>,
    pub contract: Contract,
}

impl ProviderSpec {
    /// How long the provider may still act on a request after it reached
    /// it: its key retention, since no provider acts on a request whose key
    /// it has forgotten. For Stripe that is its documented 24 h; a shorter
    /// `key_retention` (which tests use against the fake's Stripe dialect,
    /// whose retention is a setting) is taken at its word, with a warning
    /// at start-up ([`Registry::parse`]).
    pub fn request_lifetime(&self) -> Duration {
        self.contract.key_retention
    }
}

/// Every configured provider and the default one.
#[derive(Clone, Debug)]
pub struct Registry {
    providers: Vec<ProviderSpec>,
    default: String,
    /// Defined by the environment, not a providers file.
    from_env: bool,
    /// The file's `[routing]` table (docs/routing.md).
    routing: RoutingSpec,
}

/// What the providers file says about routing across its providers.
#[derive(Clone, Debug)]
pub struct RoutingSpec {
    /// The chain of an account with neither rules nor a provider of its
    /// own; `[default_provider]` when the file gives none.
    pub default_chain: Vec<String>,
    /// When a provider's circuit opens, and for how long.
    pub breaker: cobro_settle::routing::BreakerPolicy,
}

impl Registry {
    /// The registry of `settings`: the providers file when one is set,
    /// else the environment's single provider ([`Registry::from_env`]).
    pub fn load(
        settings: &ProviderSettings,
        window: Option<&KeyWindowSettings>,
        reconcile: Option<&ReconcileSettings>,
    ) -> anyhow::Result<Self> {
        let Some(path) = &settings.file.providers_file else {
            return Ok(Self::from_env(settings, window, reconcile));
        };
        if settings.provider_url.is_some() {
            bail!(
                "COBRO_PROVIDERS_FILE and COBRO_PROVIDER_URL are both set: the file names every provider; unset COBRO_PROVIDER_URL"
            );
        }
        Self::read(path)
    }

    /// Reads and validates the providers file at `path`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("could not read the providers file {}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, dir, &|name| std::env::var(name).ok())
            .with_context(|| format!("the providers file {} is invalid", path.display()))
    }

    /// The environment's single provider [`ENV_PROVIDER`], as cobro had
    /// before the providers file.
    pub fn from_env(
        settings: &ProviderSettings,
        window: Option<&KeyWindowSettings>,
        reconcile: Option<&ReconcileSettings>,
    ) -> Self {
        let mut contract = ProviderKind::Fake.documented();
        if let Some(window) = window {
            contract.key_retention = window.provider_key_retention;
            contract.key_safety_margin = window.provider_key_safety_margin;
        }
        contract.request_timeout = settings.provider_timeout;
        contract.connect_timeout = settings.provider_connect_timeout;
        if let Some(reconcile) = reconcile {
            contract.search_lag = reconcile.provider_search_lag;
            contract.clock_skew = reconcile.provider_clock_skew;
        }
        Self {
            providers: vec![ProviderSpec {
                name: ENV_PROVIDER.to_owned(),
                kind: ProviderKind::Fake,
                base_url: settings.provider_url.clone(),
                secret: Secret::new(settings.provider_api_key.clone()),
                webhook_secret: None,
                webhook_secret_previous: None,
                contract,
            }],
            default: ENV_PROVIDER.to_owned(),
            from_env: true,
            routing: RoutingSpec {
                default_chain: vec![ENV_PROVIDER.to_owned()],
                breaker: cobro_settle::routing::BreakerPolicy::default(),
            },
        }
    }

    /// Parses and validates a providers file's text. `dir` resolves
    /// relative `*_file` paths; `env` reads `*_env` variables.
    pub fn parse(
        text: &str,
        dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Self> {
        let file: File = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        if file.provider.is_empty() {
            bail!("no provider is defined: add a [[provider]] table");
        }
        let mut names = BTreeSet::new();
        let mut providers = Vec::new();
        for entry in file.provider {
            if !names.insert(entry.name.clone()) {
                bail!("two providers are named `{}`", entry.name);
            }
            let name = entry.name.clone();
            providers.push(
                entry
                    .validate(dir, env)
                    .with_context(|| format!("provider `{name}`"))?,
            );
        }
        let default = match file.default_provider {
            Some(name) if names.contains(&name) => name,
            Some(name) => bail!(
                "default_provider = `{name}` is not defined (the providers are {})",
                names.into_iter().collect::<Vec<_>>().join(", ")
            ),
            None if providers.len() == 1 => providers[0].name.clone(),
            None => bail!("default_provider is missing: with several providers, name the default"),
        };
        let routing = file
            .routing
            .unwrap_or_default()
            .validate(&names, &default)
            .context("[routing]")?;
        Ok(Self {
            providers,
            default,
            from_env: false,
            routing,
        })
    }

    /// How far a host's clock may be from the database's: half the smallest
    /// `clock_skew` of the providers (the other half is the provider's).
    pub fn clock_bound(&self) -> Duration {
        self.providers
            .iter()
            .map(|p| p.contract.clock_skew / 2)
            .min()
            .unwrap_or(Duration::from_secs(5))
    }

    pub fn providers(&self) -> &[ProviderSpec] {
        &self.providers
    }

    pub fn get(&self, name: &str) -> Option<&ProviderSpec> {
        self.providers.iter().find(|p| p.name == name)
    }

    pub fn default_name(&self) -> &str {
        &self.default
    }

    /// What new payments are routed across, and the breaker's policy.
    pub fn routing(&self) -> &RoutingSpec {
        &self.routing
    }

    /// The API's routing settings for these providers; an account's rules
    /// are trusted for `rules_ttl` once read.
    pub fn routing_settings(&self, rules_ttl: Duration) -> cobro_api::routing::RoutingSettings {
        cobro_api::routing::RoutingSettings {
            providers: self.providers.iter().map(|p| p.name.clone()).collect(),
            default_chain: self.routing.default_chain.clone(),
            rules_ttl,
        }
    }

    /// Whether `name` is one of the providers.
    pub fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// The provider a row names, `None` (older than 0010, or created
    /// without a default) being the default provider.
    pub fn of_row(&self, provider: Option<&str>) -> anyhow::Result<&ProviderSpec> {
        let name = provider.unwrap_or(&self.default);
        self.get(name).with_context(|| {
            format!(
                "the provider `{name}` is not configured (COBRO_PROVIDERS_FILE defines {})",
                self.names()
            )
        })
    }

    /// The rows `spec`'s worker claims and its reconciler examines.
    pub fn scope(&self, spec: &ProviderSpec) -> ProviderScope {
        ProviderScope {
            name: spec.name.clone(),
            is_default: spec.name == self.default,
        }
    }

    /// The names, for error messages.
    pub fn names(&self) -> String {
        self.providers
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The environment's provider, to give it `COBRO_WEBHOOK_SECRET*`;
    /// `None` when a providers file defined the registry.
    pub fn env_provider_mut(&mut self) -> Option<&mut ProviderSpec> {
        if !self.from_env {
            return None;
        }
        self.providers.first_mut()
    }

    /// Whether `serve` must start the embedded fake provider.
    pub fn wants_embedded(&self) -> bool {
        self.providers.iter().any(|p| p.base_url.is_none())
    }
}

/// The provider names `file` defines (without reading any secret), or the
/// environment's [`ENV_PROVIDER`] without a file: what `cobro accounts
/// create --provider` may name, on a machine that need not hold the keys.
pub fn provider_names(file: Option<&Path>) -> anyhow::Result<Vec<String>> {
    let Some(path) = file else {
        return Ok(vec![ENV_PROVIDER.to_owned()]);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("could not read the providers file {}", path.display()))?;
    let file: File = toml::from_str(&text)
        .map_err(|e| anyhow::anyhow!("the providers file {} is invalid: {e}", path.display()))?;
    Ok(file.provider.into_iter().map(|p| p.name).collect())
}

/// The providers file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    default_provider: Option<String>,
    #[serde(default)]
    provider: Vec<FileProvider>,
    routing: Option<FileRouting>,
}

/// The `[routing]` table as written (docs/routing.md).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRouting {
    /// The chain of accounts without rules or a provider of their own.
    default: Option<Vec<String>>,
    /// The breaker: the window errors are counted over, the fewest calls
    /// that may open a circuit, the share of failed calls that opens it,
    /// and how long it stays open before it is half-open.
    breaker_window: Option<String>,
    breaker_min_calls: Option<i64>,
    breaker_error_rate: Option<f64>,
    breaker_cool_down: Option<String>,
}

impl FileRouting {
    fn validate(self, names: &BTreeSet<String>, default: &str) -> anyhow::Result<RoutingSpec> {
        let default_chain = self.default.unwrap_or_else(|| vec![default.to_owned()]);
        let set = cobro_core::routing::RuleSet {
            rules: Vec::new(),
            default: default_chain.clone(),
        };
        set.validate(&|p| names.contains(p))
            .map_err(|e| anyhow::anyhow!("default: {e}"))?;
        let mut breaker = cobro_settle::routing::BreakerPolicy::default();
        if let Some(text) = &self.breaker_window {
            breaker.window =
                parse_duration(text).map_err(|e| anyhow::anyhow!("breaker_window: {e}"))?;
        }
        if let Some(text) = &self.breaker_cool_down {
            breaker.cool_down =
                parse_duration(text).map_err(|e| anyhow::anyhow!("breaker_cool_down: {e}"))?;
        }
        if let Some(n) = self.breaker_min_calls {
            if n < 1 {
                bail!("breaker_min_calls is at least 1");
            }
            breaker.min_calls = n;
        }
        if let Some(rate) = self.breaker_error_rate {
            if !(rate > 0.0 && rate <= 1.0) {
                bail!("breaker_error_rate is above 0 and at most 1");
            }
            breaker.error_rate = rate;
        }
        if breaker.window.is_zero() || breaker.cool_down.is_zero() {
            bail!("breaker_window and breaker_cool_down are longer than zero");
        }
        Ok(RoutingSpec {
            default_chain,
            breaker,
        })
    }
}

/// One `[[provider]]` table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileProvider {
    name: String,
    kind: String,
    base_url: String,
    secret_env: Option<String>,
    secret_file: Option<PathBuf>,
    webhook_secret_env: Option<String>,
    webhook_secret_file: Option<PathBuf>,
    webhook_secret_previous_env: Option<String>,
    webhook_secret_previous_file: Option<PathBuf>,
    key_retention: Option<String>,
    key_safety_margin: Option<String>,
    search_lag: Option<String>,
    clock_skew: Option<String>,
    request_timeout: Option<String>,
    connect_timeout: Option<String>,
    idempotency_key_max_length: Option<usize>,
    idempotency_key_scope: Option<String>,
}

impl FileProvider {
    fn validate(
        self,
        dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> anyhow::Result<ProviderSpec> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 64
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !name_ok {
            bail!("the name must be 1 to 64 of a-z, 0-9, `-` and `_` (it is a URL path segment)");
        }
        let kind = ProviderKind::parse(&self.kind).with_context(|| {
            format!("unknown kind `{}`: expected `fake` or `stripe`", self.kind)
        })?;
        url::Url::parse(&self.base_url)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https"))
            .with_context(|| format!("base_url `{}` is not an http(s) URL", self.base_url))?;
        let secret = read_secret(
            "secret",
            self.secret_env.as_deref(),
            self.secret_file.as_deref(),
            dir,
            env,
        )?
        .context("its API key is missing: set secret_env or secret_file")?;
        let webhook_secret = read_webhook_secret(
            "webhook_secret",
            self.webhook_secret_env.as_deref(),
            self.webhook_secret_file.as_deref(),
            dir,
            env,
        )?;
        let webhook_secret_previous = read_webhook_secret(
            "webhook_secret_previous",
            self.webhook_secret_previous_env.as_deref(),
            self.webhook_secret_previous_file.as_deref(),
            dir,
            env,
        )?;
        if webhook_secret_previous.is_some() && webhook_secret.is_none() {
            bail!("webhook_secret_previous needs webhook_secret (the new one)");
        }
        let mut contract = kind.documented();
        for (field, value, into) in [
            (
                "key_retention",
                &self.key_retention,
                &mut contract.key_retention,
            ),
            (
                "key_safety_margin",
                &self.key_safety_margin,
                &mut contract.key_safety_margin,
            ),
            ("search_lag", &self.search_lag, &mut contract.search_lag),
            ("clock_skew", &self.clock_skew, &mut contract.clock_skew),
            (
                "request_timeout",
                &self.request_timeout,
                &mut contract.request_timeout,
            ),
            (
                "connect_timeout",
                &self.connect_timeout,
                &mut contract.connect_timeout,
            ),
        ] {
            if let Some(text) = value {
                *into = parse_duration(text).map_err(|e| anyhow::anyhow!("{field}: {e}"))?;
            }
        }
        if let Some(max) = self.idempotency_key_max_length {
            contract.idempotency_key_max_length = max;
        }
        if let Some(scope) = self.idempotency_key_scope {
            contract.idempotency_key_scope = scope;
        }
        if contract.key_safety_margin >= contract.key_retention {
            bail!("key_safety_margin must be shorter than key_retention");
        }
        if contract.idempotency_key_max_length < PROVIDER_KEY_LENGTH {
            bail!(
                "idempotency_key_max_length {} is below the {PROVIDER_KEY_LENGTH} characters of cobro's keys",
                contract.idempotency_key_max_length
            );
        }
        // A provider forgets a key after its retention: a resend later
        // than that would make a new charge. Retention beyond what the
        // kind documents is refused (the fake's is its own setting).
        let documented = kind.documented().key_retention;
        if kind == ProviderKind::Stripe && contract.key_retention < documented {
            tracing::warn!(
                provider = %self.name,
                key_retention = %humantime::format_duration(contract.key_retention),
                "key_retention is shorter than the 24 h Stripe keeps idempotency keys: cobro also takes it as the longest a request may live at Stripe, and proves a send without effect that much sooner; keep it at 24 h against Stripe itself"
            );
        }
        if kind == ProviderKind::Stripe && contract.key_retention > documented {
            bail!(
                "key_retention {} is longer than the {} Stripe keeps idempotency keys: a resend past it would create a new PaymentIntent",
                humantime::format_duration(contract.key_retention),
                humantime::format_duration(documented)
            );
        }
        Ok(ProviderSpec {
            name: self.name,
            kind,
            base_url: Some(self.base_url.trim_end_matches('/').to_owned()),
            secret: Secret::new(secret.expose()),
            webhook_secret: webhook_secret.map(|s| WebhookSecret::new(s.expose())),
            webhook_secret_previous: webhook_secret_previous
                .map(|s| WebhookSecret::new(s.expose())),
            contract,
        })
    }
}

/// A secret named by `{field}_env` or `{field}_file` (not both); `None`
/// when neither is set. An empty value is refused, and the value is never
/// part of an error.
fn read_secret(
    field: &str,
    from_env: Option<&str>,
    from_file: Option<&Path>,
    dir: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<Secret>> {
    let value = match (from_env, from_file) {
        (Some(_), Some(_)) => bail!("set {field}_env or {field}_file, not both"),
        (None, None) => return Ok(None),
        (Some(var), None) => {
            env(var).with_context(|| format!("{field}_env: the variable {var} is not set"))?
        }
        (None, Some(path)) => {
            let path = dir.join(path);
            std::fs::read_to_string(&path)
                .with_context(|| format!("{field}_file: could not read {}", path.display()))?
        }
    };
    let value = value.trim();
    if value.is_empty() {
        bail!("{field} is empty");
    }
    Ok(Some(Secret::new(value)))
}

/// A webhook signing secret of the file, [`read_secret`] and at least
/// `cobro_core::signature::MIN_SECRET_BYTES` long.
fn read_webhook_secret(
    field: &str,
    from_env: Option<&str>,
    from_file: Option<&Path>,
    dir: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<Secret>> {
    let secret = read_secret(field, from_env, from_file, dir, env)?;
    if let Some(secret) = &secret
        && let Err(weak) = cobro_core::signature::check_secret_length(secret.expose())
    {
        bail!("{field} {weak}: use the webhook signing secret the provider gave");
    }
    Ok(secret)
}

/// The clients of a registry, and the embedded fake provider if one was
/// started (kept alive as long as this value).
pub struct ProviderHandle {
    pub registry: Registry,
    pub clients: Vec<(ProviderSpec, Connector)>,
    pub embedded: Option<fake_provider::Running>,
}

impl ProviderHandle {
    /// The client of the provider `name`.
    pub fn client(&self, name: &str) -> Option<&Connector> {
        self.clients
            .iter()
            .find(|(spec, _)| spec.name == name)
            .map(|(_, client)| client)
    }

    /// The client of the provider a row names (`None`: the default).
    pub fn client_of_row(&self, provider: Option<&str>) -> anyhow::Result<&Connector> {
        let spec = self.registry.of_row(provider)?;
        self.client(&spec.name)
            .with_context(|| format!("no client for the provider `{}`", spec.name))
    }
}

/// How many events the embedded fake provider delivers to `serve` at once.
/// A real provider sends many at once; with one at a time, each waiting for
/// its commit, webhooks fall behind as soon as payments pass a few hundred
/// per second, and their queue grows in the process's memory.
const EMBEDDED_WEBHOOK_CONCURRENCY: usize = 16;

/// Builds a client for every provider of `registry`. A provider without a
/// URL is the embedded fake provider: started when `embedded` allows it
/// (`serve`), refused otherwise.
pub async fn connect(mut registry: Registry, embedded: bool) -> anyhow::Result<ProviderHandle> {
    let mut running = None;
    if registry.wants_embedded() {
        if !embedded {
            bail!(
                "no provider configured: set COBRO_PROVIDER_URL (or --provider-url), or COBRO_PROVIDERS_FILE"
            );
        }
        let retention = registry
            .providers
            .iter()
            .find(|p| p.base_url.is_none())
            .map(|p| p.contract.key_retention)
            .unwrap_or(Duration::from_secs(24 * 3600));
        let fake = fake_provider::start(fake_provider::Config {
            retention,
            admin: true,
            webhook_concurrency: EMBEDDED_WEBHOOK_CONCURRENCY,
            ..Default::default()
        })
        .await
        .context("could not start the embedded fake provider")?;
        tracing::warn!(
            url = %fake.url(),
            "EMBEDDED FAKE PROVIDER: no real money moves; set COBRO_PROVIDER_URL or COBRO_PROVIDERS_FILE for a real provider"
        );
        for spec in registry
            .providers
            .iter_mut()
            .filter(|p| p.base_url.is_none())
        {
            spec.base_url = Some(fake.url());
        }
        running = Some(fake);
    }
    let mut clients = Vec::new();
    for spec in &registry.providers {
        let client = client(spec).with_context(|| {
            format!("could not build the client of the provider `{}`", spec.name)
        })?;
        tracing::info!(
            provider = %spec.name,
            kind = spec.kind.as_str(),
            default = spec.name == registry.default,
            key_retention = ?spec.contract.key_retention,
            search_lag = ?spec.contract.search_lag,
            request_timeout = ?spec.contract.request_timeout,
            idempotency_key_scope = %spec.contract.idempotency_key_scope,
            "provider configured"
        );
        check_credentials(spec, &client).await?;
        clients.push((spec.clone(), client));
    }
    Ok(ProviderHandle {
        registry,
        clients,
        embedded: running,
    })
}

/// Asks the provider once whether it accepts cobro's key: a refusal
/// (401/403) stops the start with what to fix, instead of every send being
/// refused until the key window closes; a provider that cannot be asked
/// now (down, slow) is only a warning, as an outage later would be.
async fn check_credentials(spec: &ProviderSpec, client: &Connector) -> anyhow::Result<()> {
    match client.check_credentials().await {
        Credentials::Accepted => Ok(()),
        Credentials::Refused(why) => bail!(
            "the provider `{}` refused cobro's credentials: {why}; fix its key (the providers file, or COBRO_PROVIDER_API_KEY) and start again",
            spec.name
        ),
        Credentials::Unknown(why) => {
            tracing::warn!(provider = %spec.name, why, "could not check the provider's credentials at start-up");
            Ok(())
        }
    }
}

/// The client of one provider (whose URL is known).
pub fn client(spec: &ProviderSpec) -> anyhow::Result<Connector> {
    let url = spec
        .base_url
        .clone()
        .context("the provider has no base URL")?;
    Ok(match spec.kind {
        ProviderKind::Fake => {
            let mut config = HttpProviderConfig::new(url, spec.secret.expose());
            config.connect_timeout = spec.contract.connect_timeout;
            config.request_timeout = spec.contract.request_timeout;
            config.name = spec.name.clone();
            Connector::Fake(HttpProvider::new(config)?)
        }
        ProviderKind::Stripe => {
            let mut config = StripeConfig::new(url, StripeSecretKey::new(spec.secret.expose()));
            config.connect_timeout = spec.contract.connect_timeout;
            config.request_timeout = spec.contract.request_timeout;
            config.name = spec.name.clone();
            Connector::Stripe(StripeProvider::new(config)?)
        }
    })
}

/// How `spec`'s webhooks are received at `/v1/webhooks/{name}`, if it has
/// a signing secret: the scheme of its kind.
pub fn webhook_receiver(spec: &ProviderSpec) -> Option<cobro_api::WebhookReceiver> {
    let secret = spec.webhook_secret.clone()?;
    let receiver = match spec.kind {
        ProviderKind::Fake => cobro_api::WebhookReceiver::fake(secret),
        ProviderKind::Stripe => cobro_api::WebhookReceiver::stripe(secret),
    };
    Some(cobro_api::WebhookReceiver {
        previous: spec.webhook_secret_previous.clone(),
        ..receiver
    })
}

// The reconciler's and the books' configuration of one provider: the
// operator's settings joined to that provider's contract (kept here, beside
// the contract, so that settings.rs need not know providers).

impl ReconcileSettings {
    /// The reconciler's configuration: these settings, the provider's
    /// timeout (a send may reach the provider until then) and who decides
    /// (`reconciler:<pid>` or `operator:<user>`, for the audit trail).
    ///
    /// One reconciler per provider: it examines only the attempts sent to
    /// `provider` (`scope`) and applies that provider's clock skew,
    /// request timeout, key retention (as the longest a request may live
    /// at the provider) and key window to its "not found" rule.
    pub fn config(
        &self,
        provider: &ProviderSpec,
        scope: cobro_store::ProviderScope,
        actor: String,
    ) -> ReconcilerConfig {
        ReconcilerConfig {
            actor,
            clock_skew: provider.contract.clock_skew,
            stuck_after: self.reconcile_stuck_after,
            request_timeout: provider.contract.request_timeout,
            request_lifetime: provider.request_lifetime(),
            key_window: provider
                .contract
                .key_retention
                .checked_sub(provider.contract.key_safety_margin),
            provider: Some(scope),
            escalate_after: self.reconcile_escalate_after,
            retry_on_no_effect: !self.reconcile_no_retry,
            max_clock_gap: Some(provider.contract.clock_skew / 2),
            ..Default::default()
        }
    }
}

impl BooksSettings {
    /// The books of one provider.
    pub fn config(
        &self,
        provider: &ProviderSpec,
        scope: &cobro_store::ProviderScope,
        actor: String,
    ) -> cobro_reconciler::books::BooksConfig {
        cobro_reconciler::books::BooksConfig {
            provider: scope.name.clone(),
            is_default: scope.is_default,
            clock_skew: provider.contract.clock_skew,
            request_timeout: provider.contract.request_timeout,
            overlap: self.books_overlap,
            settle_delay: self.books_settle_delay,
            first_window: self.books_first_window,
            actor,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "FAKE_KEY" => Some("sk_test_fake".into()),
            "STRIPE_KEY" => Some("sk_test_51stripe".into()),
            "STRIPE_WHSEC" => Some("whsec_stripe_unit_test".into()),
            "EMPTY" => Some("  ".into()),
            "SHORT_WHSEC" => Some("whsec_short".into()),
            _ => None,
        }
    }

    fn parse(text: &str) -> anyhow::Result<Registry> {
        Registry::parse(text, Path::new("/nonexistent"), &env)
    }

    fn error(text: &str) -> String {
        format!("{:#}", parse(text).expect_err("refused"))
    }

    const TWO: &str = r#"
        default_provider = "fake"

        [[provider]]
        name = "fake"
        kind = "fake"
        base_url = "http://127.0.0.1:8089/"
        secret_env = "FAKE_KEY"
        search_lag = "5s"

        [[provider]]
        name = "stripe"
        kind = "stripe"
        base_url = "https://api.stripe.com"
        secret_env = "STRIPE_KEY"
        webhook_secret_env = "STRIPE_WHSEC"
    "#;

    #[test]
    fn a_file_with_two_providers_gives_each_its_kind_url_secrets_and_contract() {
        let registry = parse(TWO).expect("valid");
        assert_eq!(registry.default_name(), "fake");
        let fake = registry.get("fake").expect("fake");
        assert_eq!(fake.kind, ProviderKind::Fake);
        assert_eq!(fake.base_url.as_deref(), Some("http://127.0.0.1:8089"));
        assert_eq!(fake.secret.expose(), "sk_test_fake");
        assert_eq!(fake.contract.search_lag, Duration::from_secs(5));
        assert!(fake.webhook_secret.is_none());
        let stripe = registry.get("stripe").expect("stripe");
        assert_eq!(stripe.kind, ProviderKind::Stripe);
        assert_eq!(stripe.contract, ProviderKind::Stripe.documented());
        assert_eq!(stripe.contract.key_retention, Duration::from_secs(86_400));
        assert_eq!(stripe.contract.idempotency_key_max_length, 255);
        assert_eq!(
            stripe
                .webhook_secret
                .as_ref()
                .map(|s| s.expose().to_owned()),
            Some("whsec_stripe_unit_test".into())
        );
        assert_eq!(
            registry.scope(stripe),
            ProviderScope {
                name: "stripe".into(),
                is_default: false
            }
        );
        assert!(registry.scope(fake).is_default);
        // A row that names no provider is the default's.
        assert_eq!(registry.of_row(None).expect("default").name, "fake");
        assert!(registry.of_row(Some("adyen")).is_err());
    }

    #[test]
    fn secrets_never_show_in_debug_output() {
        let registry = parse(TWO).expect("valid");
        let shown = format!("{registry:?}");
        assert!(!shown.contains("sk_test_fake"), "{shown}");
        assert!(!shown.contains("sk_test_51stripe"), "{shown}");
        assert!(!shown.contains("whsec_stripe_unit_test"), "{shown}");
        assert!(shown.contains("***"));
    }

    #[test]
    fn secrets_are_read_from_files_relative_to_the_providers_file() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("key"), "sk_test_file\n").expect("write");
        let text = r#"
            [[provider]]
            name = "only"
            kind = "stripe"
            base_url = "http://localhost:12111"
            secret_file = "key"
            search_lag = "1s"
        "#;
        let registry = Registry::parse(text, dir.path(), &env).expect("valid");
        assert_eq!(registry.default_name(), "only");
        let only = registry.get("only").expect("only");
        assert_eq!(only.secret.expose(), "sk_test_file");
        // A local emulator may have a short lag.
        assert_eq!(only.contract.search_lag, Duration::from_secs(1));
    }

    #[test]
    fn an_unknown_kind_is_refused_by_name() {
        let text = TWO.replace(r#"kind = "stripe""#, r#"kind = "adyen""#);
        let e = error(&text);
        assert!(
            e.contains("provider `stripe`") && e.contains("unknown kind `adyen`"),
            "{e}"
        );
    }

    #[test]
    fn a_missing_or_empty_or_unset_secret_is_refused_without_echoing_any_value() {
        let e = error(&TWO.replace(r#"secret_env = "STRIPE_KEY""#, ""));
        assert!(e.contains("API key is missing"), "{e}");
        let e = error(&TWO.replace(r#"secret_env = "STRIPE_KEY""#, r#"secret_env = "NOPE""#));
        assert!(e.contains("NOPE is not set"), "{e}");
        let e = error(&TWO.replace(r#"secret_env = "STRIPE_KEY""#, r#"secret_env = "EMPTY""#));
        assert!(e.contains("secret is empty"), "{e}");
        let e = error(&TWO.replace(
            r#"secret_env = "STRIPE_KEY""#,
            "secret_env = \"STRIPE_KEY\"\nsecret_file = \"k\"",
        ));
        assert!(e.contains("not both"), "{e}");
    }

    #[test]
    fn an_empty_or_short_webhook_secret_is_refused_from_a_variable_or_a_file() {
        let e = error(&TWO.replace(
            r#"webhook_secret_env = "STRIPE_WHSEC""#,
            r#"webhook_secret_env = "EMPTY""#,
        ));
        assert!(e.contains("webhook_secret is empty"), "{e}");
        let e = error(&TWO.replace(
            r#"webhook_secret_env = "STRIPE_WHSEC""#,
            r#"webhook_secret_env = "SHORT_WHSEC""#,
        ));
        assert!(
            e.contains("webhook_secret is 11 bytes long") && e.contains("at least 16"),
            "{e}"
        );
        assert!(!e.contains("whsec_short"), "never the value: {e}");
        let e = error(&TWO.replace(
            r#"webhook_secret_env = "STRIPE_WHSEC""#,
            "webhook_secret_env = \"STRIPE_WHSEC\"\nwebhook_secret_previous_env = \"SHORT_WHSEC\"",
        ));
        assert!(
            e.contains("webhook_secret_previous is 11 bytes long"),
            "{e}"
        );
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("whsec"), "whsec_tiny\n").expect("write");
        let text = TWO.replace(
            r#"webhook_secret_env = "STRIPE_WHSEC""#,
            r#"webhook_secret_file = "whsec""#,
        );
        let e = format!(
            "{:#}",
            Registry::parse(&text, dir.path(), &env).expect_err("refused")
        );
        assert!(e.contains("webhook_secret is 10 bytes long"), "{e}");
        // The API key is not a signing secret: a short one stays accepted.
        assert!(parse(TWO).is_ok());
    }

    #[test]
    fn duplicate_names_and_an_undefined_or_missing_default_are_refused() {
        let e = error(&TWO.replace(r#"name = "stripe""#, r#"name = "fake""#));
        assert!(e.contains("two providers are named `fake`"), "{e}");
        let e = error(&TWO.replace(
            r#"default_provider = "fake""#,
            r#"default_provider = "adyen""#,
        ));
        assert!(e.contains("`adyen` is not defined"), "{e}");
        let e = error(&TWO.replace(r#"default_provider = "fake""#, ""));
        assert!(e.contains("default_provider is missing"), "{e}");
        let e = error("default_provider = \"x\"");
        assert!(e.contains("no provider is defined"), "{e}");
    }

    #[test]
    fn contracts_that_cobro_cannot_keep_are_refused() {
        // Stripe forgets keys after 24 h: a longer window would resend
        // under forgotten keys, each making a new PaymentIntent.
        let e = error(&TWO.replace(
            r#"webhook_secret_env = "STRIPE_WHSEC""#,
            "key_retention = \"72h\"",
        ));
        assert!(e.contains("longer than the 1day Stripe keeps"), "{e}");
        // The fake's retention is its own setting.
        let fake = TWO.replace(r#"search_lag = "5s""#, "key_retention = \"72h\"");
        assert!(parse(&fake).is_ok());
        let e = error(&TWO.replace(
            r#"search_lag = "5s""#,
            "key_retention = \"1h\"\nkey_safety_margin = \"2h\"",
        ));
        assert!(e.contains("key_safety_margin must be shorter"), "{e}");
        let e = error(&TWO.replace(r#"search_lag = "5s""#, "idempotency_key_max_length = 20"));
        assert!(e.contains("below the 36 characters"), "{e}");
        let e = error(&TWO.replace(r#"search_lag = "5s""#, "search_lag = \"soon\""));
        assert!(e.contains("search_lag"), "{e}");
    }

    #[test]
    fn unknown_fields_bad_names_and_bad_urls_are_refused() {
        let e = error(&TWO.replace(r#"search_lag = "5s""#, "serach_lag = \"5s\""));
        assert!(e.contains("serach_lag"), "{e}");
        let e = error(&TWO.replace(r#"name = "stripe""#, r#"name = "Stripe EU""#));
        assert!(e.contains("URL path segment"), "{e}");
        let e = error(&TWO.replace("https://api.stripe.com", "ftp://x"));
        assert!(e.contains("not an http(s) URL"), "{e}");
    }

    #[test]
    fn the_environment_defines_the_single_provider_fake_as_before() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            provider: ProviderSettings,
            #[command(flatten)]
            window: KeyWindowSettings,
            #[command(flatten)]
            reconcile: ReconcileSettings,
        }
        let cli = Cli::parse_from([
            "cobro",
            "--provider-url",
            "http://127.0.0.1:9",
            "--provider-search-lag",
            "7s",
            "--provider-key-retention",
            "2h",
        ]);
        let registry = Registry::load(&cli.provider, Some(&cli.window), Some(&cli.reconcile))
            .expect("environment");
        assert_eq!(registry.default_name(), ENV_PROVIDER);
        let fake = registry.get(ENV_PROVIDER).expect("fake");
        assert_eq!(fake.kind, ProviderKind::Fake);
        assert_eq!(fake.base_url.as_deref(), Some("http://127.0.0.1:9"));
        assert_eq!(fake.secret.expose(), "sk_test_cobro");
        assert_eq!(fake.contract.search_lag, Duration::from_secs(7));
        assert_eq!(fake.contract.key_retention, Duration::from_secs(7200));
        assert_eq!(fake.contract.request_timeout, Duration::from_secs(10));
        assert!(!registry.wants_embedded());
    }
}
