//! JSON request bodies parsed into a [`Value`] while noting every key given twice in one object,
//! which kube-apiserver's strict decoder reports as `duplicate field "<path>"` (the later value
//! wins, as in Go's `encoding/json`). Paths are named as the unknown-field paths are
//! (`spec.ports[0].name`), and only built when a duplicate is found.

use std::fmt;

use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Parses `bytes` as one JSON value; returns it with the paths of duplicate keys, in document
/// order.
pub fn parse(bytes: &[u8]) -> Result<(Value, Vec<String>), serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let mut duplicates = Vec::new();
    let value = Node {
        at: &Path::Root,
        duplicates: &mut duplicates,
    }
    .deserialize(&mut de)?;
    de.end()?;
    Ok((value, duplicates))
}

/// Where a value sits, as a chain to the root (rendered only for a duplicate).
enum Path<'a> {
    Root,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root => Ok(()),
            Path::Key(Path::Root, key) => f.write_str(key),
            Path::Key(parent, key) => write!(f, "{parent}.{key}"),
            Path::Index(parent, i) => write!(f, "{parent}[{i}]"),
        }
    }
}

struct Node<'p, 'd> {
    at: &'p Path<'p>,
    duplicates: &'d mut Vec<String>,
}

impl<'de> DeserializeSeed<'de> for Node<'_, '_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_, '_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        loop {
            let at = Path::Index(self.at, items.len());
            let node = Node {
                at: &at,
                duplicates: &mut *self.duplicates,
            };
            match seq.next_element_seed(node)? {
                Some(item) => items.push(item),
                None => return Ok(Value::Array(items)),
            }
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let at = Path::Key(self.at, &key);
            let value = map.next_value_seed(Node {
                at: &at,
                duplicates: &mut *self.duplicates,
            })?;
            if object.contains_key(&key) {
                self.duplicates.push(at.to_string());
            }
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_named_by_path_and_the_later_value_wins() {
        let (value, dups) = parse(
            br#"{"metadata":{"name":"a","name":"b"},"spec":{"ports":[{"port":80,"port":81}],"type":"NodePort"}}"#,
        )
        .unwrap();
        assert_eq!(dups, ["metadata.name", "spec.ports[0].port"]);
        assert_eq!(value["metadata"]["name"], "b");
        assert_eq!(value["spec"]["ports"][0]["port"], 81);
        let (value, dups) = parse(br#"{"a":[1,2.5,"x",null,true],"b":{}}"#).unwrap();
        assert!(dups.is_empty());
        assert_eq!(value, serde_json::json!({"a":[1,2.5,"x",null,true],"b":{}}));
        assert!(parse(b"{\"a\":1} trailing").is_err());
    }
}
