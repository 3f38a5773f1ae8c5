-- An orphan an operator adopted (`cobro books adopt`, docs/books.md): the
-- payment it was recorded under again. Adopted orphans are `acknowledged`
-- too: resolved.
ALTER TABLE books_orphans ADD COLUMN adopted_payment TEXT;
