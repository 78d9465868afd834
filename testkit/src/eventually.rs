//! Waiting in tests by polling a condition, never by sleeping a fixed time:
//! a fixed sleep is either too short on a loaded machine (a flaky test) or
//! longer than needed everywhere else (a slow one).

use std::future::Future;
use std::time::Duration;

/// How often [`eventually`] polls.
const EVERY: Duration = Duration::from_millis(10);

/// Polls `check` every few milliseconds until it returns `Some`, and returns
/// that value.
///
/// # Panics
///
/// When `deadline` passes first, naming `what` was awaited.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let until = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "never within {deadline:?}: {what}"
        );
        tokio::time::sleep(EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_first_value_the_check_gives() {
        let mut calls = 0;
        let got = eventually("the third call", Duration::from_secs(5), || {
            calls += 1;
            let n = calls;
            async move { (n == 3).then_some(n) }
        })
        .await;
        assert_eq!(got, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "never within 50ms: nothing")]
    async fn fails_at_the_deadline_naming_what_it_awaited() {
        eventually("nothing", Duration::from_millis(50), || async {
            None::<()>
        })
        .await;
    }
}
