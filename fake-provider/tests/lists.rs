//! The strongly consistent lists, in both dialects: newest first, paged to
//! the end, `created` bounds inclusive in whole seconds, only the caller's
//! own objects, blind to search lag, failed by the `list` fault (and only
//! by it); and the `processing` fault, whose charge counts in the ledger
//! only once it is final.
#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use chrono::{DateTime, Utc};
use common::stripe::{SK, SK_B, form, intent_form};
use common::{
    CALLER, EffectsExt, Provider, charge_body, charges, declines, ids, provider, query, wait_until,
};
use fake_provider::{Effects, FaultAction, FaultRule, Operation, WebhookDialect, WebhookTarget};
use serde_json::{Value, json};

const OTHER: &str = "sk_test_other_merchant";
const INTENTS: &str = "/v1/payment_intents";

/// Every page of a fake-dialect list from `path_and_query` (without
/// `limit` and `starting_after`), `limit` at a time, as `caller`: the ids
/// in order and the size of each page. Each object is checked to be
/// exactly what `GET /v1/{what}/{id}` shows.
async fn fake_pages(
    p: &Provider,
    caller: &str,
    what: &str,
    filters: &[(&str, &str)],
    limit: usize,
) -> (Vec<String>, Vec<usize>) {
    let (mut all, mut sizes) = (Vec::new(), Vec::new());
    let limit = limit.to_string();
    loop {
        let mut pairs = filters.to_vec();
        pairs.push(("limit", &limit));
        let last: String = all.last().cloned().unwrap_or_default();
        if !last.is_empty() {
            pairs.push(("starting_after", &last));
        }
        let page = p
            .get_as(caller, &format!("/v1/{what}?{}", query(&pairs)))
            .await;
        assert_eq!(page.status, 200, "{page:?}");
        assert_eq!(page.body["object"], "list");
        for item in page.body["data"].as_array().unwrap() {
            let id = item["id"].as_str().unwrap();
            let read = p.get_as(caller, &format!("/v1/{what}/{id}")).await;
            assert_eq!(&read.body, item, "a listed object is what a read shows");
        }
        let found = ids(&page.body["data"]);
        sizes.push(found.len());
        all.extend(found);
        if page.body["has_more"] == false {
            return (all, sizes);
        }
        assert_eq!(page.body["has_more"], true, "{page:?}");
    }
}

/// The same through Stripe's lists.
async fn stripe_pages(
    p: &Provider,
    caller: &str,
    path: &str,
    filters: &[(&str, &str)],
    limit: usize,
) -> (Vec<String>, Vec<usize>) {
    let (mut all, mut sizes) = (Vec::new(), Vec::new());
    let limit = limit.to_string();
    loop {
        let mut pairs = filters.to_vec();
        pairs.push(("limit", &limit));
        let last: String = all.last().cloned().unwrap_or_default();
        if !last.is_empty() {
            pairs.push(("starting_after", &last));
        }
        let page = p
            .stripe_get_as(caller, &format!("{path}?{}", form(&pairs)))
            .await;
        assert_eq!(page.status, 200, "{page:?}");
        assert_eq!(page.body["object"], "list");
        assert_eq!(page.body["url"], path);
        for item in page.body["data"].as_array().unwrap() {
            let id = item["id"].as_str().unwrap();
            let read = p.stripe_get_as(caller, &format!("{path}/{id}")).await;
            assert_eq!(&read.body, item, "a listed object is what a read shows");
        }
        let found = ids(&page.body["data"]);
        sizes.push(found.len());
        all.extend(found);
        if page.body["has_more"] == false {
            return (all, sizes);
        }
        assert_eq!(page.body["has_more"], true, "{page:?}");
    }
}

/// `created` of a fake-dialect object, in unix seconds.
fn created_seconds(object: &Value) -> i64 {
    object["created"]
        .as_str()
        .unwrap()
        .parse::<DateTime<Utc>>()
        .unwrap()
        .timestamp()
}

