//! One type for every kind of provider cobro can be configured with, so a
//! worker, a reconciler or a test is written once and runs against either:
//! the fake provider's own API ([`HttpProvider`]) or Stripe
//! ([`StripeProvider`], also the fake's Stripe dialect and localstripe).

use crate::{
    AuthorizeRequest, Credentials, HttpProvider, LedgerKind, LedgerPage, Mutation, Outcome,
    Provider, ProviderObject, QueryError, RefundRequest, Sent, StripeProvider, Window,
};

/// A configured provider of any kind; every call goes to the one inside.
#[derive(Clone, Debug)]
pub enum Connector {
    Fake(HttpProvider),
    Stripe(StripeProvider),
}

impl From<HttpProvider> for Connector {
    fn from(provider: HttpProvider) -> Self {
        Connector::Fake(provider)
    }
}

impl From<StripeProvider> for Connector {
    fn from(provider: StripeProvider) -> Self {
        Connector::Stripe(provider)
    }
}

/// `$call` on whichever provider this is.
macro_rules! each {
    ($self:ident, $p:ident => $call:expr) => {
        match $self {
            Connector::Fake($p) => $call,
            Connector::Stripe($p) => $call,
        }
    };
}

impl Provider for Connector {
    fn name(&self) -> &str {
        each!(self, p => p.name())
    }
    async fn authorize(&self, key: &str, request: &AuthorizeRequest) -> Outcome {
        each!(self, p => p.authorize(key, request).await)
    }
    async fn capture(&self, key: &str, charge: &str) -> Outcome {
        each!(self, p => p.capture(key, charge).await)
    }
    async fn void(&self, key: &str, charge: &str) -> Outcome {
        each!(self, p => p.void(key, charge).await)
    }
    async fn refund(&self, key: &str, request: &RefundRequest) -> Outcome {
        each!(self, p => p.refund(key, request).await)
    }
    async fn send(&self, key: &str, mutation: Mutation<'_>) -> Sent {
        each!(self, p => p.send(key, mutation).await)
    }
    async fn get_charge(&self, id: &str) -> Result<Option<ProviderObject>, QueryError> {
        each!(self, p => p.get_charge(id).await)
    }
    async fn search_charges(&self, reference: &str) -> Result<Vec<ProviderObject>, QueryError> {
        each!(self, p => p.search_charges(reference).await)
    }
    async fn search_refunds(
        &self,
        reference: &str,
        charge: Option<&str>,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        each!(self, p => p.search_refunds(reference, charge).await)
    }
    async fn list_charges(
        &self,
        reference: &str,
        window: Window,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        each!(self, p => p.list_charges(reference, window).await)
    }
    async fn list_refunds(
        &self,
        reference: &str,
        charge: &str,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        each!(self, p => p.list_refunds(reference, charge).await)
    }
    async fn ledger_page(
        &self,
        kind: LedgerKind,
        window: Window,
        after: Option<&str>,
    ) -> Result<LedgerPage, QueryError> {
        each!(self, p => p.ledger_page(kind, window, after).await)
    }
    async fn check_credentials(&self) -> Credentials {
        each!(self, p => p.check_credentials().await)
    }
}
