//! YAML responses (`Accept: application/yaml`), written so that YAML 1.1 readers (go-yaml v2,
//! which kubectl and sigs.k8s.io/yaml use, and PyYAML) read back exactly the JSON values: every
//! string is double-quoted, so a label `yes` or a date-like value stays a string. Block style,
//! two-space indents, as kube-apiserver's YAML looks.

use serde_json::Value;

/// `value` as a YAML document.
pub fn to_string(value: &Value) -> String {
    let mut out = String::new();
    match value {
        Value::Object(map) if !map.is_empty() => write_map(&mut out, map, 0),
        Value::Array(items) if !items.is_empty() => write_seq(&mut out, items, 0),
        scalar => {
            out.push_str(&inline(scalar));
            out.push('\n');
        }
    }
    out
}

/// A scalar, or an empty collection, on one line.
fn inline(value: &Value) -> String {
    match value {
        Value::String(s) => quoted(s),
        Value::Object(_) => "{}".to_owned(),
        Value::Array(_) => "[]".to_owned(),
        other => other.to_string(),
    }
}

/// A double-quoted YAML scalar: JSON's escapes are all valid YAML escapes.
fn quoted(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

/// A mapping key: plain when no YAML 1.1 reader could take it for anything but that string.
fn key(k: &str) -> String {
    let plain = k
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/'))
        && !matches!(
            k.to_ascii_lowercase().as_str(),
            "y" | "yes" | "n" | "no" | "on" | "off" | "true" | "false" | "null"
        );
    if plain { k.to_owned() } else { quoted(k) }
}

fn is_nested(value: &Value) -> bool {
    matches!(value, Value::Object(m) if !m.is_empty())
        || matches!(value, Value::Array(a) if !a.is_empty())
}

fn write_map(out: &mut String, map: &serde_json::Map<String, Value>, indent: usize) {
    for (k, v) in map {
        out.push_str(&" ".repeat(indent));
        out.push_str(&key(k));
        out.push(':');
        write_value(out, v, indent);
    }
}

fn write_seq(out: &mut String, items: &[Value], indent: usize) {
    for item in items {
        out.push_str(&" ".repeat(indent));
        out.push('-');
        match item {
            Value::Object(map) if !map.is_empty() => {
                // The first key on the dash's line, the others under it.
                let mut first = true;
                for (k, v) in map {
                    if first {
                        out.push(' ');
                        first = false;
                    } else {
                        out.push_str(&" ".repeat(indent + 2));
                    }
                    out.push_str(&key(k));
                    out.push(':');
                    write_value(out, v, indent + 2);
                }
            }
            Value::Array(inner) if !inner.is_empty() => {
                out.push('\n');
                write_seq(out, inner, indent + 2);
            }
            scalar => {
                out.push(' ');
                out.push_str(&inline(scalar));
                out.push('\n');
            }
        }
    }
}

/// The value after `key:` at `indent`.
fn write_value(out: &mut String, value: &Value, indent: usize) {
    if !is_nested(value) {
        out.push(' ');
        out.push_str(&inline(value));
        out.push('\n');
        return;
    }
    out.push('\n');
    match value {
        Value::Object(map) => write_map(out, map, indent + 2),
        Value::Array(items) => write_seq(out, items, indent),
        _ => unreachable!("nested values are collections"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_value_reads_back_the_same_and_strings_stay_strings() {
        let value = json!({
            "apiVersion": "v1",
            "metadata": {"name": "y", "labels": {"yes": "on", "n": "2026-01-01", "k": "1_000"},
                "annotations": {"a/b": "line\nbreak \"quoted\" ü"}},
            "spec": {"ports": [{"port": 80, "name": "http", "targetPort": "web"}, {"port": 443}],
                "clusterIPs": ["10.96.0.1"], "selector": {}, "externalIPs": [],
                "nested": [[1, 2], []], "flag": false, "none": null, "ratio": 0.5}
        });
        let text = to_string(&value);
        let back: Value = yaml_serde::from_str(&text).unwrap();
        assert_eq!(back, value, "{text}");
        assert!(text.contains("\"yes\": \"on\""), "{text}");
        assert!(
            text.contains("  - name: \"http\"\n    port: 80\n"),
            "{text}"
        );
    }
}