/// Ids of `GET /v1/charges?created[gte]=..&created[lte]=..` (either may be
/// left out).
async fn charges_created_within(p: &Provider, gte: Option<i64>, lte: Option<i64>) -> Vec<String> {
    let (gte, lte) = (gte.map(|s| s.to_string()), lte.map(|s| s.to_string()));
    let mut pairs = vec![];
    if let Some(gte) = &gte {
        pairs.push(("created[gte]", gte.as_str()));
    }
    if let Some(lte) = &lte {
        pairs.push(("created[lte]", lte.as_str()));
    }
    let answer = p.get(&format!("/v1/charges?{}", query(&pairs))).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    ids(&answer.body["data"])
}

async fn charge_as(p: &Provider, caller: &str, reference: &str) -> common::Answer {
    let answer = p
        .post_as(caller, "/v1/charges", None, &charge_body(reference))
        .await
        .unwrap();
    assert_eq!(answer.status, 201, "{answer:?}");
    answer
}

#[tokio::test]
async fn the_charge_list_pages_to_the_end_newest_first() {
    let p = provider().await;
    let mut made = Vec::new();
    for i in 0..7 {
        made.push(
            charge_as(&p, CALLER, &format!("o-{i}"))
                .await
                .id()
                .to_owned(),
        );
    }
    made.reverse();

    let (listed, pages) = fake_pages(&p, CALLER, "charges", &[], 3).await;
    assert_eq!(listed, made);
    assert_eq!(pages, [3, 3, 1]);
    // Without a limit, ten at most; one bound alone is enough for a list.
    let all = p.get("/v1/charges?created[gte]=0").await;
    assert_eq!(
        (ids(&all.body["data"]), &all.body["has_more"]),
        (made, &json!(false))
    );
    assert_eq!(p.totals(), charges(7));
}

#[tokio::test]
async fn created_bounds_are_inclusive_in_whole_seconds() {
    let p = provider().await;
    let mut made = Vec::new();
    for i in 0..3 {
        if i > 0 {
            p.control.advance_clock(Duration::from_secs(10));
        }
        made.push(charge_as(&p, CALLER, &format!("o-{i}")).await);
    }
    let [a, b, c] = [0, 1, 2].map(|i| created_seconds(&made[i].body));
    let [id_a, id_b, id_c] = [0, 1, 2].map(|i| made[i].id());
    let list = |gte, lte| charges_created_within(&p, gte, lte);

    // Created at b.xxx seconds: within [b, b] although later than b.000.
    assert_eq!(list(Some(b), Some(b)).await, [id_b]);
    assert_eq!(list(Some(a), Some(b)).await, [id_b, id_a]);
    assert_eq!(list(Some(b + 1), None).await, [id_c]);
    assert_eq!(list(None, Some(c - 1)).await, [id_b, id_a]);
    assert_eq!(list(None, Some(a - 1)).await, Vec::<String>::new());
    assert_eq!(list(Some(c), Some(a)).await, Vec::<String>::new());
    // Paging within bounds: the cursor is a position, the bounds still hold.
    let (paged, pages) = fake_pages(
        &p,
        CALLER,
        "charges",
        &[("created[lte]", &b.to_string())],
        1,
    )
    .await;
    assert_eq!(
        (paged, pages),
        (vec![id_b.to_owned(), id_a.to_owned()], vec![1, 1])
    );
    assert_eq!(p.totals(), charges(3));
}

#[tokio::test]
async fn another_callers_charges_and_refunds_are_never_listed() {
    let p = provider().await;
    // Twins sharing every name: reference and idempotency key.
    let mine = p
        .post_as(CALLER, "/v1/charges", Some("k-1"), &charge_body("o-1"))
        .await
        .unwrap();
    let theirs = p
        .post_as(OTHER, "/v1/charges", Some("k-1"), &charge_body("o-1"))
        .await
        .unwrap();
    for (caller, charge) in [(CALLER, &mine), (OTHER, &theirs)] {
        p.post_as(
            caller,
            &format!("/v1/charges/{}/capture", charge.id()),
            None,
            &json!({}),
        )
        .await
        .unwrap();
        let refund = json!({"charge": charge.id(), "amount": 100, "reference": "o-1/refund"});
        p.post_as(caller, "/v1/refunds", None, &refund)
            .await
            .unwrap();
    }

    for (caller, charge, other) in [(CALLER, &mine, &theirs), (OTHER, &theirs, &mine)] {
        let (listed, _) = fake_pages(&p, caller, "charges", &[], 10).await;
        assert_eq!(listed, [charge.id()]);
        let refunds = p.control.ledger().refunds_of_charge(charge.id()).len();
        let (listed, _) = fake_pages(&p, caller, "refunds", &[("charge", charge.id())], 10).await;
        assert_eq!(listed.len(), refunds);
        // The other caller's objects are missing, as unknown ids are.
        let cursor = p
            .get_as(
                caller,
                &format!("/v1/charges?starting_after={}", other.id()),
            )
            .await;
        assert_eq!(cursor.error(), (400, "resource_missing"));
        let message = cursor.body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with("starting_after"), "{message}");
        let refunds = p
            .get_as(caller, &format!("/v1/refunds?charge={}", other.id()))
            .await;
        assert_eq!(refunds.error(), (404, "resource_missing"));
    }
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2).captures(2).refunds(2));
    assert_eq!(ledger.charge(mine.id()).unwrap().caller, CALLER);
    assert_eq!(ledger.charge(theirs.id()).unwrap().caller, OTHER);
}

