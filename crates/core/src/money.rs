//! Money as integer minor units. Floating point never touches an amount.

use serde::{Deserialize, Serialize};
use std::fmt;

/// ISO 4217 alpha-3 currencies cobro knows, with their minor-unit exponent
/// and how Stripe's API counts their amounts. The list is deliberately
/// explicit: an unknown code is refused rather than guessed, because a
/// wrong exponent mis-states an amount by 100x.
///
/// This is the one currency table: a merchant's amount is validated
/// against it (integer minor units of the ISO exponent), and the Stripe
/// connector converts to and from Stripe's `amount` with it
/// ([`stripe_wire_amount`], [`minor_from_stripe_wire`]).
const CURRENCIES: &[(&str, u8, AtStripe)] = &[
    ("AED", 2, AtStripe::Iso),
    ("ARS", 2, AtStripe::Iso),
    ("AUD", 2, AtStripe::Iso),
    ("BGN", 2, AtStripe::Iso),
    ("BHD", 3, AtStripe::ThreeDecimalsLastZero),
    ("BIF", 0, AtStripe::ZeroDecimal),
    ("BRL", 2, AtStripe::Iso),
    ("CAD", 2, AtStripe::Iso),
    ("CHF", 2, AtStripe::Iso),
    ("CLP", 0, AtStripe::ZeroDecimal),
    ("CNY", 2, AtStripe::Iso),
    ("COP", 2, AtStripe::Iso),
    ("CZK", 2, AtStripe::Iso),
    ("DJF", 0, AtStripe::ZeroDecimal),
    ("DKK", 2, AtStripe::Iso),
    ("EUR", 2, AtStripe::Iso),
    ("GBP", 2, AtStripe::Iso),
    ("GNF", 0, AtStripe::ZeroDecimal),
    ("HKD", 2, AtStripe::Iso),
    ("HUF", 2, AtStripe::TwoDecimalsWholePayouts),
    ("IDR", 2, AtStripe::Iso),
    ("ILS", 2, AtStripe::Iso),
    ("INR", 2, AtStripe::Iso),
    ("ISK", 0, AtStripe::WholeUnitsWithTwoDecimals),
    ("JOD", 3, AtStripe::ThreeDecimalsLastZero),
    ("JPY", 0, AtStripe::ZeroDecimal),
    ("KMF", 0, AtStripe::ZeroDecimal),
    ("KRW", 0, AtStripe::ZeroDecimal),
    ("KWD", 3, AtStripe::ThreeDecimalsLastZero),
    // ISO gives the ariary two decimals; Stripe counts it in whole units.
    ("MGA", 2, AtStripe::ZeroDecimal),
    ("MXN", 2, AtStripe::Iso),
    ("MYR", 2, AtStripe::Iso),
    ("NOK", 2, AtStripe::Iso),
    ("NZD", 2, AtStripe::Iso),
    ("OMR", 3, AtStripe::ThreeDecimalsLastZero),
    ("PEN", 2, AtStripe::Iso),
    ("PHP", 2, AtStripe::Iso),
    ("PLN", 2, AtStripe::Iso),
    ("PYG", 0, AtStripe::ZeroDecimal),
    ("RON", 2, AtStripe::Iso),
    ("RWF", 0, AtStripe::ZeroDecimal),
    ("SAR", 2, AtStripe::Iso),
    ("SEK", 2, AtStripe::Iso),
    ("SGD", 2, AtStripe::Iso),
    ("THB", 2, AtStripe::Iso),
    ("TND", 3, AtStripe::ThreeDecimalsLastZero),
    ("TRY", 2, AtStripe::Iso),
    ("TWD", 2, AtStripe::TwoDecimalsWholePayouts),
    ("UAH", 2, AtStripe::Iso),
    // Listed among Stripe's zero-decimal currencies too, but its special
    // case (which the API enforces) is ISK's: whole units, sent x100.
    ("UGX", 0, AtStripe::WholeUnitsWithTwoDecimals),
    ("USD", 2, AtStripe::Iso),
    ("UYU", 2, AtStripe::Iso),
    ("VND", 0, AtStripe::ZeroDecimal),
    ("VUV", 0, AtStripe::ZeroDecimal),
    ("XAF", 0, AtStripe::ZeroDecimal),
    ("XOF", 0, AtStripe::ZeroDecimal),
    ("XPF", 0, AtStripe::ZeroDecimal),
    ("ZAR", 2, AtStripe::Iso),
];

