"""Schemathesis hooks for cobro (loaded through SCHEMATHESIS_HOOKS=hooks).

- Every request that carries a valid Idempotency-Key gets a fresh one just
  before it is sent, in every phase (the schema's example key, or two
  generated keys that happen to be equal, would otherwise meet a legitimate
  422 idempotency-key-reused). Keys made invalid on purpose by negative
  generation are left as they are, so their refusal is still checked.
- Bodies whose `amount` is a JSON number with a fraction part or exponent
  (`1999.0`) are not generated: JSON Schema's `integer` admits them, while
  cobro refuses every spelling but a plain integer (payments-api.md
  section 4), which no schema keyword can say.
"""

import re
import uuid

import schemathesis

# payments-api.md section 3: bare, or one structured-field string.
VALID_KEY = re.compile(r'^(?:[!-~]{1,255}|"[!#-\[\]-~]{1,255}")$')


@schemathesis.hook
def before_call(context, case, kwargs):
    headers = case.headers or {}
    for name in list(headers):
        value = headers[name]
        if name.lower() == "idempotency-key" and isinstance(value, str) and VALID_KEY.match(value):
            headers[name] = str(uuid.uuid4())


@schemathesis.hook
def filter_body(context, body):
    return not (isinstance(body, dict) and isinstance(body.get("amount"), float))