#[tokio::test]
async fn the_refund_list_of_a_charge_pages_its_refunds_newest_first() {
    let p = provider().await;
    let mut body = charge_body("o-1");
    body["capture"] = json!(true);
    let charge = p.post("/v1/charges", None, &body).await.unwrap();
    let mut made = Vec::new();
    for i in 0..5 {
        made.push(
            p.refund(charge.id(), 100, &format!("o-1/r{i}"))
                .await
                .id()
                .to_owned(),
        );
    }
    made.reverse();
    let other = p.post("/v1/charges", None, &body).await.unwrap();
    p.refund(other.id(), 100, "o-2/r").await;

    let (listed, pages) = fake_pages(&p, CALLER, "refunds", &[("charge", charge.id())], 2).await;
    assert_eq!((listed, pages), (made, vec![2, 2, 1]));
    // The reference search on refunds is still there, beside the list.
    assert_eq!(p.search("refunds", "o-2/r").await.len(), 1);
    assert_eq!(p.totals(), charges(2).refunds(6));
}

#[tokio::test]
async fn every_refund_of_a_window_is_listed_whatever_its_charge() {
    let p = provider().await;
    let mut body = charge_body("o-1");
    body["capture"] = json!(true);
    let first = p.post("/v1/charges", None, &body).await.unwrap();
    let early = p.refund(first.id(), 100, "o-1/r0").await.id().to_owned();
    p.control.advance_clock(Duration::from_secs(10));
    let second = p.post("/v1/charges", None, &body).await.unwrap();
    let late_a = p.refund(first.id(), 100, "o-1/r1").await.id().to_owned();
    let late_b = p.refund(second.id(), 100, "o-2/r0").await.id().to_owned();
    let other = charge_as(&p, OTHER, "o-x").await;
    let _ = other;
    let at = |answer: &common::Answer| created_seconds(&answer.body);
    let from = at(&second).to_string();

    // Every refund of the caller created from `from`, both charges, newest
    // first, paged; the earlier refund is outside the window.
    let (listed, pages) = fake_pages(&p, CALLER, "refunds", &[("created[gte]", &from)], 1).await;
    assert_eq!((listed, pages), (vec![late_b, late_a], vec![1, 1]));
    let before = (at(&second) - 1).to_string();
    let (listed, _) = fake_pages(&p, CALLER, "refunds", &[("created[lte]", &before)], 10).await;
    assert_eq!(listed, vec![early]);
    assert_eq!(p.totals(), charges(3).refunds(3));
}

#[tokio::test]
async fn objects_hidden_from_search_by_search_lag_are_listed() {
    let p = provider().await;
    for operation in [Operation::Charge, Operation::Refund] {
        p.control
            .add_fault(FaultRule::new(operation, FaultAction::SearchLag).with_lag_seconds(3600));
    }
    let mut body = charge_body("o-lag");
    body["capture"] = json!(true);
    let charge = p.post("/v1/charges", None, &body).await.unwrap();
    let refund = p.refund(charge.id(), 200, "o-lag/refund").await;

    assert!(p.search("charges", "o-lag").await.is_empty(), "search lags");
    assert!(p.search("refunds", "o-lag/refund").await.is_empty());
    let (charges_listed, _) = fake_pages(&p, CALLER, "charges", &[], 10).await;
    assert_eq!(charges_listed, [charge.id()]);
    let (refunds_listed, _) =
        fake_pages(&p, CALLER, "refunds", &[("charge", charge.id())], 10).await;
    assert_eq!(refunds_listed, [refund.id()]);
    assert_eq!(p.totals(), charges(1).refunds(1));
}

