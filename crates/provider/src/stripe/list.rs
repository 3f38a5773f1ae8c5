//! Stripe's consistent reads: the PaymentIntent and refund lists by
//! creation time.
//!
//! Stripe's list endpoints read its primary store; its Search API is
//! eventually consistent ("usually under a minute", "up to an hour during
//! outages"). Only a list can prove that no PaymentIntent was made
//! (docs/proof-of-absence.md).

use super::objects::{Page, PaymentIntent, Refund};
use super::{Got, StripeProvider};
use crate::pages::{self, read_to_end};
use crate::stripe::form::Form;
use crate::{LedgerKind, LedgerPage, ProviderObject, QueryError, Window};

impl StripeProvider {
    /// `GET /v1/payment_intents?created[gte]=[&created[lte]=]&limit=100`,
    /// every page by `starting_after` (newest first), keeping the
    /// PaymentIntents whose `metadata[cobro_reference]` is `reference`.
    /// More pages than `list_max_pages` prove nothing.
    pub(super) async fn list_payment_intents(
        &self,
        reference: &str,
        window: Window,
    ) -> Result<Vec<ProviderObject>, QueryError> {
        let what = "PaymentIntents in the window";
        read_to_end(self.config.list_max_pages, what, |after| async move {
            let mut page = self.window_page(LedgerKind::Charges, window, after).await?;
            page.kept
                .retain(|o| o.reference.as_deref() == Some(reference));
            Ok(page)
        })
        .await
    }

    /// One page of every PaymentIntent (`GET /v1/payment_intents`) or
    /// refund (`GET /v1/refunds`) created in `window`, 100 at a time after
    /// `after`, whatever its metadata (the books): Stripe documents both
    /// lists with `created` filters and reads them from its primary store.
    pub(super) async fn ledger_page_of(
        &self,
        kind: LedgerKind,
        window: Window,
        after: Option<&str>,
    ) -> Result<LedgerPage, QueryError> {
        let after = after.map(str::to_owned);
        let page =
            pages::read_page(&mut |after| self.window_page(kind, window, after), &after).await?;
        Ok(LedgerPage::from(page))
    }

    async fn window_page(
        &self,
        kind: LedgerKind,
        window: Window,
        after: Option<String>,
    ) -> Result<pages::Page, QueryError> {
        let mut params = Form::new().field("created[gte]", window.from.to_string());
        if let Some(to) = window.to {
            params = params.field("created[lte]", to.to_string());
        }
        params = params.field("limit", "100");
        if let Some(last) = &after {
            params = params.field("starting_after", last.as_str());
        }
        match kind {
            LedgerKind::Charges => {
                let path = format!("/v1/payment_intents?{}", params.encode());
                self.objects_page(
                    &path,
                    kind,
                    |i: &PaymentIntent| &i.id,
                    |i| i.is_payment_intent().then(|| i.into_object()),
                )
                .await
            }
            LedgerKind::Refunds => {
                let path = format!("/v1/refunds?{}", params.encode());
                self.objects_page(
                    &path,
                    kind,
                    |r: &Refund| &r.id,
                    |r| r.is_refund().then(|| r.into_object()),
                )
                .await
            }
        }
    }

    /// One page of a Stripe list at `path`, as cobro's objects (`object`
    /// drops what is not of the list's kind).
    async fn objects_page<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        kind: LedgerKind,
        id: impl Fn(&T) -> &String,
        object: impl Fn(T) -> Option<ProviderObject>,
    ) -> Result<pages::Page, QueryError> {
        let Got::Found(page) = self.get::<Page<T>>(path).await? else {
            return Err(QueryError(format!(
                "the {} list answered 404",
                kind.as_str()
            )));
        };
        Ok(pages::Page {
            next: page.data.last().map(|o| id(o).clone()),
            has_more: page.has_more,
            kept: page.data.into_iter().filter_map(object).collect(),
        })
    }
}
