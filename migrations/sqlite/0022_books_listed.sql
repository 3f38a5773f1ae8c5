-- What a books run listed (docs/books.md, "Memory"): the provider ids of
-- the objects its window holds, written a page at a time as they are
-- listed, so that "missing" reads them from here instead of the run
-- holding every id of its window in memory. Rows live as long as their
-- run; a run that died leaves them to the next run's cleanup.
CREATE TABLE books_listed (
    run_id     TEXT NOT NULL,
    object_id  TEXT NOT NULL,
    PRIMARY KEY (run_id, object_id)
);