#[tokio::test]
async fn the_list_fault_fails_lists_with_503_while_reads_and_searches_work() {
    let p = provider().await;
    let charge = charge_as(&p, CALLER, "o-1").await;
    p.control.add_fault(FaultRule::new(
        Operation::List,
        FaultAction::FailBeforeEffect,
    ));

    let listed = p.get("/v1/charges?limit=10").await;
    assert_eq!(listed.error(), (503, "service_unavailable"));
    let refunds = p.get(&format!("/v1/refunds?charge={}", charge.id())).await;
    assert_eq!(refunds.error(), (503, "service_unavailable"));
    let read = p.get(&format!("/v1/charges/{}", charge.id())).await;
    assert_eq!(read.status, 200);
    assert_eq!(p.search("charges", "o-1").await, [charge.id()]);

    // `search` rules do not touch lists; `any` does, and so does latency.
    p.control.clear_faults();
    p.control.add_fault(FaultRule::new(
        Operation::Search,
        FaultAction::FailBeforeEffect,
    ));
    assert_eq!(p.get("/v1/charges?limit=10").await.status, 200);
    p.control.clear_faults();
    p.control
        .add_fault(FaultRule::new(Operation::Any, FaultAction::FailBeforeEffect).with_next(1));
    assert_eq!(p.get("/v1/charges?limit=10").await.status, 503);
    p.control.add_fault(
        FaultRule::new(Operation::List, FaultAction::Latency)
            .with_delay(Duration::from_millis(200))
            .with_next(1),
    );
    let started = Instant::now();
    let slow = p.get("/v1/charges?limit=10").await;
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(ids(&slow.body["data"]), [charge.id()]);
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn list_parameters_do_not_mix_with_search_and_bad_values_are_refused() {
    let p = provider().await;
    let cases = [
        ("/v1/charges", 400, "parameter_missing", "reference"),
        ("/v1/refunds", 400, "parameter_missing", "reference"),
        (
            "/v1/charges?reference=r&limit=5",
            400,
            "parameter_invalid",
            "limit",
        ),
        (
            "/v1/charges?metadata[k]=v&created[gte]=1",
            400,
            "parameter_invalid",
            "created[gte]",
        ),
        (
            "/v1/refunds?charge=ch_1&reference=r",
            400,
            "parameter_invalid",
            "charge",
        ),
        (
            "/v1/refunds?reference=r&starting_after=re_1",
            400,
            "parameter_invalid",
            "starting_after",
        ),
        ("/v1/charges?limit=0", 400, "parameter_invalid", "limit"),
        ("/v1/charges?limit=101", 400, "parameter_invalid", "limit"),
        ("/v1/charges?limit=ten", 400, "parameter_invalid", "limit"),
        (
            "/v1/charges?limit=5&limit=6",
            400,
            "parameter_invalid",
            "limit",
        ),
        (
            "/v1/charges?created[gte]=soon",
            400,
            "parameter_invalid",
            "created[gte]",
        ),
        (
            "/v1/charges?created[lte]=1.5",
            400,
            "parameter_invalid",
            "created[lte]",
        ),
        (
            "/v1/charges?created[gte]=1&created[gte]=2",
            400,
            "parameter_invalid",
            "created[gte]",
        ),
        (
            "/v1/charges?starting_after=",
            400,
            "parameter_invalid",
            "starting_after",
        ),
        (
            "/v1/charges?created[gt]=1",
            400,
            "parameter_unknown",
            "created[gt]",
        ),
        (
            "/v1/charges?charge=ch_1",
            400,
            "parameter_unknown",
            "charge",
        ),
        (
            "/v1/refunds?created[gt]=1",
            400,
            "parameter_unknown",
            "created[gt]",
        ),
        ("/v1/refunds?limit=5", 400, "parameter_missing", "charge"),
        (
            "/v1/refunds?charge=ch_unknown",
            404,
            "resource_missing",
            "no such charge",
        ),
        (
            "/v1/charges?starting_after=ch_unknown",
            400,
            "resource_missing",
            "starting_after",
        ),
    ];
    for (path, status, code, starts) in cases {
        let answer = p.get(path).await;
        assert_eq!(answer.error(), (status, code), "{path}: {answer:?}");
        let message = answer.body["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(starts), "{path}: {message}");
    }
    // Brackets may come percent-encoded, as form encoders send them.
    let encoded = p
        .get("/v1/charges?created%5Bgte%5D=0&created%5Blte%5D=9")
        .await;
    assert_eq!(encoded.status, 200, "{encoded:?}");
    assert_eq!(p.totals(), Effects::default());
}

// ---------------------------------------------------------------------------
// Stripe dialect

async fn stripe_intent_as(
    p: &Provider,
    caller: &str,
    pairs: &[(&str, &str)],
) -> common::stripe::Reply {
    let reply = p.stripe_post_as(caller, INTENTS, None, pairs).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    reply
}

#[tokio::test]
async fn stripe_payment_intent_list_pages_newest_first_and_ignores_search_lag() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::SearchLag).with_lag_seconds(3600),
    );
    let mut made = Vec::new();
    for i in 0..4 {
        let order = format!("o-{i}:authorize-v1");
        let method = if i % 2 == 0 { "manual" } else { "automatic" };
        made.push(
            stripe_intent_as(&p, SK, &intent_form(method, &order))
                .await
                .id()
                .to_owned(),
        );
    }
    // One that never reached the card is listed too.
    let unconfirmed = [("amount", "500"), ("currency", "eur")];
    made.push(stripe_intent_as(&p, SK, &unconfirmed).await.id().to_owned());
    made.reverse();

    assert!(
        p.stripe_search_as(SK, "metadata['cobro_account']:'acct_1'")
            .await
            .is_empty(),
        "search lags"
    );
    let (listed, pages) = stripe_pages(&p, SK, INTENTS, &[], 2).await;
    assert_eq!((listed, pages), (made, vec![2, 2, 1]));
    assert_eq!(p.totals(), charges(4));
}

