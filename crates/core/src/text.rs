//! Rules about text that every input path shares.

use serde_json::{Map, Value};

/// The first field whose name or text (at any depth) holds U+0000, which
/// PostgreSQL cannot store in `text` or `jsonb` (SQLite could): refused up
/// front, on both stores alike, before anything reaches the database or a
/// log line. Named by its path (`metadata.note`); a name that itself holds
/// the NUL is named by its parent (`body` at the top).
pub fn unstorable_text(map: &Map<String, Value>) -> Option<String> {
    fn walk(value: &Value, path: &str) -> Option<String> {
        match value {
            Value::String(text) => text.contains('\0').then(|| path.to_owned()),
            Value::Array(items) => items.iter().find_map(|item| walk(item, path)),
            Value::Object(map) => map.iter().find_map(|(name, value)| {
                if name.contains('\0') {
                    return Some(path.to_owned());
                }
                walk(value, &format!("{path}.{name}"))
            }),
            _ => None,
        }
    }
    map.iter().find_map(|(name, value)| {
        if name.contains('\0') {
            return Some("body".to_owned());
        }
        walk(value, name)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn first(value: Value) -> Option<String> {
        unstorable_text(value.as_object().expect("object"))
    }

    #[test]
    fn a_nul_is_named_by_its_path_at_any_depth() {
        assert_eq!(
            first(json!({"a": "x", "b": {"c": ["ok", "n\u{0}"]}})).as_deref(),
            Some("b.c")
        );
        assert_eq!(first(json!({"m": {"k\u{0}": "v"}})).as_deref(), Some("m"));
        assert_eq!(first(json!({"k\u{0}": 1})).as_deref(), Some("body"));
        assert_eq!(first(json!({"a": "plain", "n": 1, "z": null})), None);
    }
}
