//! The `tojson` filter as transformers defines it for chat templates:
//! Python's `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`, each option a keyword argument.
//!
//! minijinja's own `tojson` differs in ways that change tokens: it escapes
//! `<`, `>`, `&` and `'` for HTML and has no `ensure_ascii`, `separators` or
//! `sort_keys`. Maps are written in minijinja's iteration order (a map
//! literal in a template is sorted by key, where Python keeps insertion
//! order); messages keep `role`, `content` order as transformers' dicts do.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Nesting deeper than this is an error rather than a stack overflow.
const MAX_DEPTH: usize = 128;

/// The template filter.
pub fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or("").to_owned()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            None => {
                return Err(invalid(
                    "tojson: indent must be an integer, a string or none",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let pair: Vec<Value> = v.try_iter()?.collect();
            match pair.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => (
                    item.as_str().unwrap_or_default().to_owned(),
                    key.as_str().unwrap_or_default().to_owned(),
                ),
                _ => return Err(invalid("tojson: separators must be two strings")),
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let mut writer = Writer {
        out: String::new(),
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    writer.value(value, 0)?;
    Ok(writer.out)
}

struct Writer {
    out: String,
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Writer {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        if depth > MAX_DEPTH {
            return Err(invalid("tojson: value nested too deeply"));
        }
        match value.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.number(value)?,
            ValueKind::String => self.string(value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container('[', ']', items.len(), depth, |w, i| {
                    w.value(&items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    entries.push((key_string(&key)?, value.get_item(&key)?));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', entries.len(), depth, |w, i| {
                    w.string(&entries[i].0);
                    w.out.push_str(&w.key_sep);
                    w.value(&entries[i].1, depth + 1)
                })?;
            }
            kind => {
                return Err(invalid(format!(
                    "tojson: a value of kind {kind} is not JSON serializable"
                )));
            }
        }
        Ok(())
    }

    /// Writes `len` items between `open` and `close` the way Python's
    /// encoder lays them out for the configured indent.
    fn container(
        &mut self,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        let newline = |w: &Self, level: usize| {
            w.indent
                .as_ref()
                .map(|unit| format!("\n{}", unit.repeat(level)))
        };
        let inner = newline(self, depth + 1);
        if let Some(inner) = &inner {
            self.out.push_str(inner);
        }
        for i in 0..len {
            if i > 0 {
                self.out.push_str(&self.item_sep);
                if let Some(inner) = &inner {
                    self.out.push_str(inner);
                }
            }
            item(self, i)?;
        }
        if let Some(outer) = newline(self, depth) {
            self.out.push_str(&outer);
        }
        self.out.push(close);
        Ok(())
    }

    fn number(&mut self, value: &Value) -> Result<(), Error> {
        if value.is_integer() {
            let n = i128::try_from(value.clone())?;
            let _ = write!(self.out, "{n}");
        } else {
            let x = f64::try_from(value.clone())?;
            self.out.push_str(&float_repr(x));
        }
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// A map key as Python's encoder writes it: strings as is, numbers, booleans
/// and none converted; anything else is an error.
fn key_string(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number if key.is_integer() => Ok(i128::try_from(key.clone())?.to_string()),
        ValueKind::Number => Ok(float_repr(f64::try_from(key.clone())?)),
        kind => Err(invalid(format!("tojson: keys must be strings, not {kind}"))),
    }
}

/// Python's `repr(float)` as `json.dumps` writes it: the shortest digits
/// that round-trip, positional for exponents -4..16, else `1e+16` style;
/// non-finite values as `NaN`, `Infinity`, `-Infinity`.
fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_owned();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = x.to_string();
        if s.contains('.') { s } else { s + ".0" }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
    }
}

fn invalid(detail: impl Into<std::borrow::Cow<'static, str>>) -> Error {
    Error::new(ErrorKind::InvalidOperation, detail)
}

#[cfg(test)]
mod tests {
    use minijinja::Environment;

    use super::*;

    /// Renders `expr | tojson(...)` with only this filter installed.
    fn render(source: &str) -> Result<String, Error> {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(source, ())
    }

    // Expected strings below are Python 3's `json.dumps` output for the same
    // values with transformers' defaults.

    #[test]
    fn scalars_and_strings_match_python() {
        assert_eq!(
            render(r#"{{ [1, 2.5, 1e16, 1.5e-5, -0.0, none, true] | tojson }}"#).unwrap(),
            "[1, 2.5, 1e+16, 1.5e-05, -0.0, null, true]"
        );
        assert_eq!(
            render("{{ \"x<'>&é\\u007f\\u2028🦀\\n\\u0001\\\"\\\\\" | tojson }}").unwrap(),
            "\"x<'>&é\u{7f}\u{2028}🦀\\n\\u0001\\\"\\\\\""
        );
        assert_eq!(
            render(r#"{{ "é🦀" | tojson(ensure_ascii=true) }}"#).unwrap(),
            r#""\u00e9\ud83e\udd80""#
        );
    }

    #[test]
    fn containers_match_python() {
        assert_eq!(
            render(r#"{{ {"a": [], "b": {}} | tojson }}"#).unwrap(),
            r#"{"a": [], "b": {}}"#
        );
        assert_eq!(
            render(r#"{{ {"b": [1, {"z": 1}], "a": []} | tojson(indent=2, sort_keys=true) }}"#)
                .unwrap(),
            "{\n  \"a\": [],\n  \"b\": [\n    1,\n    {\n      \"z\": 1\n    }\n  ]\n}"
        );
        assert_eq!(
            render(
                r#"{{ {"b": 1, "a": [1, 2]} | tojson(separators=[",", ":"], sort_keys=true) }}"#
            )
            .unwrap(),
            r#"{"a":[1,2],"b":1}"#
        );
        assert_eq!(
            render(r#"{{ [1, [2]] | tojson(indent=0) }}"#).unwrap(),
            "[\n1,\n[\n2\n]\n]"
        );
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(render("{{ 1 | tojson(indent=[1]) }}").is_err());
        assert!(render("{{ 1 | tojson(colour=1) }}").is_err());
        assert!(render("{{ x | tojson }}").is_err());
    }
}