#[tokio::test]
async fn stripe_created_filters_take_gt_gte_lt_lte_and_an_exact_time() {
    let p = provider().await;
    let mut made = Vec::new();
    for i in 0..3 {
        if i > 0 {
            p.control.advance_clock(Duration::from_secs(10));
        }
        let order = format!("o-{i}:authorize-v1");
        made.push(stripe_intent_as(&p, SK, &intent_form("automatic", &order)).await);
    }
    let [a, b, c] = [0, 1, 2].map(|i| made[i].body["created"].as_i64().unwrap());
    let [id_a, id_b, id_c] = [0, 1, 2].map(|i| made[i].id());
    // (created parameters, PaymentIntents listed)
    type Case<'a> = (Vec<(&'static str, String)>, Vec<&'a str>);
    let cases: Vec<Case<'_>> = vec![
        (vec![("created[gte]", b.to_string())], vec![id_c, id_b]),
        (vec![("created[gt]", b.to_string())], vec![id_c]),
        (vec![("created[lte]", b.to_string())], vec![id_b, id_a]),
        (vec![("created[lt]", b.to_string())], vec![id_a]),
        (vec![("created", b.to_string())], vec![id_b]),
        (
            vec![
                ("created[gt]", a.to_string()),
                ("created[lt]", c.to_string()),
            ],
            vec![id_b],
        ),
        // Two lower bounds: the tighter one holds.
        (
            vec![
                ("created[gte]", a.to_string()),
                ("created[gt]", a.to_string()),
            ],
            vec![id_c, id_b],
        ),
    ];
    for (pairs, expected) in cases {
        let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let reply = p.stripe_get(&format!("{INTENTS}?{}", form(&pairs))).await;
        assert_eq!(reply.status, 200, "{pairs:?}: {reply:?}");
        assert_eq!(ids(&reply.body["data"]), expected, "{pairs:?}");
    }
    assert_eq!(p.totals(), charges(3));
}

