//! Adopting an orphan (docs/books.md, "Resolving an orphan"): an object at
//! the provider that carries cobro's metadata, whose payment the database
//! lost (a restore, a failover that lost commits), is recorded again as
//! the provider shows it *now*, read by its id (a strongly consistent
//! read), never as the books listed it. Once adopted it is an ordinary
//! payment: the merchant (or an operator through the API) captures, voids
//! or refunds it through the outbox like any other, and the next books run
//! matches it.

use super::Books;
use cobro_core::{
    AccountId, AttemptId, CaptureMethod, OrderRef, PaymentId, PaymentStatus, attempt_reference,
};
use cobro_provider::{Provider, ProviderObject, ProviderStatus, metadata};
use cobro_settle::books::{RefundAdopted, RefundAdoption, adopt_refund_orphan};
use cobro_store::books::{AdoptRefused, Adoption, OrphanRow, intent_number};
use cobro_store::{DbId, StoreError};
use serde::Serialize;

/// What an adoption recorded.
#[derive(Clone, Debug, Serialize)]
pub struct Adopted {
    pub orphan: String,
    pub account: String,
    pub payment: String,
    pub order_ref: String,
    pub status: String,
    pub charge: String,
    /// The provider's ids of the refunds adopted with it.
    pub refunds: Vec<String>,
    /// Refund orphans of the charge that could not be adopted after it,
    /// with why: each stays open, to adopt alone (or acknowledge) later.
    pub refunds_not_adopted: Vec<(String, String)>,
}

