//! Stripe's consistent reads: the PaymentIntent list by creation time.
//!
//! Stripe's list endpoints read its primary store; its Search API is
//! eventually consistent ("usually under a minute", "up to an hour during
//! outages"). Only a list can prove that no PaymentIntent was made
//! (docs/proof-of-absence.md).

use super::objects::{Page, PaymentIntent};
use super::{Got, StripeProvider};
use crate::pages::{self, read_to_end};
use crate::stripe::form::Form;
use crate::{ProviderObject, QueryError, Window};

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
            let mut params = Form::new().field("created[gte]", window.from.to_string());
            if let Some(to) = window.to {
                params = params.field("created[lte]", to.to_string());
            }
            params = params.field("limit", "100");
            if let Some(last) = &after {
                params = params.field("starting_after", last.as_str());
            }
            let path = format!("/v1/payment_intents?{}", params.encode());
            let page = match self.get::<Page<PaymentIntent>>(&path).await? {
                Got::Found(page) => page,
                Got::Missing => {
                    return Err(QueryError("the PaymentIntent list answered 404".into()));
                }
            };
            Ok(pages::Page {
                next: page.data.last().map(|i| i.id.clone()),
                has_more: page.has_more,
                kept: PaymentIntent::referenced(page.data, reference),
            })
        })
        .await
    }
}