#[tokio::test]
async fn stripe_lists_show_only_the_callers_own_objects() {
    let p = provider().await;
    // Twins sharing every name: metadata, amounts, idempotency key.
    let pairs = intent_form("automatic", "o-1:authorize-v1");
    let mine = p.stripe_post_as(SK, INTENTS, Some("k-1"), &pairs).await;
    let theirs = p.stripe_post_as(SK_B, INTENTS, Some("k-1"), &pairs).await;
    for caller in [SK, SK_B] {
        let intent = if caller == SK { &mine } else { &theirs };
        p.stripe_post_as(
            caller,
            "/v1/refunds",
            None,
            &[("payment_intent", intent.id()), ("amount", "100")],
        )
        .await;
    }

    for (caller, intent, other) in [(SK, &mine, &theirs), (SK_B, &theirs, &mine)] {
        let (listed, _) = stripe_pages(&p, caller, INTENTS, &[], 10).await;
        assert_eq!(listed, [intent.id()]);
        let (refunds, _) = stripe_pages(
            &p,
            caller,
            "/v1/refunds",
            &[("payment_intent", intent.id())],
            10,
        )
        .await;
        assert_eq!(refunds.len(), 1);
        let cursor = p
            .stripe_get_as(caller, &format!("{INTENTS}?starting_after={}", other.id()))
            .await;
        assert_eq!(
            cursor.error(),
            (400, "invalid_request_error", "resource_missing")
        );
        assert_eq!(cursor.param(), "starting_after");
    }
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2).refunds(2));
    assert_eq!(
        ledger.charge_of_payment_intent(mine.id()).unwrap().caller,
        SK
    );
    assert_eq!(
        ledger.charge_of_payment_intent(theirs.id()).unwrap().caller,
        SK_B
    );
}

#[tokio::test]
async fn the_stripe_refund_list_ignores_search_lag_and_refuses_an_unknown_cursor() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Refund, FaultAction::SearchLag).with_lag_seconds(3600),
    );
    let pi = stripe_intent_as(&p, SK, &intent_form("automatic", "o-1:authorize-v1")).await;
    let mut made = Vec::new();
    for _ in 0..3 {
        let refund = p
            .stripe_post(
                "/v1/refunds",
                None,
                &[("payment_intent", pi.id()), ("amount", "100")],
            )
            .await;
        made.push(refund.id().to_owned());
    }
    made.reverse();

    let by_intent = [("payment_intent", pi.id())];
    let (listed, pages) = stripe_pages(&p, SK, "/v1/refunds", &by_intent, 2).await;
    assert_eq!((listed, pages), (made, vec![2, 1]));
    let unknown = p
        .stripe_get(&format!(
            "/v1/refunds?payment_intent={}&starting_after=re_unknown",
            pi.id()
        ))
        .await;
    assert_eq!(
        unknown.error(),
        (400, "invalid_request_error", "resource_missing")
    );
    assert_eq!(unknown.param(), "starting_after");
    assert_eq!(p.totals(), charges(1).refunds(3));
}

#[tokio::test]
async fn the_list_fault_fails_stripe_lists_while_reads_and_searches_work() {
    let p = provider().await;
    let pi = stripe_intent_as(&p, SK, &intent_form("automatic", "o-1:authorize-v1")).await;
    p.control.add_fault(FaultRule::new(
        Operation::List,
        FaultAction::FailBeforeEffect,
    ));

    let listed = p.stripe_get(INTENTS).await;
    assert_eq!(listed.error(), (500, "api_error", ""));
    assert_eq!(listed.should_retry.as_deref(), Some("true"));
    let refunds = p
        .stripe_get(&format!("/v1/refunds?payment_intent={}", pi.id()))
        .await;
    assert_eq!(refunds.error(), (500, "api_error", ""));
    let read = p.stripe_get(&format!("{INTENTS}/{}", pi.id())).await;
    assert_eq!(read.status, 200);
    assert_eq!(
        p.stripe_search_as(SK, "metadata['cobro_intent']:'o-1:authorize-v1'")
            .await,
        [pi.id()]
    );
    p.control.clear_faults();
    assert_eq!(ids(&p.stripe_get(INTENTS).await.body["data"]), [pi.id()]);
    assert_eq!(p.totals(), charges(1));
}