/// Why nothing was adopted. Nothing is written in any of these cases
/// (refund orphans that fail after their charge was adopted are reported
/// in [`Adopted::refunds_not_adopted`] instead).
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("no orphan {0}")]
    NoSuchOrphan(String),
    #[error("orphan {0} is {1}, not open")]
    NotOpen(String, String),
    #[error(
        "orphan {0} refunds charge {1}, which no payment of cobro's holds: adopt that charge's \
         orphan first (its refund orphans are adopted with it)"
    )]
    ChargeNotHeld(String, String),
    #[error("refund orphan {0} was not adopted: {1}")]
    RefundNotAdopted(String, String),
    #[error("orphan {0} is `{1}`'s, not `{2}`'s")]
    OtherProvider(String, String, String),
    #[error("the provider could not be asked about {0} (this proves nothing; try again): {1}")]
    Query(String, String),
    #[error("the provider does not have {0} now: run the books again")]
    Gone(String),
    #[error("{0} at the provider does not say what the orphan says: {1}")]
    Differs(String, String),
    #[error("{0} holds no money at the provider ({1}): acknowledge the orphan instead")]
    NoMoney(String, String),
    #[error("{0} is not final at the provider ({1}): adopt it once it is")]
    NotFinal(String, String),
    #[error(transparent)]
    Refused(#[from] AdoptRefused),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl<P: Provider> Books<P> {
    /// Adopts the open orphan `id` after reading it again at the
    /// provider: its metadata must say what the orphan says, and it must
    /// hold money (authorised or captured; a refund succeeded). A charge
    /// is recorded again as its payment, then each of its open refund
    /// orphans is adopted into that payment; a refund alone is adopted
    /// into the payment that holds its charge. Audited: a `books_adopted`
    /// decision per object with `actor`, `reason` and what the provider
    /// said.
    pub async fn adopt(&self, id: DbId, actor: &str, reason: &str) -> Result<Adopted, AdoptError> {
        let name = id.0.to_string();
        let orphan = self
            .store
            .orphan(id)
            .await?
            .ok_or_else(|| AdoptError::NoSuchOrphan(name.clone()))?;
        if orphan.state != "open" {
            return Err(AdoptError::NotOpen(name, orphan.state));
        }
        if orphan.provider != self.config.provider {
            return Err(AdoptError::OtherProvider(
                name,
                orphan.provider,
                self.config.provider.clone(),
            ));
        }
        if orphan.kind == "refund" {
            return self.adopt_refund_alone(&orphan, actor, reason).await;
        }
        let object_id = orphan.object_id.clone();
        let object = self
            .provider
            .get_charge(&orphan.object_id)
            .await
            .map_err(|e| AdoptError::Query(object_id.clone(), e.0))?
            .ok_or_else(|| AdoptError::Gone(object_id.clone()))?;
        let identity = Identity::of(&orphan, &object)?;
        identity.names("authorize", &object_id)?;
        let (status, captured) = match object.status {
            ProviderStatus::Authorized => (PaymentStatus::Authorized, 0),
            ProviderStatus::Captured => (
                PaymentStatus::Captured,
                object.amount_captured.or(object.amount).unwrap_or(0),
            ),
            ProviderStatus::Voided | ProviderStatus::Declined => {
                return Err(AdoptError::NoMoney(object_id, object.status.to_string()));
            }
            _ => return Err(AdoptError::NotFinal(object_id, object.status.to_string())),
        };
        let (Some(amount), Some(currency)) = (object.amount, object.currency.clone()) else {
            return Err(AdoptError::Differs(
                object_id,
                "it reports no amount or currency".into(),
            ));
        };
        let capture_method = match object.capture_method.as_deref() {
            Some(mode) => CaptureMethod::parse(mode).ok_or_else(|| {
                AdoptError::Differs(object_id.clone(), format!("capture method {mode}"))
            })?,
            // A charge captured at once or one left authorised: the only
            // two ways a provider that does not say shows them.
            None if status == PaymentStatus::Captured => CaptureMethod::Automatic,
            None => CaptureMethod::Manual,
        };
        // Every read before any write: a refund orphan that cannot be read
        // or is not final refuses the whole adoption, with nothing written.
        let mut refunds = Vec::new();
        let refund_orphans = self
            .store
            .open_refund_orphans_of(&orphan.provider, &orphan.object_id)
            .await?;
        for refund in &refund_orphans {
            if let Some(read) = self.read_refund(refund, &identity).await? {
                refunds.push((refund, read));
            }
        }
        // Adopted in their intents' order: each must be the order's next.
        refunds.sort_by_key(|(_, read)| intent_number(&read.identity.intent));
        let said = serde_json::to_string(&object).unwrap_or_else(|_| "{}".into());
        let adoption = Adoption {
            orphan: id,
            provider: &orphan.provider,
            account: identity.account,
            payment: identity.payment,
            order_ref: identity.order_ref.as_str(),
            intent: &identity.intent,
            attempt: identity.attempt,
            reference: &identity.reference,
            charge: &object.id,
            amount,
            amount_captured: captured,
            currency: &currency,
            capture_method,
            status,
            actor,
            reason,
            provider_said: &said,
        };
        self.store.adopt_orphan(&adoption, self.clock.now()).await?;
        tracing::info!(
            provider = %orphan.provider,
            payment = %identity.payment,
            status = status.as_str(),
            "orphan adopted"
        );
        // Its refunds, each in a transaction of its own under the
        // payment's lock: one that fails leaves its orphan open.
        let mut adopted_refunds = Vec::new();
        let mut not_adopted = Vec::new();
        for (row, read) in &refunds {
            match self
                .write_refund(row, read, identity.payment, actor, reason)
                .await
            {
                Ok(()) => adopted_refunds.push(read.object.id.clone()),
                Err(e) => not_adopted.push((read.object.id.clone(), e.to_string())),
            }
        }
        let status = match self.store.payment_any_account(identity.payment).await? {
            Some(payment) => payment.status.as_str().to_owned(),
            None => status.as_str().to_owned(),
        };
        Ok(Adopted {
            orphan: name,
            account: identity.account.to_string(),
            payment: identity.payment.to_string(),
            order_ref: identity.order_ref.as_str().to_owned(),
            status,
            charge: object.id.clone(),
            refunds: adopted_refunds,
            refunds_not_adopted: not_adopted,
        })
    }

    /// A refund orphan whose charge a payment of cobro's holds (kept by
    /// the backup, or adopted before).
    async fn adopt_refund_alone(
        &self,
        orphan: &OrphanRow,
        actor: &str,
        reason: &str,
    ) -> Result<Adopted, AdoptError> {
        let name = orphan.id.0.to_string();
        let charge = orphan.charge.clone().unwrap_or_default();
        let payment = self
            .store
            .payment_by_charge_any_account(&charge)
            .await?
            .ok_or_else(|| AdoptError::ChargeNotHeld(name.clone(), charge.clone()))?;
        let payment_id = payment.id;
        let holder = Identity {
            account: payment.account_id,
            payment: payment_id,
            intent: payment.intent.clone(),
            order_ref: OrderRef::parse(&payment.order_ref)
                .map_err(|_| AdoptError::Differs(charge.clone(), "its order ref".into()))?,
            attempt: AttemptId::from_uuid(uuid::Uuid::nil()),
            reference: String::new(),
        };
        let read = self
            .read_refund(orphan, &holder)
            .await?
            .ok_or_else(|| AdoptError::NoMoney(orphan.object_id.clone(), "not succeeded".into()))?;
        self.write_refund(orphan, &read, payment_id, actor, reason)
            .await?;
        let object = read.object.id.clone();
        let payment = self
            .store
            .payment_any_account(payment_id)
            .await?
            .unwrap_or(payment);
        Ok(Adopted {
            orphan: name,
            account: payment.account_id.to_string(),
            payment: payment_id.to_string(),
            order_ref: payment.order_ref.clone(),
            status: payment.status.as_str().to_owned(),
            charge,
            refunds: vec![object],
            refunds_not_adopted: Vec::new(),
        })
    }

    /// Reads the refund orphan again in the provider's consistent list of
    /// its charge's refunds: `Some` when it succeeded and its metadata
    /// names the charge's payment and account (`holder`), `None` when it
    /// moved no money (it stays open, for an operator to acknowledge).
    async fn read_refund(
        &self,
        orphan: &OrphanRow,
        holder: &Identity,
    ) -> Result<Option<RefundRead>, AdoptError> {
        let object_id = orphan.object_id.clone();
        let charge = orphan.charge.clone().unwrap_or_default();
        let reference = orphan.reference.clone().unwrap_or_default();
        let listed = self
            .provider
            .list_refunds(&reference, &charge)
            .await
            .map_err(|e| AdoptError::Query(object_id.clone(), e.0))?;
        let object = listed
            .into_iter()
            .find(|o| o.id == object_id)
            .ok_or_else(|| AdoptError::Gone(object_id.clone()))?;
        let identity = Identity::of(orphan, &object)?;
        identity.names("refund", &object_id)?;
        if identity.payment != holder.payment || identity.account != holder.account {
            return Err(AdoptError::Differs(
                object_id,
                format!(
                    "its metadata names payment {} of account {}, not {} of {}",
                    identity.payment, identity.account, holder.payment, holder.account
                ),
            ));
        }
        match object.status {
            ProviderStatus::Succeeded => {}
            ProviderStatus::Failed | ProviderStatus::Canceled => return Ok(None),
            _ => return Err(AdoptError::NotFinal(object_id, object.status.to_string())),
        }
        Ok(Some(RefundRead { object, identity }))
    }

    /// Adopts a refund read by [`Self::read_refund`] into `payment`.
    async fn write_refund(
        &self,
        orphan: &OrphanRow,
        read: &RefundRead,
        payment: PaymentId,
        actor: &str,
        reason: &str,
    ) -> Result<(), AdoptError> {
        let object_id = read.object.id.clone();
        let said = serde_json::to_string(&read.object).unwrap_or_else(|_| "{}".into());
        let adoption = RefundAdoption {
            orphan: orphan.id,
            provider: &orphan.provider,
            payment,
            object: &read.object,
            intent: &read.identity.intent,
            attempt: read.identity.attempt,
            reference: &read.identity.reference,
            actor,
            reason,
            said: &said,
        };
        match adopt_refund_orphan(&self.store, &adoption, self.clock.now()).await? {
            RefundAdopted::Adopted(_) => Ok(()),
            RefundAdopted::NotOpen => Err(AdoptError::Refused(AdoptRefused::NotOpen)),
            RefundAdopted::AlreadyRecorded => Err(AdoptError::RefundNotAdopted(
                object_id,
                "a refund is recorded under its id already".into(),
            )),
            RefundAdopted::CannotRecord(why) => Err(AdoptError::RefundNotAdopted(object_id, why)),
        }
    }
}

