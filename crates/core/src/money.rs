//! Money as integer minor units. Floating point never touches an amount.

use serde::{Deserialize, Serialize};
use std::fmt;

/// ISO 4217 alpha-3 currencies cobro knows, with their minor-unit exponent.
/// The list is deliberately explicit: an unknown code is refused rather than
/// guessed, because a wrong exponent mis-states an amount by 100x.
const CURRENCIES: &[(&str, u8)] = &[
    ("AED", 2),
    ("ARS", 2),
    ("AUD", 2),
    ("BGN", 2),
    ("BHD", 3),
    ("BRL", 2),
    ("CAD", 2),
    ("CHF", 2),
    ("CLP", 0),
    ("CNY", 2),
    ("COP", 2),
    ("CZK", 2),
    ("DKK", 2),
    ("EUR", 2),
    ("GBP", 2),
    ("HKD", 2),
    ("HUF", 2),
    ("IDR", 2),
    ("ILS", 2),
    ("INR", 2),
    ("ISK", 0),
    ("JOD", 3),
    ("JPY", 0),
    ("KRW", 0),
    ("KWD", 3),
    ("MXN", 2),
    ("MYR", 2),
    ("NOK", 2),
    ("NZD", 2),
    ("OMR", 3),
    ("PEN", 2),
    ("PHP", 2),
    ("PLN", 2),
    ("RON", 2),
    ("SAR", 2),
    ("SEK", 2),
    ("SGD", 2),
    ("THB", 2),
    ("TND", 3),
    ("TRY", 2),
    ("TWD", 2),
    ("UAH", 2),
    ("USD", 2),
    ("UYU", 2),
    ("VND", 0),
    ("ZAR", 2),
];

/// A known ISO 4217 currency, always upper case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Currency {
    code: [u8; 3],
    exponent: u8,
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
            .find(|(code, _)| *code == upper)
            .map(|(code, exponent)| {
                let b = code.as_bytes();
                Currency {
                    code: [b[0], b[1], b[2]],
                    exponent: *exponent,
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