/// How Stripe's API counts a currency's `amount`, as
/// <https://docs.stripe.com/currencies> documents it (API version
/// 2024-06-20; the sections it names are quoted on each rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AtStripe {
    /// In the ISO minor unit, any amount (EUR 19.99 is `1999`).
    Iso,
    /// "Zero-decimal currencies": the amount in whole units, whatever ISO
    /// says (JPY 500 is `500`; MGA, two decimals in ISO, too).
    ZeroDecimal,
    /// "Special cases", ISK and UGX: zero-decimal in effect, but "to
    /// maintain backwards compatibility, you must pass in amounts with two
    /// decimals" that are always `00` (ISK 5 is `500`; `550` is refused).
    WholeUnitsWithTwoDecimals,
    /// "Special cases", HUF and TWD: two decimals for charges (any
    /// amount), but Stripe pays them out in whole units only (a payout
    /// amount must be divisible by 100). cobro makes no payouts.
    TwoDecimalsWholePayouts,
    /// "Three-decimal currencies" (BHD, JOD, KWD, OMR, TND): three
    /// decimals, but "the least-significant (last) digit [must] be 0".
    /// Stripe says to round to the nearest ten; cobro never rounds money,
    /// so an amount that does not end in 0 is refused.
    ThreeDecimalsLastZero,
}

impl AtStripe {
    /// Digits after the decimal point in Stripe's `amount`.
    fn exponent(self, iso: u8) -> u8 {
        match self {
            AtStripe::Iso | AtStripe::TwoDecimalsWholePayouts => iso,
            AtStripe::ZeroDecimal => 0,
            AtStripe::WholeUnitsWithTwoDecimals => 2,
            AtStripe::ThreeDecimalsLastZero => 3,
        }
    }

    /// Stripe's `amount` must be a multiple of this.
    fn wire_multiple(self) -> i64 {
        match self {
            AtStripe::WholeUnitsWithTwoDecimals => 100,
            AtStripe::ThreeDecimalsLastZero => 10,
            _ => 1,
        }
    }

    /// The rule in words, for refusals.
    fn said(self) -> &'static str {
        match self {
            AtStripe::Iso | AtStripe::TwoDecimalsWholePayouts => "any amount",
            AtStripe::ZeroDecimal => "a zero-decimal currency at Stripe: whole units only",
            AtStripe::WholeUnitsWithTwoDecimals => "whole units only, sent with two decimals 00",
            AtStripe::ThreeDecimalsLastZero => "three decimals, the last one 0",
        }
    }
}

/// A known ISO 4217 currency, always upper case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Currency {
    code: [u8; 3],
    exponent: u8,
    at_stripe: AtStripe,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CurrencyError {
    #[error("currency must be an ISO 4217 alpha-3 code that cobro supports")]
    Unknown,
}

impl Currency {
    /// Parses a code case-insensitively (`eur` and `EUR` are the same currency).
    pub fn parse(raw: &str) -> Result<Self, CurrencyError> {
        let upper = raw.to_ascii_uppercase();
        CURRENCIES
            .iter()
            .find(|(code, _, _)| *code == upper)
            .map(|(code, exponent, at_stripe)| {
                let b = code.as_bytes();
                Currency {
                    code: [b[0], b[1], b[2]],
                    exponent: *exponent,
                    at_stripe: *at_stripe,
                }
            })
            .ok_or(CurrencyError::Unknown)
    }

    pub fn code(&self) -> &str {
        // The bytes come from the table above, which is ASCII.
        std::str::from_utf8(&self.code).unwrap_or("XXX")
    }

    /// Digits after the decimal point (EUR 2, JPY 0, KWD 3).
    pub fn exponent(&self) -> u8 {
        self.exponent
    }

    /// How Stripe's API counts this currency's amounts.
    pub fn at_stripe(&self) -> AtStripe {
        self.at_stripe
    }

    /// Stripe takes an amount of this currency only if it is a multiple of
    /// this many of cobro's minor units (KWD 10, MGA 100, EUR 1): what a
    /// merchant-facing check of a payment routed to Stripe asks.
    pub fn stripe_minor_multiple(&self) -> i64 {
        let rule = self.at_stripe;
        let wire = rule.exponent(self.exponent);
        if wire >= self.exponent {
            // minor * f must be a multiple of m: minor a multiple of
            // m / gcd(m, f).
            let f = 10_i64.pow(u32::from(wire - self.exponent));
            let m = rule.wire_multiple();
            m / gcd(m, f)
        } else {
            10_i64.pow(u32::from(self.exponent - wire)) * rule.wire_multiple()
        }
    }
}

