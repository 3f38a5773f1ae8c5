//! Reading a cursor-paged list to its end: the consistent lists that prove
//! absence and Stripe's search. One page that fails is read again (a GET
//! changes nothing at the provider, and Stripe's own libraries retry
//! them); a page that still fails fails the whole read, which then proves
//! nothing. Without the second read a long window (ten pages on a busy
//! account) would almost never be read whole while the provider sheds a
//! share of its requests, and every uncertain attempt in it would wait for
//! the horizon.

use crate::{ProviderObject, QueryError};
use std::future::Future;
use std::time::Duration;

/// One page as read: the objects kept from it, the cursor of the next
/// page (the last object's id, or the provider's next-page token), and
/// whether the provider says more follow.
pub(crate) struct Page {
    pub(crate) kept: Vec<ProviderObject>,
    pub(crate) next: Option<String>,
    pub(crate) has_more: bool,
}

impl From<Page> for crate::LedgerPage {
    fn from(page: Page) -> Self {
        crate::LedgerPage {
            next: page.next.filter(|_| page.has_more),
            objects: page.kept,
        }
    }
}

/// Reads of one page before the list fails.
const READS_PER_PAGE: u32 = 3;
/// The pause before a page's second read; doubled before each further one.
const FIRST_PAUSE: Duration = Duration::from_millis(100);

/// Every page of `what`, `read(cursor)` giving one (`None`: the first),
/// at most `max_pages` of them: more prove nothing, like any failure.
pub(crate) async fn read_to_end<F, Fut>(
    max_pages: usize,
    what: &str,
    mut read: F,
) -> Result<Vec<ProviderObject>, QueryError>
where
    F: FnMut(Option<String>) -> Fut,
    Fut: Future<Output = Result<Page, QueryError>>,
{
    let mut found = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..max_pages {
        let page = read_page(&mut read, &cursor).await?;
        found.extend(page.kept);
        match (page.has_more, page.next) {
            (false, _) => return Ok(found),
            (true, Some(next)) => cursor = Some(next),
            (true, None) => {
                return Err(QueryError(format!(
                    "a page of {what} has more but no cursor"
                )));
            }
        }
    }
    Err(QueryError(format!("more than {max_pages} pages of {what}")))
}

/// One page, read again (up to [`READS_PER_PAGE`] reads) while it fails.
pub(crate) async fn read_page<F, Fut>(
    read: &mut F,
    cursor: &Option<String>,
) -> Result<Page, QueryError>
where
    F: FnMut(Option<String>) -> Fut,
    Fut: Future<Output = Result<Page, QueryError>>,
{
    let mut pause = FIRST_PAUSE;
    let mut reads = 1;
    loop {
        match read(cursor.clone()).await {
            Ok(page) => return Ok(page),
            Err(e) if reads >= READS_PER_PAGE => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, reads, "a page read failed; reading it again");
                tokio::time::sleep(pause).await;
                pause *= 2;
                reads += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ProviderStatus;
    use std::cell::Cell;

    fn object(id: &str) -> ProviderObject {
        ProviderObject {
            id: id.to_owned(),
            status: ProviderStatus::Captured,
            reference: None,
            amount: None,
            amount_captured: None,
            sequence: None,
            currency: None,
            capture_method: None,
            charge: None,
            metadata: Default::default(),
            next_action: None,
            decline_code: None,
            confirmable: false,
        }
    }

    /// Pages `ch_0`..`ch_{n-1}`, one object each; `fails(page, read)`
    /// says whether that read of that page fails.
    async fn pages(
        n: usize,
        max_pages: usize,
        fails: impl Fn(usize, u32) -> bool,
    ) -> (Result<Vec<ProviderObject>, QueryError>, u32) {
        let reads = Cell::new(0u32);
        let tries = std::cell::RefCell::new(std::collections::HashMap::<usize, u32>::new());
        let result = read_to_end(max_pages, "charges", |cursor| {
            reads.set(reads.get() + 1);
            let at = cursor.map_or(0, |c| c[3..].parse::<usize>().expect("cursor") + 1);
            let read = {
                let mut tries = tries.borrow_mut();
                let t = tries.entry(at).or_default();
                *t += 1;
                *t
            };
            let failed = fails(at, read);
            async move {
                if failed {
                    return Err(QueryError("status 503".into()));
                }
                Ok(Page {
                    kept: vec![object(&format!("ch_{at}"))],
                    next: Some(format!("ch_{at}")),
                    has_more: at + 1 < n,
                })
            }
        })
        .await;
        (result, reads.get())
    }

    #[tokio::test(start_paused = true)]
    async fn a_page_that_fails_twice_is_read_a_third_time_and_the_list_is_whole() {
        let (found, reads) = pages(4, 10, |page, read| page == 2 && read <= 2).await;
        let ids: Vec<String> = found.expect("whole").into_iter().map(|o| o.id).collect();
        assert_eq!(ids, ["ch_0", "ch_1", "ch_2", "ch_3"]);
        assert_eq!(reads, 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_page_that_fails_three_times_fails_the_list() {
        let (found, reads) = pages(4, 10, |page, _| page == 1).await;
        assert_eq!(found.expect_err("no proof").0, "status 503");
        assert_eq!(reads, 1 + 3);
    }

    #[tokio::test(start_paused = true)]
    async fn more_pages_than_allowed_prove_nothing() {
        let (found, reads) = pages(5, 4, |_, _| false).await;
        assert_eq!(
            found.expect_err("too long").0,
            "more than 4 pages of charges"
        );
        assert_eq!(reads, 4);
    }
}