#[tokio::test]
async fn stripe_list_parameters_are_refused_in_stripes_error_shape() {
    let p = provider().await;
    let cases = [
        ("limit=0", "parameter_invalid_integer", "limit"),
        ("limit=101", "parameter_invalid_integer", "limit"),
        (
            "created[gte]=soon",
            "parameter_invalid_integer",
            "created[gte]",
        ),
        ("created=soon", "parameter_invalid_integer", "created"),
        ("created[after]=1", "parameter_unknown", "created[after]"),
        ("ending_before=pi_1", "parameter_unknown", "ending_before"),
        ("customer=cus_1", "parameter_unknown", "customer"),
        (
            "starting_after=",
            "parameter_invalid_empty",
            "starting_after",
        ),
        (
            "starting_after=pi_unknown",
            "resource_missing",
            "starting_after",
        ),
    ];
    for (raw, code, param) in cases {
        let reply = p.stripe_get(&format!("{INTENTS}?{raw}")).await;
        assert_eq!(
            reply.error(),
            (400, "invalid_request_error", code),
            "{raw}: {reply:?}"
        );
        assert_eq!(reply.param(), param, "{raw}");
        assert!(reply.request_id.is_some());
    }
    assert_eq!(p.totals(), Effects::default());
}

// ---------------------------------------------------------------------------
// The `processing` fault

#[tokio::test]
async fn a_processing_charge_answers_pending_and_counts_once_when_it_settles() {
    let p = provider().await;
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::Processing)
            .with_lag_seconds(30)
            .with_next(1),
    );
    let created = p.charge(Some("k-1"), "o-1").await;
    assert_eq!(created.status, 201, "{created:?}");
    assert_eq!(
        (&created.body["status"], &created.body["sequence"]),
        (&json!("processing"), &json!(1))
    );
    let path = format!("/v1/charges/{}", created.id());

    // Pending: nothing counted, nothing capturable, listed as it is.
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, Effects::default());
    assert_eq!(ledger.charge(created.id()).unwrap().status, "processing");
    let capture = p.capture(created.id(), None, json!({})).await;
    assert_eq!(capture.error(), (400, "charge_not_capturable"));
    assert_eq!(capture.body["charge"]["status"], "processing");
    let listed = p.get("/v1/charges?limit=1").await;
    assert_eq!(listed.body["data"][0]["status"], "processing");
    p.control.advance_clock(Duration::from_secs(29));
    assert_eq!(p.get(&path).await.body["status"], "processing");
    assert_eq!(p.totals(), Effects::default());

    // Final after 30 s of virtual time: authorized, counted once, under
    // its reference and key; the key still replays the first answer.
    p.control.advance_clock(Duration::from_secs(1));
    let read = p.get(&path).await;
    assert_eq!(
        (&read.body["status"], &read.body["sequence"]),
        (&json!("authorized"), &json!(2))
    );
    let replay = p.charge(Some("k-1"), "o-1").await;
    assert_eq!((replay.replayed, &replay.body), (true, &created.body));
    let captured = p.capture(created.id(), None, json!({})).await;
    assert_eq!(captured.body["status"], "captured");
    p.control.advance_clock(Duration::from_secs(3600));
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(1).captures(1));
    assert_eq!(ledger.for_key("k-1"), charges(1));
    assert_eq!(ledger.for_reference("o-1"), charges(1).captures(1));
    assert_eq!(ledger.charge(created.id()).unwrap().status, "captured");
}

#[tokio::test]
async fn a_processing_charge_settles_as_it_would_have_been_once_its_time_passes() {
    let p = provider().await;
    p.control
        .add_fault(FaultRule::new(Operation::Charge, FaultAction::Processing));
    let mut declining = charge_body("o-declined");
    declining["payment_method"] = json!("pm_card_declined");
    let declined = p.post("/v1/charges", None, &declining).await.unwrap();
    assert_eq!(
        (declined.status, &declined.body["status"]),
        (201, &json!("processing")),
        "the decline is not known yet"
    );
    let mut automatic = charge_body("o-captured");
    automatic["capture"] = json!(true);
    let captured = p.post("/v1/charges", None, &automatic).await.unwrap();
    assert_eq!(captured.body["amount_captured"], 0);

    // The default pending time is 60 s.
    p.control.advance_clock(Duration::from_secs(60));
    let listed = p.get("/v1/charges?limit=10").await;
    let statuses: Vec<&Value> = listed.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|charge| &charge["status"])
        .collect();
    assert_eq!(statuses, [&json!("captured"), &json!("declined")]);
    assert_eq!(listed.body["data"][0]["amount_captured"], 1250);
    assert_eq!(p.totals(), charges(1).declines(1));
    assert_eq!(p.effects_of("o-declined"), declines(1));
}