fn gcd(a: i64, b: i64) -> i64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Why an amount cannot be written to (or read from) Stripe as cobro's
/// minor units say it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StripeAmountError {
    /// Stripe would refuse it (or, were cobro to round, charge another
    /// amount): never sent.
    #[error(
        "Stripe takes {currency} amounts only in multiples of {multiple} minor units ({rule}): {minor} is not one"
    )]
    NotAccepted {
        currency: Currency,
        minor: i64,
        multiple: i64,
        rule: &'static str,
    },
    /// Stripe's `amount` is not a whole number of cobro's minor units (an
    /// ISK amount with fractional krónur): it is not what cobro sent.
    #[error("Stripe's {currency} amount {wire} is not a whole number of minor units")]
    Fractional { currency: Currency, wire: i64 },
    #[error("the {currency} amount {amount} overflows when rescaled")]
    Overflow { currency: Currency, amount: i64 },
}

impl StripeAmountError {
    /// A short stable code (a failed attempt's `code`).
    pub fn code(&self) -> &'static str {
        match self {
            StripeAmountError::NotAccepted { .. } => "amount_not_accepted_by_stripe",
            StripeAmountError::Fractional { .. } => "stripe_amount_fractional",
            StripeAmountError::Overflow { .. } => "amount_overflow",
        }
    }
}

/// `amount` with `from` decimals written with `to`: `None` when it does
/// not fit in an `i64` or is not a whole number at `to`.
fn rescale(amount: i64, from: u8, to: u8) -> Option<i64> {
    if to >= from {
        amount.checked_mul(10_i64.checked_pow(u32::from(to - from))?)
    } else {
        let f = 10_i64.checked_pow(u32::from(from - to))?;
        (amount % f == 0).then_some(amount / f)
    }
}

/// Stripe's `amount` for `minor` of cobro's minor units of `currency`
/// (ISK 5000 is `500000`, KWD 1250 is `1250`, MGA 500000 is `5000`);
/// `Err` for an amount Stripe cannot take (KWD 1255, MGA 150), which must
/// never be sent: cobro does not round money.
pub fn stripe_wire_amount(currency: Currency, minor: i64) -> Result<i64, StripeAmountError> {
    let rule = currency.at_stripe;
    let not_accepted = || StripeAmountError::NotAccepted {
        currency,
        minor,
        multiple: currency.stripe_minor_multiple(),
        rule: rule.said(),
    };
    let to = rule.exponent(currency.exponent);
    let wire = match rescale(minor, currency.exponent, to) {
        Some(wire) => wire,
        None if to < currency.exponent => return Err(not_accepted()),
        None => {
            return Err(StripeAmountError::Overflow {
                currency,
                amount: minor,
            });
        }
    };
    if wire % rule.wire_multiple() != 0 {
        return Err(not_accepted());
    }
    Ok(wire)
}

/// cobro's minor units for Stripe's `amount` of `currency`: the inverse
/// of [`stripe_wire_amount`] (ISK `500000` is 5000). `Err` when it is not
/// a whole number of minor units, which cobro never sends.
pub fn minor_from_stripe_wire(currency: Currency, wire: i64) -> Result<i64, StripeAmountError> {
    let from = currency.at_stripe.exponent(currency.exponent);
    match rescale(wire, from, currency.exponent) {
        Some(minor) => Ok(minor),
        None if currency.exponent < from => Err(StripeAmountError::Fractional { currency, wire }),
        None => Err(StripeAmountError::Overflow {
            currency,
            amount: wire,
        }),
    }
}

impl fmt::Display for Currency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

// Stored as its upper-case code exactly: `eur` in a row is not a spelling
// cobro writes, so it is refused like an unknown code.
crate::stored::sqlx_text!(
    Currency,
    |raw| Currency::parse(raw).ok().filter(|c| c.code() == raw),
    |v| v.code()
);

impl TryFrom<String> for Currency {
    type Error = CurrencyError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Currency::parse(&value)
    }
}

impl From<Currency> for String {
    fn from(c: Currency) -> Self {
        c.code().to_owned()
    }
}

