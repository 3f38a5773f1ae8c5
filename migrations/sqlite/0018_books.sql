-- The books (issue 46, docs/books.md): cobro's record matched against the
-- provider's own ledger. The PostgreSQL twin is ../postgres/0018_books.sql.

-- One row per books run, with its window and counts: what an operator and
-- a finance team read back (`cobro books runs`).
CREATE TABLE books_runs (
    id           TEXT PRIMARY KEY,
    provider     TEXT NOT NULL,
    trigger      TEXT NOT NULL,
    actor        TEXT NOT NULL,
    dry_run      INTEGER NOT NULL,
    -- The provider's creation times listed, unix seconds, both included.
    window_from  INTEGER NOT NULL,
    window_to    INTEGER NOT NULL,
    started_at   TEXT NOT NULL,
    finished_at  TEXT,
    objects      INTEGER NOT NULL DEFAULT 0,
    matched      INTEGER NOT NULL DEFAULT 0,
    orphans      INTEGER NOT NULL DEFAULT 0,
    foreign_objects INTEGER NOT NULL DEFAULT 0,
    drifted      INTEGER NOT NULL DEFAULT 0,
    missing      INTEGER NOT NULL DEFAULT 0,
    -- Why the run did not finish (a list that failed): it proves nothing.
    error        TEXT,
    -- The whole report (JSON text).
    report       TEXT
);
CREATE INDEX books_runs_by_provider ON books_runs (provider, started_at);

-- How far each provider's ledger has been read: the next scheduled run
-- starts from here, minus the overlap.
CREATE TABLE books_cursors (
    provider    TEXT PRIMARY KEY,
    listed_to   INTEGER NOT NULL,
    updated_at  TEXT NOT NULL
);

-- Objects at the provider that carry cobro's metadata but no attempt of
-- cobro's: everything the metadata says, kept until an operator resolves
-- them. Metadata is kept as the provider echoed it (text), never trusted
-- as a key of cobro's tables.
CREATE TABLE books_orphans (
    id              TEXT PRIMARY KEY,
    provider        TEXT NOT NULL,
    object_id       TEXT NOT NULL,
    kind            TEXT NOT NULL CHECK (kind IN ('charge', 'refund')),
    account_id      TEXT,
    payment_id      TEXT,
    intent          TEXT,
    attempt_id      TEXT,
    reference       TEXT,
    charge          TEXT,
    amount          INTEGER,
    amount_captured INTEGER,
    currency        TEXT,
    status          TEXT NOT NULL,
    provider_said   TEXT NOT NULL,
    found_run       TEXT NOT NULL,
    found_at        TEXT NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('open', 'acknowledged')),
    resolved_by     TEXT,
    reason          TEXT,
    resolved_at     TEXT,
    UNIQUE (provider, object_id)
);
CREATE INDEX books_orphans_open ON books_orphans (found_at) WHERE state = 'open';

-- The books' side of cobro: successful authorisations and refunds by
-- their first send, read page by page for a window ("missing").
CREATE INDEX attempts_settled_by_send ON attempts (first_send_at, id)
    WHERE state = 'succeeded' AND operation IN ('authorize', 'refund');

-- What a refund listed without cobro's metadata refunds, and whether cobro
-- already recorded it: looked up by the provider's ids.
CREATE INDEX payments_by_provider_ref ON payments (provider_ref) WHERE provider_ref IS NOT NULL;
CREATE INDEX refunds_by_provider_ref ON refunds (provider_ref) WHERE provider_ref IS NOT NULL;