/// A refund orphan read again at the provider, about to be adopted.
struct RefundRead {
    object: ProviderObject,
    identity: Identity,
}

/// What an object's metadata says about whose it is, checked against the
/// orphan the books recorded from the listing.
struct Identity {
    account: AccountId,
    payment: PaymentId,
    intent: String,
    order_ref: OrderRef,
    attempt: AttemptId,
    reference: String,
}

impl Identity {
    /// Whether the intent is `{order_ref}:{verb}-v{n}` and the reference
    /// the attempt's own (`{intent}/{attempt}`), as cobro names them.
    fn names(&self, verb: &str, object: &str) -> Result<(), AdoptError> {
        let named = self
            .intent
            .rsplit_once(':')
            .is_some_and(|(_, v)| v.strip_prefix(verb).is_some_and(|n| n.starts_with("-v")))
            && intent_number(&self.intent).is_some();
        if !named || self.reference != attempt_reference(&self.intent, self.attempt) {
            return Err(AdoptError::Differs(
                object.to_owned(),
                format!(
                    "its intent {} or reference {} is not a {verb} of cobro's",
                    self.intent, self.reference
                ),
            ));
        }
        Ok(())
    }

    fn of(orphan: &OrphanRow, object: &ProviderObject) -> Result<Self, AdoptError> {
        let differs = |why: String| AdoptError::Differs(object.id.clone(), why);
        let said = |key: &str| object.metadata.get(key).cloned();
        let reference = object
            .reference
            .clone()
            .or_else(|| said(metadata::REFERENCE));
        for (key, now, then) in [
            (
                metadata::ACCOUNT,
                said(metadata::ACCOUNT),
                &orphan.account_id,
            ),
            (
                metadata::PAYMENT,
                said(metadata::PAYMENT),
                &orphan.payment_id,
            ),
            (metadata::INTENT, said(metadata::INTENT), &orphan.intent),
            (
                metadata::ATTEMPT,
                said(metadata::ATTEMPT),
                &orphan.attempt_id,
            ),
            ("reference", reference.clone(), &orphan.reference),
        ] {
            if now.is_none() || &now != then {
                return Err(differs(format!(
                    "{key} is {now:?}, the orphan has {then:?}"
                )));
            }
        }
        let parse_err = |what: &str| differs(format!("its {what} is not one of cobro's"));
        let account = said(metadata::ACCOUNT)
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| parse_err("account"))?;
        let payment = said(metadata::PAYMENT)
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| parse_err("payment"))?;
        let attempt = said(metadata::ATTEMPT)
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| parse_err("attempt"))?;
        let intent = said(metadata::INTENT).ok_or_else(|| parse_err("intent"))?;
        // `{order_ref}:{verb}-v{n}`; an order ref may hold ':' itself.
        let order_ref = intent
            .rsplit_once(':')
            .and_then(|(order, _)| OrderRef::parse(order).ok())
            .ok_or_else(|| parse_err("intent name"))?;
        Ok(Self {
            account,
            payment,
            intent,
            order_ref,
            attempt,
            reference: reference.unwrap_or_default(),
        })
    }
}