/// A positive amount in minor units, bounded by what the API accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "i64", into = "i64")]
pub struct Amount(i64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmountError {
    #[error("amount must be an integer from {} to {}", Amount::MIN, Amount::MAX)]
    OutOfRange,
    #[error("amount arithmetic overflowed")]
    Overflow,
}

impl Amount {
    pub const MIN: i64 = 1;
    pub const MAX: i64 = 99_999_999_999;

    pub fn new(minor_units: i64) -> Result<Self, AmountError> {
        if (Self::MIN..=Self::MAX).contains(&minor_units) {
            Ok(Self(minor_units))
        } else {
            Err(AmountError::OutOfRange)
        }
    }

    pub fn minor_units(&self) -> i64 {
        self.0
    }

    /// Sum of two amounts; sums stay within i64 and are not bounded by MAX, so
    /// the result is a plain count of minor units.
    pub fn checked_add_units(self, other: i64) -> Result<i64, AmountError> {
        self.0.checked_add(other).ok_or(AmountError::Overflow)
    }
}

impl TryFrom<i64> for Amount {
    type Error = AmountError;
    fn try_from(value: i64) -> Result<Self, Self::Error> {
        Amount::new(value)
    }
}

impl From<Amount> for i64 {
    fn from(a: Amount) -> Self {
        a.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn currency_is_case_insensitive_and_knows_its_exponent() {
        let eur = Currency::parse("eur").expect("EUR is known");
        assert_eq!(eur.code(), "EUR");
        assert_eq!(eur.exponent(), 2);
        assert_eq!(Currency::parse("JPY").expect("JPY").exponent(), 0);
        assert_eq!(Currency::parse("KWD").expect("KWD").exponent(), 3);
    }

    #[test]
    fn unknown_or_malformed_currencies_are_refused() {
        for bad in ["", "EU", "EURO", "XXX", "€€€", "eu1"] {
            assert_eq!(Currency::parse(bad), Err(CurrencyError::Unknown), "{bad}");
        }
    }

    fn currency(code: &str) -> Currency {
        Currency::parse(code).expect("a known currency")
    }

    fn wire(code: &str, minor: i64) -> Result<i64, StripeAmountError> {
        stripe_wire_amount(currency(code), minor)
    }

    fn minor(code: &str, wire: i64) -> Result<i64, StripeAmountError> {
        minor_from_stripe_wire(currency(code), wire)
    }

    #[test]
    fn the_table_knows_each_of_stripes_zero_decimal_currencies() {
        // docs.stripe.com/currencies, "Zero-decimal currencies"; UGX is
        // listed there too but its special case (whole units sent x100)
        // is what the API enforces.
        let stripe = [
            "BIF", "CLP", "DJF", "GNF", "JPY", "KMF", "KRW", "MGA", "PYG", "RWF", "UGX", "VND",
            "VUV", "XAF", "XOF", "XPF",
        ];
        for code in stripe {
            let expected = if code == "UGX" {
                AtStripe::WholeUnitsWithTwoDecimals
            } else {
                AtStripe::ZeroDecimal
            };
            assert_eq!(currency(code).at_stripe(), expected, "{code}");
        }
        let zero_decimal: Vec<&str> = CURRENCIES
            .iter()
            .filter(|(_, _, rule)| *rule == AtStripe::ZeroDecimal)
            .map(|(code, _, _)| *code)
            .collect();
        assert_eq!(zero_decimal.len(), stripe.len() - 1, "{zero_decimal:?}");
    }

    #[test]
    fn a_zero_decimal_currency_is_sent_in_whole_units() {
        assert_eq!(wire("JPY", 500), Ok(500));
        assert_eq!(minor("JPY", 500), Ok(500));
        assert_eq!(wire("XOF", 5000), Ok(5000));
        assert_eq!(currency("JPY").stripe_minor_multiple(), 1);
    }

    #[test]
    fn a_two_decimal_currency_is_sent_as_it_is() {
        assert_eq!(wire("EUR", 1999), Ok(1999));
        assert_eq!(minor("EUR", 1999), Ok(1999));
    }

    #[test]
    fn isk_is_sent_with_two_decimals_that_are_always_zero() {
        // ISO: no decimals, so 5000 is ISK 5 000; Stripe reads `5000` as
        // ISK 50.00.
        assert_eq!(currency("ISK").exponent(), 0);
        assert_eq!(wire("ISK", 5000), Ok(500_000));
        assert_eq!(wire("ISK", 1), Ok(100));
        assert_eq!(minor("ISK", 500_000), Ok(5000));
        assert_eq!(
            currency("ISK").stripe_minor_multiple(),
            1,
            "any whole króna"
        );
        // Fractional krónur at Stripe are not what cobro sent.
        assert!(matches!(
            minor("ISK", 500_050),
            Err(StripeAmountError::Fractional { wire: 500_050, .. })
        ));
    }

    #[test]
    fn ugx_is_sent_as_isk_is_as_stripes_special_case_says() {
        assert_eq!(currency("UGX").exponent(), 0);
        assert_eq!(wire("UGX", 5), Ok(500));
        assert_eq!(wire("UGX", 37_000), Ok(3_700_000));
        assert_eq!(minor("UGX", 3_700_000), Ok(37_000));
        assert!(minor("UGX", 3_700_001).is_err());
    }

    #[test]
    fn huf_and_twd_charges_take_any_two_decimal_amount() {
        for code in ["HUF", "TWD"] {
            assert_eq!(
                currency(code).at_stripe(),
                AtStripe::TwoDecimalsWholePayouts
            );
            // HUF 10.45: a charge may hold fillér; only a payout may not.
            assert_eq!(wire(code, 1045), Ok(1045), "{code}");
            assert_eq!(minor(code, 1045), Ok(1045), "{code}");
            assert_eq!(currency(code).stripe_minor_multiple(), 1, "{code}");
        }
    }

    #[test]
    fn three_decimal_currencies_must_end_in_zero_and_are_never_rounded() {
        for code in ["BHD", "JOD", "KWD", "OMR", "TND"] {
            let c = currency(code);
            assert_eq!(c.exponent(), 3, "{code}");
            assert_eq!(c.stripe_minor_multiple(), 10, "{code}");
            assert_eq!(wire(code, 5120), Ok(5120), "{code}");
            assert_eq!(minor(code, 5120), Ok(5120), "{code}");
            let refused = wire(code, 5124).expect_err("5.124 is refused, not rounded");
            assert_eq!(
                refused,
                StripeAmountError::NotAccepted {
                    currency: c,
                    minor: 5124,
                    multiple: 10,
                    rule: "three decimals, the last one 0",
                },
                "{code}"
            );
            assert_eq!(refused.code(), "amount_not_accepted_by_stripe");
            assert_eq!(
                refused.to_string(),
                format!(
                    "Stripe takes {code} amounts only in multiples of 10 minor units \
                     (three decimals, the last one 0): 5124 is not one"
                )
            );
        }
    }

    #[test]
    fn mga_has_two_iso_decimals_that_stripe_does_not_count() {
        let mga = currency("MGA");
        assert_eq!(mga.exponent(), 2);
        assert_eq!(mga.stripe_minor_multiple(), 100);
        assert_eq!(wire("MGA", 500_000), Ok(5000));
        assert_eq!(minor("MGA", 5000), Ok(500_000));
        assert!(matches!(
            wire("MGA", 150),
            Err(StripeAmountError::NotAccepted { multiple: 100, .. })
        ));
    }

    #[test]
    fn a_rescale_that_overflows_is_refused() {
        assert!(matches!(
            wire("ISK", i64::MAX),
            Err(StripeAmountError::Overflow { .. })
        ));
        assert!(matches!(
            minor("MGA", i64::MAX),
            Err(StripeAmountError::Overflow { .. })
        ));
    }

    proptest::proptest! {
        /// For every currency: an amount Stripe takes comes back as it
        /// went, and the multiple each currency names is exactly the rule.
        #[test]
        fn every_amount_stripe_takes_round_trips(minor_units in Amount::MIN..=Amount::MAX) {
            for (code, _, _) in CURRENCIES {
                let c = currency(code);
                let sent = stripe_wire_amount(c, minor_units);
                let multiple = c.stripe_minor_multiple();
                proptest::prop_assert_eq!(sent.is_ok(), minor_units % multiple == 0, "{}", code);
                // And the nearest multiple below, which Stripe must take.
                let taken = (minor_units - minor_units % multiple).max(multiple);
                let wire = stripe_wire_amount(c, taken);
                proptest::prop_assert!(wire.is_ok(), "{} {}", code, taken);
                if let Ok(wire) = wire {
                    proptest::prop_assert_eq!(wire % c.at_stripe().wire_multiple(), 0);
                    proptest::prop_assert_eq!(minor_from_stripe_wire(c, wire), Ok(taken));
                }
            }
        }
    }

    #[test]
    fn amounts_are_bounded_on_both_sides() {
        assert!(Amount::new(0).is_err());
        assert!(Amount::new(-5).is_err());
        assert!(Amount::new(1).is_ok());
        assert!(Amount::new(99_999_999_999).is_ok());
        assert!(Amount::new(100_000_000_000).is_err());
    }

    #[test]
    fn amount_addition_is_checked() {
        let a = Amount::new(Amount::MAX).expect("max");
        assert_eq!(a.checked_add_units(1), Ok(Amount::MAX + 1));
        assert_eq!(a.checked_add_units(i64::MAX), Err(AmountError::Overflow));
    }
}