#[tokio::test]
async fn a_processing_payment_intent_answers_200_processing_and_settles_to_its_outcome() {
    let p = provider().await;
    let hooks = accepting_receiver().await;
    p.control.set_webhook(Some(WebhookTarget {
        url: hooks,
        secret: "whsec_lists".to_owned(),
    }));
    p.control.set_webhook_dialect(WebhookDialect::Stripe);
    p.control.add_fault(
        FaultRule::new(Operation::Charge, FaultAction::Processing)
            .with_reference("cobro_intent=o-1:")
            .with_lag_seconds(10),
    );
    let pi = stripe_intent_as(&p, SK, &intent_form("automatic", "o-1:authorize-v1")).await;
    assert_eq!(pi.status_of(), "processing");
    assert_eq!(
        (
            &pi.body["amount_received"],
            pi.body["latest_charge"].is_string()
        ),
        (&json!(0), true)
    );
    let path = format!("{INTENTS}/{}", pi.id());
    let cancel = p.stripe_post(&format!("{path}/cancel"), None, &[]).await;
    assert_eq!(
        cancel.error(),
        (
            400,
            "invalid_request_error",
            "payment_intent_unexpected_state"
        )
    );
    let refund = p
        .stripe_post("/v1/refunds", None, &[("payment_intent", pi.id())])
        .await;
    assert_eq!(
        refund.error(),
        (400, "invalid_request_error", "charge_not_refundable")
    );
    assert_eq!(p.totals(), Effects::default());
    assert_eq!(
        p.control
            .ledger()
            .charge_of_payment_intent(pi.id())
            .unwrap()
            .status,
        "processing"
    );

    p.control.advance_clock(Duration::from_secs(10));
    let read = p.stripe_get(&path).await;
    assert_eq!(
        (read.status_of(), &read.body["amount_received"]),
        ("succeeded", &json!(1250))
    );
    let manual = stripe_intent_as(&p, SK, &intent_form("manual", "o-1:authorize-v2")).await;
    assert_eq!(manual.status_of(), "processing");
    p.control.advance_clock(Duration::from_secs(10));
    let listed = p.stripe_get(INTENTS).await;
    assert_eq!(listed.body["data"][0]["status"], "requires_capture");
    let ledger = p.control.ledger();
    assert_eq!(ledger.totals, charges(2));
    assert_eq!(
        ledger.charge_of_payment_intent(pi.id()).unwrap().status,
        "captured"
    );

    let kinds = [
        "payment_intent.processing",
        "payment_intent.succeeded",
        "payment_intent.processing",
        "payment_intent.amount_capturable_updated",
    ];
    wait_until("the four events delivered", || async {
        let delivered: Vec<String> = p
            .control
            .webhook_deliveries()
            .into_iter()
            .map(|delivery| delivery.event_type)
            .collect();
        delivered == kinds
    })
    .await;
}

#[test]
fn processing_applies_to_charges_and_search_lag_not_to_lists() {
    let rule = |operation, action| FaultRule::new(operation, action).validate();
    assert!(rule(Operation::Charge, FaultAction::Processing).is_ok());
    assert!(rule(Operation::Any, FaultAction::Processing).is_ok());
    assert!(rule(Operation::Capture, FaultAction::Processing).is_err());
    assert!(rule(Operation::List, FaultAction::SearchLag).is_err());
    assert!(rule(Operation::List, FaultAction::FailBeforeEffect).is_ok());
    assert!(rule(Operation::List, FaultAction::Latency).is_ok());
    let parsed: FaultRule =
        serde_json::from_value(json!({"operation": "list", "action": "processing"})).unwrap();
    assert_eq!(
        (parsed.operation, parsed.action),
        (Operation::List, FaultAction::Processing)
    );
}

/// A webhook target that acknowledges every delivery.
async fn accepting_receiver() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hooks", listener.local_addr().unwrap());
    let app = Router::new().route("/hooks", post(|| async { StatusCode::OK }));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}
