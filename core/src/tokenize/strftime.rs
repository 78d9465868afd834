//! `strftime_now(format)`, the template global transformers provides (Llama
//! 3.1 and later put today's date in the system prompt with it).
//!
//! Minimal on purpose: `%Y` (four-digit year), `%m` and `%d` (two digits),
//! `%b` and `%B` (English month names, as Python's C locale gives) and `%%`.
//! Any other directive is an error rather than a guess, so a prompt this
//! module cannot reproduce fails loudly. The date is UTC; transformers uses
//! the engine's local time, which on a pod is UTC unless `TZ` says otherwise.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Error, ErrorKind};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The template function: formats the current UTC date.
pub fn strftime_now(format: &str) -> Result<String, Error> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_date(format, now / 86_400)
        .map_err(|detail| Error::new(ErrorKind::InvalidOperation, detail))
}

/// Formats the date `days` days after 1970-01-01.
pub fn format_date(format: &str, days: u64) -> Result<String, String> {
    let (year, month, day) = civil_from_days(days);
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::with_capacity(format.len() + 8);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&format!("{year:04}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('%') => out.push('%'),
            Some(other) => {
                return Err(format!(
                    "strftime_now: unsupported directive %{other} (supported: %Y %m %d %b %B %%)"
                ));
            }
            None => return Err("strftime_now: format ends with a lone %".to_owned()),
        }
    }
    Ok(out)
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01, by
/// Howard Hinnant's `civil_from_days`.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_dates() {
        assert_eq!(format_date("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        // 2024-02-29 is day 19_782; a leap day checks the calendar maths.
        assert_eq!(format_date("%d %b %Y", 19_782).unwrap(), "29 Feb 2024");
        assert_eq!(
            format_date("%B %d, %Y", 20_088).unwrap(),
            "December 31, 2024"
        );
        assert_eq!(format_date("100%% on %Y", 10_957).unwrap(), "100% on 2000");
    }

    #[test]
    fn unsupported_directives_are_errors() {
        let err = format_date("%H:%M", 0).unwrap_err();
        assert!(err.contains("%H"), "{err}");
        assert!(format_date("50%", 0).is_err());
    }

    #[test]
    fn now_renders() {
        let year = strftime_now("%Y").unwrap();
        assert!(year.len() == 4 && year.as_str() >= "2024", "{year}");
    }
}
