"""Schemathesis hooks for cobro (loaded through SCHEMATHESIS_HOOKS=hooks).

- Every request that carries a valid Idempotency-Key gets a fresh one just
  before it is sent, in every phase (the schema's example key, or two
  generated keys that happen to be equal, would otherwise meet a legitimate
  422 idempotency-key-reused). Keys made invalid on purpose by negative
  generation are left as they are, so their refusal is still checked.
- Bodies whose `amount` is a JSON number with a fraction part or exponent
  (`1999.0`) are not generated: JSON Schema's `integer` admits them, while
  cobro refuses every spelling but a plain integer (docs/http-api.md
  §4 and §6), which no schema keyword can say.
- The concurrent phase of ops/fuzz.sh (COBRO_FUZZ_ORDER_REFS set, a
  comma-separated list): every valid `order_ref`, in a create's body and
  in the list's query, becomes one of those few shared refs, and every
  valid `payment_method` one the fake provider authorizes (`pm_card_visa`:
  the payment holds its order) or refuses at once (`pm_card_declined`:
  it fails while others create), so the runs driving the server at once
  meet on the same orders. Values made invalid on purpose are left as
  they are (their refusal is still checked), and a valid value is only
  replaced by a valid one, so no negative case turns positive.
"""

import os
import random
import re
import uuid

import schemathesis

# docs/http-api.md §3: bare, or one structured-field string.
VALID_KEY = re.compile(r'^(?:[!-~]{1,255}|"[!#-\[\]-~]{1,255}")$')
# cobro_core::OrderRef::parse, and the create's payment_method rule.
VALID_ORDER_REF = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
VALID_PAYMENT_METHOD = re.compile(r"^[!-~]{1,128}$")
RACE_ORDER_REFS = [r for r in os.environ.get("COBRO_FUZZ_ORDER_REFS", "").split(",") if r]
# Two refusals to one hold: an authorized payment with automatic capture
# holds its order for good, so most creates fail at once and keep the
# orders changing hands while the runs race.
RACE_PAYMENT_METHODS = ["pm_card_visa", "pm_card_declined", "pm_card_declined"]


@schemathesis.hook
def before_call(context, case, kwargs):
    headers = case.headers or {}
    for name in list(headers):
        value = headers[name]
        if name.lower() == "idempotency-key" and isinstance(value, str) and VALID_KEY.match(value):
            headers[name] = str(uuid.uuid4())
    if RACE_ORDER_REFS:
        share_orders(case)


def share_orders(case):
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("order_ref"), str) and VALID_ORDER_REF.match(body["order_ref"]):
            body["order_ref"] = random.choice(RACE_ORDER_REFS)
        method = body.get("payment_method")
        if isinstance(method, str) and VALID_PAYMENT_METHOD.match(method):
            body["payment_method"] = random.choice(RACE_PAYMENT_METHODS)
    query = case.query
    if isinstance(query, dict) and isinstance(query.get("order_ref"), str) \
            and "\x00" not in query["order_ref"]:
        query["order_ref"] = random.choice(RACE_ORDER_REFS)


@schemathesis.hook
def filter_body(context, body):
    return not (isinstance(body, dict) and isinstance(body.get("amount"), float))
