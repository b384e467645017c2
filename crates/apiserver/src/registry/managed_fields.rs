//! Field ownership (`metadata.managedFields`) and server-side apply, after kube-apiserver's
//! field manager over `sigs.k8s.io/structured-merge-diff` (SMD).
//!
//! The type of every node comes from the served OpenAPI schemas and their merge markers
//! (`x-kubernetes-list-type`, `x-kubernetes-list-map-keys`, `x-kubernetes-map-type`, see
//! `rest/list_types.rs`): a list without a marker is atomic, as kube's schema conversion makes
//! it; a keyed list is a map of items by their keys (a key a client left out takes the schema's
//! `default`, as `protocol: TCP` of a Service port); a set is keyed by value.
//!
//! A field set is a set of paths whose elements are written as `fieldsV1` writes them:
//! `f:<field>`, `k:{"port":80,"protocol":"TCP"}`, `v:"10.0.0.1"`. What SMD does and this module
//! follows:
//! - `ToFieldSet`: scalars, atomic values, list items and map entries are members; a struct
//!   field only when it is a leaf (or `null`, or an empty object).
//! - `Compare`: leaves added, modified, removed; a non-leaf node absent on one side is added or
//!   removed as a whole.
//! - An **Update** (create, PUT, non-apply PATCH) gives its manager what it added or modified and
//!   takes it from every other manager; what it removed leaves every manager.
//! - An **Apply** merges the applied configuration into the live object, then prunes what the
//!   manager applied last time, left out now, and no other manager owns; a change to a field
//!   another manager owns is a conflict unless `force=true`, which takes it over.
//! - The system fields (`apiVersion`, `kind`, `metadata.name`, `uid`, ...) are never owned
//!   (kube's `stripMeta`); `status` is not owned through the main resource and only `status`
//!   through `/status` (the strategies' reset fields).
//! - The first apply to an object without managed fields gives what it had to
//!   `before-first-apply` (kube's `skipNonApplied` manager); an update of such an object records
//!   nothing, as kube's does.
//!
//! - Beyond ten Update entries the oldest are folded into `ancient-changes` (kube's
//!   `capManagers`).
//! - A write is worked out in the version of its request and recorded with that `apiVersion`;
//!   another manager's entry is compared in its own version (Events are the one kind served in
//!   two versions, whose fields differ only in top-level names, see [`in_version`]).
//!
//! - `kubectl.kubernetes.io/last-applied-configuration`, for the manager `kubectl` only, as
//!   kube's `lastAppliedManager` and `lastAppliedUpdater`: a conflict on a field whose live
//!   value is still the one the annotation records (set by a client-side apply) is no conflict,
//!   and after the apply an object carrying the annotation gets the applied configuration there.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::resource::Kind;

/// One path element, in its `fieldsV1` form (`f:name`, `k:{...}`, `v:...`).
type Pe = String;
/// A path from the object's root.
type Path = Vec<Pe>;
/// A set of paths.
type FieldSet = BTreeSet<Path>;

/// The manager kube gives what an object held before its first apply.
pub const BEFORE_FIRST_APPLY: &str = "before-first-apply";

/// The longest manager name (apimachinery's `FieldManagerMaxLength`).
pub const MAX_MANAGER_LENGTH: usize = 128;

/// kube's `managerOrUserAgent`: the `fieldManager` parameter, or the part of the User-Agent
/// before its first `/`, without unprintable characters, cut to 128 bytes.
pub fn manager_name(field_manager: Option<&str>, user_agent: &str) -> String {
    if let Some(m) = field_manager.filter(|m| !m.is_empty()) {
        return m.to_owned();
    }
    let mut out = String::new();
    for c in user_agent.split('/').next().unwrap_or("").chars() {
        if c.is_control() {
            continue;
        }
        if out.len() + c.len_utf8() > MAX_MANAGER_LENGTH {
            break;
        }
        out.push(c);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Types, from the served schemas.

/// The shape of one node, as SMD sees it.
#[derive(Clone, Copy)]
enum Shape {
    /// A scalar, or anything atomic: replaced as a whole, owned as one leaf.
    Leaf,
    /// A struct: named fields.
    Struct(&'static Map<String, Value>),
    /// A granular map (labels): entries of one element type.
    Map(&'static Value),
    /// A keyed list (`listType: map`).
    KeyedList(&'static Value, &'static [Value]),
    /// A set of scalars (`listType: set`).
    Set(&'static Value),
}

static NULL: Value = Value::Null;

fn schemas() -> &'static Map<String, Value> {
    crate::rest::discovery::merge_schemas()
}

/// Follows `$ref` and one-element `allOf`/`anyOf`/`oneOf` wrappers.
fn resolve(mut schema: &'static Value) -> &'static Value {
    for _ in 0..16 {
        if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
            let name = r.rsplit('/').next().unwrap_or(r);
            schema = schemas().get(name).unwrap_or(&NULL);
            continue;
        }
        let wrapped = ["allOf", "anyOf", "oneOf"].iter().find_map(|k| {
            schema.get(*k).and_then(Value::as_array).and_then(|all| {
                all.iter()
                    .find(|s| s.get("type").and_then(Value::as_str) != Some("null"))
            })
        });
        match wrapped {
            Some(inner) => schema = inner,
            None => return schema,
        }
    }
    schema
}

fn marker<'a>(schema: &'a Value, resolved: &'a Value, name: &str) -> Option<&'a Value> {
    schema.get(name).or_else(|| resolved.get(name))
}

fn schema_type(schema: &Value) -> Option<&str> {
    match schema.get("type") {
        Some(Value::String(t)) => Some(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).find(|t| *t != "null"),
        _ => None,
    }
}

fn shape(schema: &'static Value) -> Shape {
    let resolved = resolve(schema);
    if marker(schema, resolved, "x-kubernetes-map-type").and_then(Value::as_str) == Some("atomic") {
        return Shape::Leaf;
    }
    if schema_type(resolved) == Some("array") {
        let items = resolved.get("items").unwrap_or(&NULL);
        return match marker(schema, resolved, "x-kubernetes-list-type").and_then(Value::as_str) {
            Some("map") => {
                match marker(schema, resolved, "x-kubernetes-list-map-keys")
                    .and_then(Value::as_array)
                {
                    Some(keys) if !keys.is_empty() => Shape::KeyedList(items, keys),
                    _ => Shape::Leaf,
                }
            }
            Some("set") => Shape::Set(items),
            _ => Shape::Leaf,
        };
    }
    if let Some(Value::Object(properties)) = resolved.get("properties") {
        return Shape::Struct(properties);
    }
    match resolved.get("additionalProperties") {
        Some(element @ Value::Object(_)) if schema_type(resolved) == Some("object") => {
            Shape::Map(element)
        }
        _ => Shape::Leaf,
    }
}

/// The schema of the kind's type, in the kind's own version (an `events.k8s.io/v1` Event's,
/// not the stored core one's: kube's field manager works in the version of the request).
fn root(kind: Kind) -> &'static Value {
    schemas()
        .get(&crate::rest::discovery::schema_name(kind))
        .unwrap_or(&NULL)
}

/// `set`, recorded by a manager in `from` (an entry's `apiVersion`), in the field names of
/// `to`. SMD compares an object in each manager's own version (`Updater.update` converts the
/// object to it); an Event's two versions differ only in the names of top-level fields
/// (`pkg/apis/events/v1/conversion.go`), so renaming the first element of each path is that
/// conversion. Every other kind is served in one version.
fn in_version(kind: Kind, set: &FieldSet, from: &str, to: &str) -> FieldSet {
    let events = Kind::EventsV1.api_version();
    let core = Kind::Event.api_version();
    let to_events = match (from, to) {
        _ if kind.stored_as() != Kind::Event || from == to => return set.clone(),
        (f, t) if f == core && t == events => true,
        (f, t) if f == events && t == core => false,
        _ => return set.clone(),
    };
    set.iter()
        .map(|path| {
            let mut path = path.clone();
            if let Some(first) = path.first_mut()
                && let Some(name) = first.strip_prefix("f:")
                && let Some(other) = super::event::renamed_field(name, to_events)
            {
                *first = format!("f:{other}");
            }
            path
        })
        .collect()
}

/// The schema of a struct field or map entry (`None`: a field the struct does not declare).
fn field_schema(shape: Shape, name: &str) -> Option<&'static Value> {
    match shape {
        Shape::Struct(properties) => properties.get(name),
        Shape::Map(element) => Some(element),
        _ => None,
    }
}

/// The path element of a list item: its keys, or its value in a set.
fn item_pe(shape: Shape, item: &Value) -> Result<Pe, String> {
    match shape {
        Shape::Set(_) => Ok(format!("v:{}", compact(item))),
        Shape::KeyedList(items, keys) => {
            let item_schema = resolve(items);
            let mut names: Vec<&str> = keys.iter().filter_map(Value::as_str).collect();
            names.sort_unstable();
            let mut parts = Vec::with_capacity(names.len());
            for name in names {
                let value = item
                    .get(name)
                    .filter(|v| !v.is_null())
                    .or_else(|| item_schema.pointer(&format!("/properties/{name}/default")))
                    .ok_or_else(|| {
                        format!(
                            "associative list with keys has an element that omits key field {name:?} (and doesn't have default value)"
                        )
                    })?;
                parts.push(format!("{}:{}", compact(&json!(name)), compact(value)));
            }
            Ok(format!("k:{{{}}}", parts.join(",")))
        }
        _ => Err("invalid indexing of non-associative list".into()),
    }
}

fn compact(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

fn is_empty_node(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// Field sets.

/// SMD's `ToFieldSet`. Fields a struct does not declare are left out (an applied
/// configuration with one is refused before, see [`undeclared`]; a live object cannot hold
/// one). A keyed list item without its keys is an error.
fn to_field_set(
    schema: &'static Value,
    value: &Value,
    path: &mut Path,
    out: &mut FieldSet,
) -> Result<(), String> {
    let shape = shape(schema);
    match (shape, value) {
        (Shape::Struct(_) | Shape::Map(_), Value::Object(map)) => {
            for (key, child) in map {
                let Some(child_schema) = field_schema(shape, key) else {
                    continue;
                };
                path.push(format!("f:{key}"));
                to_field_set(child_schema, child, path, out)?;
                if matches!(shape, Shape::Map(_))
                    || child.is_null()
                    || child.as_object().is_some_and(Map::is_empty)
                {
                    out.insert(path.clone());
                }
                path.pop();
            }
        }
        (Shape::KeyedList(items, _) | Shape::Set(items), Value::Array(list)) => {
            for item in list {
                let pe = item_pe(shape, item).map_err(|e| format!("{}: {e}", print_path(path)))?;
                path.push(pe);
                if matches!(shape, Shape::KeyedList(..)) {
                    to_field_set(items, item, path, out)?;
                }
                out.insert(path.clone());
                path.pop();
            }
        }
        (Shape::KeyedList(..) | Shape::Set(_), Value::Null) => {}
        _ => {
            out.insert(path.clone());
        }
    }
    Ok(())
}

/// The first field of `value` (in key order) that its struct's schema does not declare.
fn undeclared(schema: &'static Value, value: &Value, path: &mut Path) -> Option<Path> {
    let shape = shape(schema);
    match (shape, value) {
        (Shape::Struct(_) | Shape::Map(_), Value::Object(map)) => {
            for (key, child) in map {
                path.push(format!("f:{key}"));
                let found = match field_schema(shape, key) {
                    None => Some(path.clone()),
                    Some(child_schema) => undeclared(child_schema, child, path),
                };
                path.pop();
                if found.is_some() {
                    return found;
                }
            }
            None
        }
        (Shape::KeyedList(items, _), Value::Array(list)) => list.iter().find_map(|item| {
            let pe = item_pe(shape, item).ok()?;
            path.push(pe);
            let found = undeclared(items, item, path);
            path.pop();
            found
        }),
        _ => None,
    }
}

/// SMD's `Compare`: (added, modified, removed).
#[derive(Default)]
struct Comparison {
    added: FieldSet,
    modified: FieldSet,
    removed: FieldSet,
}

impl Comparison {
    fn leaf(&mut self, path: &Path, lhs: Option<&Value>, rhs: Option<&Value>) {
        match (lhs, rhs) {
            (None, Some(_)) => self.added.insert(path.clone()),
            (Some(_), None) => self.removed.insert(path.clone()),
            (Some(l), Some(r)) if l != r => self.modified.insert(path.clone()),
            _ => false,
        };
    }
}

fn compare(
    schema: &'static Value,
    lhs: Option<&Value>,
    rhs: Option<&Value>,
    path: &mut Path,
    out: &mut Comparison,
) {
    let shape = shape(schema);
    let empty = |v: Option<&Value>| v.is_none_or(is_empty_node);
    let granular = match shape {
        Shape::Leaf => false,
        Shape::Struct(_) | Shape::Map(_) => {
            lhs.is_none_or(Value::is_object)
                && rhs.is_none_or(Value::is_object)
                && !(empty(lhs) && empty(rhs))
        }
        Shape::KeyedList(..) | Shape::Set(_) => {
            lhs.is_none_or(Value::is_array)
                && rhs.is_none_or(Value::is_array)
                && !(empty(lhs) && empty(rhs))
        }
    };
    if !granular {
        out.leaf(path, lhs, rhs);
        return;
    }
    match shape {
        Shape::Struct(_) | Shape::Map(_) => {
            let l = lhs.and_then(Value::as_object);
            let r = rhs.and_then(Value::as_object);
            let keys: BTreeSet<&String> = l.into_iter().chain(r).flat_map(|m| m.keys()).collect();
            for key in keys {
                let Some(child_schema) = field_schema(shape, key) else {
                    continue;
                };
                path.push(format!("f:{key}"));
                compare(
                    child_schema,
                    l.and_then(|m| m.get(key)),
                    r.and_then(|m| m.get(key)),
                    path,
                    out,
                );
                path.pop();
            }
        }
        Shape::KeyedList(items, _) | Shape::Set(items) => {
            let index = |v: Option<&Value>| -> Vec<(Pe, Value)> {
                let mut seen = BTreeSet::new();
                v.and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|item| item_pe(shape, item).ok().map(|pe| (pe, item.clone())))
                    .filter(|(pe, _)| seen.insert(pe.clone()))
                    .collect()
            };
            let l = index(lhs);
            let r = index(rhs);
            let mut pes: Vec<&Pe> = l.iter().map(|(pe, _)| pe).collect();
            pes.extend(
                r.iter()
                    .map(|(pe, _)| pe)
                    .filter(|pe| !l.iter().any(|(p, _)| p == *pe)),
            );
            for pe in pes {
                let lv = l.iter().find(|(p, _)| p == pe).map(|(_, v)| v);
                let rv = r.iter().find(|(p, _)| p == pe).map(|(_, v)| v);
                path.push(pe.clone());
                if matches!(shape, Shape::Set(_)) {
                    out.leaf(path, lv, rv);
                } else {
                    compare(items, lv, rv, path, out);
                }
                path.pop();
            }
        }
        Shape::Leaf => unreachable!("leaves returned above"),
    }
    match (lhs, rhs) {
        (None, Some(_)) => out.added.insert(path.clone()),
        (Some(_), None) => out.removed.insert(path.clone()),
        _ => false,
    };
}

/// SMD's `Merge` of an applied configuration (`rhs`) into the live object (`lhs`).
fn merge(schema: &'static Value, lhs: &Value, rhs: &Value) -> Result<Value, String> {
    let shape = shape(schema);
    match (shape, lhs, rhs) {
        (Shape::Struct(_) | Shape::Map(_), Value::Object(l), Value::Object(r)) => {
            let mut out = l.clone();
            for (key, rv) in r {
                let merged = match (field_schema(shape, key), l.get(key)) {
                    (Some(child_schema), Some(lv)) => merge(child_schema, lv, rv)?,
                    _ => rv.clone(),
                };
                out.insert(key.clone(), merged);
            }
            Ok(Value::Object(out))
        }
        (Shape::KeyedList(items, _) | Shape::Set(items), Value::Array(l), Value::Array(r)) => {
            merge_list(shape, items, l, r).map(Value::Array)
        }
        _ => Ok(rhs.clone()),
    }
}

/// The items of a granular list merged, ordered as SMD's `visitListItems` orders them: items
/// only the live object has keep their place, shared items follow the applied order, new items
/// come where the applied configuration put them.
fn merge_list(
    shape: Shape,
    items: &'static Value,
    lhs: &[Value],
    rhs: &[Value],
) -> Result<Vec<Value>, String> {
    let index = |list: &[Value]| -> Result<Vec<(Pe, Value)>, String> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for item in list {
            let pe = item_pe(shape, item)?;
            if seen.insert(pe.clone()) {
                out.push((pe, item.clone()));
            }
        }
        Ok(out)
    };
    let l = index(lhs)?;
    let r = index(rhs)?;
    let in_l = |pe: &Pe| l.iter().find(|(p, _)| p == pe).map(|(_, v)| v);
    let in_r = |pe: &Pe| r.iter().find(|(p, _)| p == pe).map(|(_, v)| v);
    let mut shared: std::collections::VecDeque<&Pe> = r
        .iter()
        .map(|(pe, _)| pe)
        .filter(|pe| in_l(pe).is_some())
        .collect();
    let mut done: BTreeSet<&Pe> = BTreeSet::new();
    let mut out = Vec::with_capacity(l.len().max(r.len()));
    let merge_item = |pe: &Pe| -> Result<Value, String> {
        match (in_l(pe), in_r(pe)) {
            (Some(lv), Some(rv)) if matches!(shape, Shape::KeyedList(..)) => merge(items, lv, rv),
            (_, Some(rv)) => Ok(rv.clone()),
            (Some(lv), None) => Ok(lv.clone()),
            (None, None) => Ok(Value::Null),
        }
    };
    let (mut li, mut ri) = (0, 0);
    while li < l.len() || ri < r.len() {
        if li < l.len() && ri < r.len() {
            let pe = &l[li].0;
            if *pe == r[ri].0 {
                done.insert(pe);
                out.push(merge_item(pe)?);
                li += 1;
                ri += 1;
                if shared.front() == Some(&pe) {
                    shared.pop_front();
                }
                continue;
            }
            if in_r(pe).is_some() && shared.front().is_some_and(|s| *s != pe) {
                li += 1;
                continue;
            }
        }
        if li < l.len() {
            let pe = &l[li].0;
            if in_r(pe).is_none() {
                out.push(l[li].1.clone());
                li += 1;
                continue;
            } else if done.contains(pe) {
                li += 1;
            }
        }
        if ri < r.len() {
            let pe = &r[ri].0;
            if !done.contains(pe) {
                done.insert(pe);
                out.push(merge_item(pe)?);
            }
            ri += 1;
            if shared.front() == Some(&pe) {
                shared.pop_front();
            }
        }
    }
    Ok(out)
}

/// Whether `set` holds a path strictly below `path`.
fn has_below(set: &FieldSet, path: &Path) -> bool {
    set.range(path.clone()..)
        .find(|p| *p != path)
        .is_some_and(|p| p.starts_with(path))
}

/// SMD's `RemoveItems`: drops the fields, map entries and list items that are members of `set`.
fn remove_items(schema: &'static Value, value: &mut Value, path: &mut Path, set: &FieldSet) {
    let shape = shape(schema);
    match (shape, value) {
        (Shape::Struct(_) | Shape::Map(_), Value::Object(map)) => {
            let keys: Vec<String> = map.keys().cloned().collect();
            for key in keys {
                path.push(format!("f:{key}"));
                if set.contains(path) {
                    map.remove(&key);
                } else if has_below(set, path)
                    && let (Some(child_schema), Some(child)) =
                        (field_schema(shape, &key), map.get_mut(&key))
                {
                    remove_items(child_schema, child, path, set);
                }
                path.pop();
            }
        }
        (Shape::KeyedList(items, _) | Shape::Set(items), Value::Array(list)) => {
            let old = std::mem::take(list);
            for mut item in old {
                let Ok(pe) = item_pe(shape, &item) else {
                    list.push(item);
                    continue;
                };
                path.push(pe);
                if !set.contains(path) {
                    if has_below(set, path) {
                        remove_items(items, &mut item, path, set);
                    }
                    list.push(item);
                }
                path.pop();
            }
        }
        _ => {}
    }
}

/// SMD's `EnsureNamedFieldsAreMembers`: a struct field with members below it is a member too.
fn ensure_named_fields(schema: &'static Value, set: &FieldSet) -> FieldSet {
    let mut out = set.clone();
    for path in set {
        let mut node = schema;
        for (i, pe) in path.iter().enumerate() {
            if i + 1 == path.len() {
                break;
            }
            let shape = shape(node);
            let next = match (shape, pe.strip_prefix("f:")) {
                (Shape::Struct(properties), Some(name)) => {
                    let child = properties.get(name);
                    if child.is_some() {
                        out.insert(path[..=i].to_vec());
                    }
                    child
                }
                (Shape::Map(element), Some(_)) => Some(element),
                (Shape::KeyedList(items, _) | Shape::Set(items), None) => Some(items),
                _ => None,
            };
            match next {
                Some(n) => node = n,
                None => break,
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// `fieldsV1` and the entries.

fn encode_set(set: &FieldSet) -> Value {
    fn insert(node: &mut Map<String, Value>, path: &[Pe]) {
        let Some((first, rest)) = path.split_first() else {
            return;
        };
        let child = node
            .entry(first.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(child) = child else {
            return;
        };
        if rest.is_empty() {
            if !child.is_empty() {
                child.insert(".".into(), json!({}));
            }
            child.insert("\u{0}member".into(), Value::Null);
        } else {
            if child.contains_key("\u{0}member") {
                child.insert(".".into(), json!({}));
            }
            insert(child, rest);
        }
    }
    fn clean(node: &mut Map<String, Value>) {
        node.remove("\u{0}member");
        for (_, child) in node.iter_mut() {
            if let Value::Object(child) = child {
                clean(child);
            }
        }
    }
    let mut root = Map::new();
    for path in set {
        insert(&mut root, path);
    }
    clean(&mut root);
    Value::Object(root)
}

fn decode_set(value: &Value) -> Result<FieldSet, String> {
    fn walk(node: &Map<String, Value>, path: &mut Path, out: &mut FieldSet) -> Result<(), String> {
        for (key, child) in node {
            if key == "." {
                out.insert(path.clone());
                continue;
            }
            if !["f:", "k:", "v:", "i:"].iter().any(|p| key.starts_with(p)) {
                return Err(format!("unknown path element {key:?}"));
            }
            let Value::Object(child) = child else {
                return Err(format!("{key}: expected an object"));
            };
            path.push(key.clone());
            if child.is_empty() {
                out.insert(path.clone());
            } else {
                walk(child, path, out)?;
            }
            path.pop();
        }
        Ok(())
    }
    let mut out = FieldSet::new();
    match value {
        Value::Object(map) => walk(map, &mut Vec::new(), &mut out)?,
        Value::Null => {}
        _ => return Err("fieldsV1 is not an object".into()),
    }
    Ok(out)
}

/// A path as SMD prints it in conflicts: `.spec.ports[port=80,protocol="TCP"].nodePort`.
fn print_path(path: &[Pe]) -> String {
    let mut out = String::new();
    for pe in path {
        if let Some(name) = pe.strip_prefix("f:") {
            out.push('.');
            out.push_str(name);
        } else if let Some(keys) = pe.strip_prefix("k:") {
            let parts: Vec<String> = match serde_json::from_str::<Map<String, Value>>(keys) {
                Ok(map) => map
                    .iter()
                    .map(|(k, v)| format!("{k}={}", compact(v)))
                    .collect(),
                Err(_) => vec![keys.to_owned()],
            };
            out.push_str(&format!("[{}]", parts.join(",")));
        } else if let Some(v) = pe.strip_prefix("v:") {
            out.push_str(&format!("[={v}]"));
        } else if let Some(i) = pe.strip_prefix("i:") {
            out.push_str(&format!("[{i}]"));
        }
    }
    out
}

/// One `managedFields` entry.
#[derive(Debug, Clone)]
struct Entry {
    manager: String,
    apply: bool,
    api_version: String,
    time: Option<Value>,
    subresource: String,
    set: FieldSet,
}

impl Entry {
    fn same_manager(&self, manager: &str, apply: bool, subresource: &str) -> bool {
        self.manager == manager && self.apply == apply && self.subresource == subresource
    }

    /// kube's `BuildManagerIdentifier`: an applier is one entry whatever the version it
    /// applied in; an updater has one entry per version.
    fn same_identity(&self, other: &Entry) -> bool {
        self.same_manager(&other.manager, other.apply, &other.subresource)
            && (self.apply || self.api_version == other.api_version)
    }

    /// kube's `printManager` for conflict messages.
    fn printed(&self) -> String {
        let mut out = format!("{:?}", self.manager);
        if !self.subresource.is_empty() {
            out.push_str(&format!(" with subresource {:?}", self.subresource));
        }
        if !self.apply {
            out.push_str(&format!(" using {}", self.api_version));
        }
        out
    }

    fn to_value(&self) -> Value {
        let mut entry = Map::new();
        entry.insert("manager".into(), json!(self.manager));
        entry.insert(
            "operation".into(),
            json!(if self.apply { "Apply" } else { "Update" }),
        );
        entry.insert("apiVersion".into(), json!(self.api_version));
        if let Some(time) = &self.time {
            entry.insert("time".into(), time.clone());
        }
        entry.insert("fieldsType".into(), json!("FieldsV1"));
        entry.insert("fieldsV1".into(), encode_set(&self.set));
        if !self.subresource.is_empty() {
            entry.insert("subresource".into(), json!(self.subresource));
        }
        Value::Object(entry)
    }
}

/// The entries of `metadata.managedFields`; `Err` when they do not decode as kube's
/// `DecodeManagedFields` would: an operation other than `Apply` or `Update`, an empty
/// `apiVersion`, a `fieldsType` other than `FieldsV1`, or `fieldsV1` that is not a field set.
/// A later entry of the same manager identity replaces an earlier one, as in kube's map.
fn decode_entries(managed: Option<&Value>) -> Result<Vec<Entry>, String> {
    let Some(list) = managed.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let list = list.as_array().ok_or("managedFields is not a list")?;
    let mut out: Vec<Entry> = Vec::new();
    for (i, item) in list.iter().enumerate() {
        let text = |k: &str| item.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let apply = match text("operation").as_str() {
            "Apply" => true,
            "Update" => false,
            _ => return Err("operation must be `Apply` or `Update`".into()),
        };
        if text("apiVersion").is_empty() {
            return Err("apiVersion must not be empty".into());
        }
        match text("fieldsType").as_str() {
            "FieldsV1" => {}
            "" => return Err(format!("missing fieldsType in managed fields entry {i}")),
            other => {
                return Err(format!(
                    "invalid fieldsType {other:?} in managed fields entry {i}"
                ));
            }
        }
        let entry = Entry {
            manager: text("manager"),
            apply,
            api_version: text("apiVersion"),
            time: item.get("time").filter(|t| !t.is_null()).cloned(),
            subresource: text("subresource"),
            set: decode_set(item.get("fieldsV1").unwrap_or(&Value::Null))?,
        };
        match out.iter_mut().find(|e| e.same_identity(&entry)) {
            Some(existing) => *existing = entry,
            None => out.push(entry),
        }
    }
    Ok(out)
}

/// kube's `isResetManagedFields`: `managedFields: []` or `[{}]` in a write clears them.
fn is_reset(sent: &Value) -> bool {
    match sent.as_array().map(Vec::as_slice) {
        Some([]) => true,
        Some([only]) => only.as_object().is_some_and(|m| {
            m.values()
                .all(|v| v.is_null() || v.as_str() == Some("") || v == &json!({}))
        }),
        _ => false,
    }
}

/// The most Update entries kept (kube's `DefaultMaxUpdateManagers`).
const MAX_UPDATE_MANAGERS: usize = 10;

/// The manager the oldest Update entries are folded into beyond [`MAX_UPDATE_MANAGERS`].
pub const ANCIENT_CHANGES: &str = "ancient-changes";

fn time_of(entry: &Entry) -> &str {
    entry.time.as_ref().and_then(Value::as_str).unwrap_or("")
}

/// kube's `capManagersManager`: beyond ten Update entries, the oldest are merged (oldest first,
/// per API version) into one `ancient-changes` entry carrying the time of the latest one merged.
fn cap_update_managers(entries: &mut Vec<Entry>) {
    let mut updaters: Vec<usize> = (0..entries.len()).filter(|&i| !entries[i].apply).collect();
    if updaters.len() <= MAX_UPDATE_MANAGERS {
        return;
    }
    updaters.sort_by(|&a, &b| {
        let (a, b) = (&entries[a], &entries[b]);
        time_of(a)
            .cmp(time_of(b))
            .then_with(|| a.manager.cmp(&b.manager))
            .then_with(|| a.subresource.cmp(&b.subresource))
    });
    let mut length = updaters.len();
    let mut first_of_version: Vec<(String, usize)> = Vec::new();
    let mut merged = vec![false; entries.len()];
    for &i in &updaters {
        if length <= MAX_UPDATE_MANAGERS {
            break;
        }
        let version = entries[i].api_version.clone();
        let is_bucket =
            |e: &Entry| e.manager == ANCIENT_CHANGES && !e.apply && e.subresource.is_empty();
        let Some(&(_, first)) = first_of_version.iter().find(|(v, _)| *v == version) else {
            first_of_version.push((version, i));
            continue;
        };
        let bucket = match (0..entries.len())
            .find(|&b| !merged[b] && is_bucket(&entries[b]) && entries[b].api_version == version)
        {
            Some(b) => b,
            None => {
                entries[first].manager = ANCIENT_CHANGES.to_owned();
                entries[first].subresource.clear();
                first
            }
        };
        if bucket == i {
            continue;
        }
        let set = std::mem::take(&mut entries[i].set);
        entries[bucket].set.extend(set);
        entries[bucket].time = entries[i].time.clone();
        merged[i] = true;
        length -= 1;
    }
    let mut index = 0;
    entries.retain(|_| {
        index += 1;
        !merged[index - 1]
    });
}

/// kube's order of entries: Apply before Update, then by time, manager, version, subresource.
fn encode_entries(mut entries: Vec<Entry>) -> Value {
    entries.retain(|e| !e.set.is_empty());
    cap_update_managers(&mut entries);
    entries.sort_by(|a, b| {
        b.apply
            .cmp(&a.apply)
            .then_with(|| time_of(a).cmp(time_of(b)))
            .then_with(|| a.manager.cmp(&b.manager))
            .then_with(|| a.api_version.cmp(&b.api_version))
            .then_with(|| a.subresource.cmp(&b.subresource))
    });
    Value::Array(entries.iter().map(Entry::to_value).collect())
}

// ---------------------------------------------------------------------------------------------
// Operations.

/// Who writes, and where.
#[derive(Debug, Clone, Copy)]
pub struct Writer<'a> {
    /// The manager's name.
    pub manager: &'a str,
    /// The subresource written through: `""` for the object itself, `status`, or a
    /// Namespace's `finalize`; recorded as the entry's `subresource`.
    pub subresource: &'a str,
    /// The time to record (RFC 3339, as `metav1.Time` writes it).
    pub now: &'a Value,
}

impl Writer<'_> {
    fn subresource(&self) -> &str {
        self.subresource
    }

    /// Whether the write goes to `/status`, which owns `status` and nothing else. `/finalize`
    /// is owned as the object is (its strategy resets `status` only).
    fn status(&self) -> bool {
        self.subresource == "status"
    }
}

/// The paths no manager owns: kube's `stripMeta`, and the fields the endpoint resets.
fn owned_only(kind: Kind, status: bool, set: &mut FieldSet) {
    const STRIPPED: &[&[&str]] = &[
        &["f:apiVersion"],
        &["f:kind"],
        &["f:metadata"],
        &["f:metadata", "f:name"],
        &["f:metadata", "f:namespace"],
        &["f:metadata", "f:creationTimestamp"],
        &["f:metadata", "f:selfLink"],
        &["f:metadata", "f:uid"],
        &["f:metadata", "f:clusterName"],
        &["f:metadata", "f:generation"],
        &["f:metadata", "f:managedFields"],
        &["f:metadata", "f:resourceVersion"],
    ];
    set.retain(|path| {
        if STRIPPED.iter().any(|s| s.iter().eq(path.iter())) {
            return false;
        }
        let in_status = path.first().is_some_and(|pe| pe == "f:status");
        if status {
            in_status
        } else {
            !(kind.has_status() && in_status)
        }
    });
}

/// What the live object is compared with when there is none: Go's zero value of the type, whose
/// `metadata`, `spec` and `status` are written as empty objects.
fn zero_object(kind: Kind) -> Value {
    let mut zero = Map::new();
    if let Shape::Struct(properties) = shape(root(kind)) {
        for field in ["metadata", "spec", "status"] {
            if properties.contains_key(field) {
                zero.insert(field.into(), json!({}));
            }
        }
    }
    Value::Object(zero)
}

fn without_managed_fields(value: &Value) -> Value {
    let mut value = value.clone();
    if let Some(meta) = value.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
    }
    value
}

fn compare_objects(kind: Kind, status: bool, old: &Value, new: &Value) -> Comparison {
    let mut cmp = Comparison::default();
    compare(
        root(kind),
        Some(&without_managed_fields(old)),
        Some(&without_managed_fields(new)),
        &mut Vec::new(),
        &mut cmp,
    );
    owned_only(kind, status, &mut cmp.added);
    owned_only(kind, status, &mut cmp.modified);
    owned_only(kind, status, &mut cmp.removed);
    cmp
}

/// The entries after an Update by `writer` from `old` to `new` (SMD's `Updater.Update`, under
/// kube's `managedFieldsUpdater`).
fn update_entries(
    kind: Kind,
    mut entries: Vec<Entry>,
    old: &Value,
    new: &Value,
    writer: Writer<'_>,
) -> Vec<Entry> {
    let cmp = compare_objects(kind, writer.status(), old, new);
    let taken: FieldSet = cmp.added.union(&cmp.modified).cloned().collect();
    let subresource = writer.subresource();
    let version = kind.api_version();
    let own =
        |e: &Entry| e.same_manager(writer.manager, false, subresource) && e.api_version == version;
    for entry in &mut entries {
        if own(entry) {
            continue;
        }
        let taken = in_version(kind, &taken, version, &entry.api_version);
        let removed = in_version(kind, &cmp.removed, version, &entry.api_version);
        entry
            .set
            .retain(|p| !taken.contains(p) && !removed.contains(p));
    }
    let position = entries.iter().position(own);
    let mut own = match position {
        Some(i) => entries.remove(i),
        None => Entry {
            manager: writer.manager.to_owned(),
            apply: false,
            api_version: kind.api_version().to_owned(),
            time: None,
            subresource: subresource.to_owned(),
            set: FieldSet::new(),
        },
    };
    own.set.retain(|p| !cmp.removed.contains(p));
    if !taken.is_empty() {
        own.set.extend(taken);
        own.time = Some(writer.now.clone());
        own.api_version = kind.api_version().to_owned();
    }
    entries.push(own);
    entries
}

/// `metadata.managedFields` after an Update (create, PUT, or a PATCH that is not an apply) from
/// `old` (`None` on create) to `new`, both in the stored form. The managed fields the client
/// sent, when they decode, replace the live ones (kube lets a client reset them so, e.g. with
/// `[{}]`); through `/status` the live ones always count. `None` leaves the object without
/// managed fields: an update of an object that has none, as kube's `skipNonApplied` manager.
pub fn on_update(
    kind: Kind,
    old: Option<&Value>,
    new: &Value,
    writer: Writer<'_>,
) -> Option<Value> {
    // kube's `decodeManagedFields`: a subresource takes the live ones; `[]` or `[{}]` resets
    // them; valid ones sent replace the live ones (also on create, whose live object is
    // empty); invalid or empty ones sent count for nothing.
    let live = || decode_entries(old.and_then(|o| o.pointer("/metadata/managedFields")));
    let sent = new
        .pointer("/metadata/managedFields")
        .filter(|m| !m.is_null() && writer.subresource.is_empty());
    let entries = match sent {
        Some(sent) if is_reset(sent) => Vec::new(),
        Some(sent) => match decode_entries(Some(sent)) {
            Ok(entries) if !entries.is_empty() => entries,
            _ => live().unwrap_or_default(),
        },
        None => live().unwrap_or_default(),
    };
    // kube's `skipNonApplied` manager: an update of an object that (now) has no managed fields
    // records none.
    if old.is_some() && entries.is_empty() {
        return None;
    }
    let zero = zero_object(kind);
    let entries = update_entries(kind, entries, old.unwrap_or(&zero), new, writer);
    Some(encode_entries(entries))
}

/// The result of an apply.
#[derive(Debug)]
pub struct Applied {
    /// The merged and pruned object, without `metadata.managedFields`.
    pub object: Value,
    /// Its `metadata.managedFields`.
    pub managed_fields: Value,
}

/// The 409 of an apply that would change fields other managers own (kube's `NewConflictError`).
fn conflict_error(conflicts: &[(String, Path)]) -> ApiError {
    let message = if let [(manager, path)] = conflicts {
        format!(
            "Apply failed with 1 conflict: conflict with {manager}: {}",
            print_path(path)
        )
    } else {
        let mut managers: Vec<&String> = conflicts.iter().map(|(m, _)| m).collect();
        managers.sort();
        managers.dedup();
        let mut lines = Vec::new();
        for manager in managers {
            lines.push(format!("conflicts with {manager}:"));
            for (_, path) in conflicts.iter().filter(|(m, _)| m == manager) {
                lines.push(format!("- {}", print_path(path)));
            }
        }
        format!(
            "Apply failed with {} conflicts: {}",
            conflicts.len(),
            lines.join("\n")
        )
    };
    let mut err = ApiError::apply_conflict(message);
    for (manager, path) in conflicts {
        err = err.with_cause(
            "FieldManagerConflict",
            format!("conflict with {manager}"),
            &print_path(path),
        );
    }
    err
}

/// The 400 of an applied configuration that does not fit the schema.
fn typed_patch_error(kind: Kind, why: &str) -> ApiError {
    let group_version = kind.api_version();
    let group_version = if group_version.contains('/') {
        group_version.to_owned()
    } else {
        format!("/{group_version}")
    };
    ApiError::bad_request(format!(
        "failed to create typed patch object ({group_version}, Kind={}): {why}",
        kind.kind()
    ))
}

/// Server-side apply of `config` by `writer` to `live` (`None`: the object does not exist yet),
/// both in the stored form: SMD's `Updater.Apply` under kube's field manager.
pub fn apply(
    kind: Kind,
    live: Option<&Value>,
    config: &Value,
    writer: Writer<'_>,
    force: bool,
) -> Result<Applied, ApiError> {
    if config
        .pointer("/metadata/managedFields")
        .is_some_and(|m| !m.is_null())
    {
        return Err(ApiError::bad_request("metadata.managedFields must be nil"));
    }
    let schema = root(kind);
    let zero = zero_object(kind);
    let live_value = live.map_or_else(|| zero.clone(), without_managed_fields);
    let mut entries = match live {
        Some(live) => decode_entries(live.pointer("/metadata/managedFields")).unwrap_or_default(),
        None => Vec::new(),
    };
    if live.is_some() && entries.is_empty() {
        // kube's skipNonApplied manager: what the object held goes to `before-first-apply`.
        entries = update_entries(
            kind,
            entries,
            &zero,
            &live_value,
            Writer {
                manager: BEFORE_FIRST_APPLY,
                ..writer
            },
        );
    }
    // SMD's typed conversion of the applied configuration refuses a field the schema does not
    // declare, whatever `fieldValidation` says ("Apply Patch requests already require strict
    // schemas and will error on unknown fields", kubernetes/kubernetes#105916).
    if let Some(path) = undeclared(schema, config, &mut Vec::new()) {
        return Err(typed_patch_error(
            kind,
            &format!("{}: field not declared in schema", print_path(&path)),
        ));
    }
    let mut config_set = FieldSet::new();
    to_field_set(schema, config, &mut Vec::new(), &mut config_set)
        .map_err(|why| typed_patch_error(kind, &why))?;
    owned_only(kind, writer.status(), &mut config_set);
    let mut merged =
        merge(schema, &live_value, config).map_err(|why| typed_patch_error(kind, &why))?;

    let subresource = writer.subresource();
    let (last, last_time, last_version) = match entries
        .iter()
        .position(|e| e.same_manager(writer.manager, true, subresource))
    {
        Some(i) => {
            let entry = entries.remove(i);
            (entry.set, entry.time, entry.api_version)
        }
        None => (FieldSet::new(), None, String::new()),
    };
    let version = kind.api_version();
    let last = in_version(kind, &last, &last_version, version);
    if !last.is_empty() {
        // prune: what this manager applied before, left out now, and nobody else owns.
        let mut owned: FieldSet = config_set.clone();
        for entry in &entries {
            owned.extend(in_version(kind, &entry.set, &entry.api_version, version));
        }
        let owned = ensure_named_fields(schema, &owned);
        let gone: FieldSet = ensure_named_fields(schema, &last)
            .difference(&owned)
            .cloned()
            .collect();
        remove_items(schema, &mut merged, &mut Vec::new(), &gone);
    }

    let cmp = compare_objects(kind, writer.status(), &live_value, &merged);
    let changed: FieldSet = cmp.added.union(&cmp.modified).cloned().collect();
    // kube's `lastAppliedManager`: kubectl's server-side apply may take over, without
    // `force`, the fields a client-side apply set (those whose live value is still the one in
    // `last-applied-configuration`).
    let allowed = (writer.manager == KUBECTL && !force)
        .then(|| last_applied_fields(kind, &live_value))
        .flatten()
        .unwrap_or_default();
    let mut conflicts = Vec::new();
    for entry in &entries {
        // In the manager's own version, as SMD reports it.
        let changed = in_version(kind, &changed, version, &entry.api_version);
        let allowed = in_version(kind, &allowed, version, &entry.api_version);
        for path in entry.set.intersection(&changed) {
            if !allowed.contains(path) {
                conflicts.push((entry.printed(), path.clone()));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(conflict_error(&conflicts));
    }
    for entry in &mut entries {
        let changed = in_version(kind, &changed, version, &entry.api_version);
        let removed = in_version(kind, &cmp.removed, version, &entry.api_version);
        entry
            .set
            .retain(|p| !changed.contains(p) && !removed.contains(p));
    }
    // An apply that changes nothing keeps its time (kube's field manager updates the time only
    // when the object changed), so that it writes nothing.
    let time = match last_time {
        Some(time) if merged == live_value => time,
        _ => writer.now.clone(),
    };
    entries.push(Entry {
        manager: writer.manager.to_owned(),
        apply: true,
        api_version: kind.api_version().to_owned(),
        time: Some(time),
        subresource: subresource.to_owned(),
        set: config_set,
    });
    if writer.manager == KUBECTL {
        update_last_applied(&mut merged, config);
    }
    Ok(Applied {
        object: merged,
        managed_fields: encode_entries(entries),
    })
}

/// The field manager of `kubectl apply --server-side` (kube's `lastAppliedManager` and
/// `lastAppliedUpdater` act for it alone; another `--field-manager` opts out).
const KUBECTL: &str = "kubectl";

/// The annotation a client-side `kubectl apply` keeps its configuration in.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// The most bytes an object's annotations may take (`totalAnnotationSizeLimitB`).
const ANNOTATIONS_LIMIT: usize = 256 * 1024;

/// kube's `allowedConflictsFromLastApplied`: the fields of the live object's
/// `last-applied-configuration` (of the same `apiVersion`) whose live value is the one it
/// records (not modified, added or removed since); `None` without a usable annotation.
fn last_applied_fields(kind: Kind, live: &Value) -> Option<FieldSet> {
    let text = live
        .pointer("/metadata/annotations")?
        .get(LAST_APPLIED)?
        .as_str()
        .filter(|t| !t.is_empty())?;
    let last: Value = serde_json::from_str(text).ok()?;
    if last.get("apiVersion").and_then(Value::as_str) != Some(kind.api_version()) {
        return None;
    }
    // kube's typed conversion of the annotation fails on a field the schema does not declare.
    if undeclared(root(kind), &last, &mut Vec::new()).is_some() {
        return None;
    }
    let mut set = FieldSet::new();
    to_field_set(root(kind), &last, &mut Vec::new(), &mut set).ok()?;
    let mut cmp = Comparison::default();
    compare(
        root(kind),
        Some(&last),
        Some(&without_managed_fields(live)),
        &mut Vec::new(),
        &mut cmp,
    );
    set.retain(|p| !cmp.modified.contains(p) && !cmp.added.contains(p) && !cmp.removed.contains(p));
    Some(set)
}

/// kube's `lastAppliedUpdater`: after kubectl's server-side apply, an object that carries
/// `last-applied-configuration` gets the applied configuration there (without the annotation
/// itself, encoded as Go's JSON encoder writes it), or loses it when that would take the
/// annotations over their size limit.
fn update_last_applied(object: &mut Value, config: &Value) {
    let Some(annotations) = object
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    else {
        return;
    };
    if annotations
        .get(LAST_APPLIED)
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        return;
    }
    let mut config = config.clone();
    if let Some(own) = config
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        own.remove(LAST_APPLIED);
        if own.is_empty()
            && let Some(meta) = config.get_mut("metadata").and_then(Value::as_object_mut)
        {
            meta.remove("annotations");
        }
    }
    annotations.insert(LAST_APPLIED.into(), Value::String(go_json(&config)));
    let size: usize = annotations
        .iter()
        .map(|(k, v)| k.len() + v.as_str().map_or(0, str::len))
        .sum();
    if size > ANNOTATIONS_LIMIT {
        annotations.remove(LAST_APPLIED);
    }
}

/// `value` as Go's `json.Encoder` writes an unstructured object: keys sorted, `<`, `>`, `&`,
/// U+2028 and U+2029 escaped, a newline at the end.
fn go_json(value: &Value) -> String {
    fn sorted(value: &Value) -> Value {
        match value {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                Value::Object(
                    keys.into_iter()
                        .map(|k| (k.clone(), sorted(&map[k])))
                        .collect(),
                )
            }
            Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    let mut out = String::new();
    // Those characters appear in the encoding only inside strings.
    for c in sorted(value).to_string().chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_applied_annotation_is_written_as_gos_json_encoder_writes_it() {
        let config = json!({"metadata": {"name": "a<b", "annotations": {LAST_APPLIED: "old", "z": "&"}},
            "apiVersion": "v1", "kind": "Service"});
        let mut object = json!({"metadata": {"annotations": {LAST_APPLIED: "old"}}});
        update_last_applied(&mut object, &config);
        assert_eq!(
            object["metadata"]["annotations"][LAST_APPLIED],
            "{\"apiVersion\":\"v1\",\"kind\":\"Service\",\"metadata\":{\"annotations\":{\"z\":\"\\u0026\"},\"name\":\"a\\u003cb\"}}\n"
        );
        // Only an object that carries the annotation gets it.
        let mut bare = json!({"metadata": {"annotations": {"x": "y"}}});
        update_last_applied(&mut bare, &config);
        assert_eq!(bare, json!({"metadata": {"annotations": {"x": "y"}}}));
        // Over the annotations' size limit it goes.
        let big = json!({"apiVersion": "v1", "data": "x".repeat(ANNOTATIONS_LIMIT)});
        update_last_applied(&mut object, &big);
        assert!(
            object["metadata"]["annotations"]
                .get(LAST_APPLIED)
                .is_none()
        );
    }

    fn now() -> Value {
        json!("2026-01-01T00:00:00Z")
    }

    fn writer<'a>(manager: &'a str, now: &'a Value) -> Writer<'a> {
        Writer {
            manager,
            subresource: "",
            now,
        }
    }

    fn service(ports: Value) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
            "spec": {"type": "NodePort", "selector": {"app": "web"}, "ports": ports},
        })
    }

    #[test]
    fn fields_v1_is_written_in_kubes_format() {
        let now = now();
        let svc = service(json!([{"port": 80, "protocol": "TCP", "targetPort": 8080}]));
        let managed = on_update(Kind::Service, None, &svc, writer("kubectl-create", &now)).unwrap();
        assert_eq!(
            managed,
            json!([{
                "manager": "kubectl-create", "operation": "Update", "apiVersion": "v1",
                "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
                "fieldsV1": {
                    "f:metadata": {"f:labels": {".": {}, "f:app": {}}},
                    "f:spec": {
                        "f:ports": {".": {}, "k:{\"port\":80,\"protocol\":\"TCP\"}": {
                            ".": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {},
                        }},
                        "f:selector": {},
                        "f:type": {},
                    },
                },
            }])
        );
        let set = decode_set(&managed[0]["fieldsV1"]).unwrap();
        assert_eq!(encode_set(&set), managed[0]["fieldsV1"]);
    }

    #[test]
    fn a_port_applied_without_protocol_is_keyed_by_the_schemas_default_tcp() {
        let mut set = FieldSet::new();
        to_field_set(
            root(Kind::Service),
            &service(json!([{"port": 80}])),
            &mut Vec::new(),
            &mut set,
        )
        .unwrap();
        assert!(set.contains(&vec![
            "f:spec".to_owned(),
            "f:ports".to_owned(),
            "k:{\"port\":80,\"protocol\":\"TCP\"}".to_owned(),
        ]));
    }

    #[test]
    fn changing_a_field_another_manager_updated_is_kubes_conflict_and_force_takes_it() {
        let now = now();
        let created = service(json!([{"port": 80, "protocol": "TCP", "nodePort": 30080}]));
        let managed = on_update(
            Kind::Service,
            None,
            &created,
            writer("kubectl-client-side-apply", &now),
        )
        .unwrap();
        let mut live = created.clone();
        live["metadata"]["managedFields"] = managed;
        let config = service(json!([{"port": 80, "nodePort": 30081}]));
        let err = apply(
            Kind::Service,
            Some(&live),
            &config,
            writer("kubectl", &now),
            false,
        )
        .unwrap_err();
        assert_eq!(err.code(), 409);
        assert_eq!(
            err.message(),
            "Apply failed with 1 conflict: conflict with \"kubectl-client-side-apply\" using v1: .spec.ports[port=80,protocol=\"TCP\"].nodePort"
        );
        let applied = apply(
            Kind::Service,
            Some(&live),
            &config,
            writer("kubectl", &now),
            true,
        )
        .unwrap();
        assert_eq!(applied.object["spec"]["ports"][0]["nodePort"], 30081);
        let entries = decode_entries(Some(&applied.managed_fields)).unwrap();
        let path: Path = [
            "f:spec",
            "f:ports",
            "k:{\"port\":80,\"protocol\":\"TCP\"}",
            "f:nodePort",
        ]
        .map(str::to_owned)
        .to_vec();
        let owners: Vec<&str> = entries
            .iter()
            .filter(|e| e.set.contains(&path))
            .map(|e| e.manager.as_str())
            .collect();
        assert_eq!(owners, ["kubectl"]);
    }

    #[test]
    fn applying_the_same_value_shares_ownership_without_conflict() {
        let now = now();
        let created = service(json!([{"port": 80, "protocol": "TCP"}]));
        let mut live = created.clone();
        live["metadata"]["managedFields"] = on_update(
            Kind::Service,
            None,
            &created,
            writer("kubectl-create", &now),
        )
        .unwrap();
        let applied = apply(
            Kind::Service,
            Some(&live),
            &created,
            writer("kubectl", &now),
            false,
        )
        .unwrap();
        let entries = decode_entries(Some(&applied.managed_fields)).unwrap();
        assert_eq!(entries.len(), 2);
        assert!(entries.iter().all(|e| {
            e.set
                .contains(&vec!["f:spec".to_owned(), "f:type".to_owned()])
        }));
    }

    #[test]
    fn a_field_dropped_from_the_applied_configuration_is_removed_unless_another_manager_owns_it() {
        let now = now();
        let first = service(json!([
            {"port": 80, "protocol": "TCP"},
            {"port": 443, "protocol": "TCP"},
        ]));
        let applied = apply(Kind::Service, None, &first, writer("a", &now), false).unwrap();
        let mut live = applied.object;
        live["metadata"]["managedFields"] = applied.managed_fields;
        // Manager b applies the label too; a drops the label and the 443 port.
        let b = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web", "labels": {"app": "web"}}});
        let applied = apply(Kind::Service, Some(&live), &b, writer("b", &now), false).unwrap();
        let mut live = applied.object;
        live["metadata"]["managedFields"] = applied.managed_fields;
        let mut second = service(json!([{"port": 80, "protocol": "TCP"}]));
        second["metadata"].as_object_mut().unwrap().remove("labels");
        let applied = apply(
            Kind::Service,
            Some(&live),
            &second,
            writer("a", &now),
            false,
        )
        .unwrap();
        assert_eq!(applied.object["metadata"]["labels"], json!({"app": "web"}));
        assert_eq!(
            applied.object["spec"]["ports"],
            json!([{"port": 80, "protocol": "TCP"}])
        );
    }

    #[test]
    fn the_first_apply_to_an_untracked_object_gives_its_fields_to_before_first_apply() {
        let now = now();
        let live = service(json!([{"port": 80, "protocol": "TCP"}]));
        let mut config = live.clone();
        config["spec"]["type"] = json!("ClusterIP");
        let err = apply(
            Kind::Service,
            Some(&live),
            &config,
            writer("kubectl", &now),
            false,
        )
        .unwrap_err();
        assert!(
            err.message()
                .contains("conflict with \"before-first-apply\" using v1: .spec.type"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn an_update_takes_changed_fields_from_other_managers_and_removed_fields_leave_all() {
        let now = now();
        let created = service(json!([{"port": 80, "protocol": "TCP"}]));
        let mut live = created.clone();
        live["metadata"]["managedFields"] =
            on_update(Kind::Service, None, &created, writer("a", &now)).unwrap();
        let mut edited = live.clone();
        edited["spec"]["type"] = json!("ClusterIP");
        edited["metadata"].as_object_mut().unwrap().remove("labels");
        let managed = on_update(Kind::Service, Some(&live), &edited, writer("b", &now)).unwrap();
        let entries = decode_entries(Some(&managed)).unwrap();
        let a = entries.iter().find(|e| e.manager == "a").unwrap();
        let b = entries.iter().find(|e| e.manager == "b").unwrap();
        let type_path = vec!["f:spec".to_owned(), "f:type".to_owned()];
        assert!(!a.set.contains(&type_path) && b.set.contains(&type_path));
        assert!(!a.set.iter().any(|p| p.iter().any(|pe| pe == "f:labels")));
    }

    #[test]
    fn an_apply_that_changes_nothing_keeps_its_time_and_a_change_moves_it() {
        let (t1, t2) = (now(), json!("2026-01-01T00:00:09Z"));
        let config = service(json!([{"port": 80, "protocol": "TCP"}]));
        let first = apply(Kind::Service, None, &config, writer("a", &t1), false).unwrap();
        let mut live = first.object;
        live["metadata"]["managedFields"] = first.managed_fields.clone();
        let again = apply(Kind::Service, Some(&live), &config, writer("a", &t2), false).unwrap();
        assert_eq!(again.managed_fields, first.managed_fields);
        let mut changed = config.clone();
        changed["spec"]["type"] = json!("ClusterIP");
        let moved = apply(
            Kind::Service,
            Some(&live),
            &changed,
            writer("a", &t2),
            false,
        )
        .unwrap();
        assert_eq!(moved.managed_fields[0]["time"], t2);
    }

    #[test]
    fn beyond_ten_update_managers_the_oldest_are_folded_into_ancient_changes() {
        let mut live = service(json!([{"port": 80, "protocol": "TCP"}]));
        let mut times = Vec::new();
        for i in 0..12 {
            times.push(json!(format!("2026-01-01T00:00:{i:02}Z")));
        }
        for i in 0..12 {
            let mut next = live.clone();
            next["metadata"]["labels"][format!("l{i}")] = json!("x");
            let managed = on_update(
                Kind::Service,
                (i > 0).then_some(&live),
                &next,
                writer(&format!("m{i:02}"), &times[i]),
            )
            .unwrap();
            next["metadata"]["managedFields"] = managed;
            live = next;
        }
        let entries = decode_entries(live.pointer("/metadata/managedFields")).unwrap();
        assert_eq!(entries.len(), 10);
        let ancient = entries
            .iter()
            .find(|e| e.manager == ANCIENT_CHANGES)
            .expect("an ancient-changes entry");
        // m00, m01 and m02 were merged, with m02's time.
        assert_eq!(ancient.time, Some(times[2].clone()));
        for label in ["l0", "l1", "l2"] {
            assert!(
                ancient
                    .set
                    .iter()
                    .any(|p| p.last().is_some_and(|pe| *pe == format!("f:{label}")))
            );
        }
        assert!(
            !entries
                .iter()
                .any(|e| ["m00", "m01", "m02"].contains(&e.manager.as_str()))
        );
    }

    #[test]
    fn user_agents_name_managers_as_kube_does() {
        assert_eq!(
            manager_name(None, "kubectl/v1.31.0 (linux/amd64)"),
            "kubectl"
        );
        assert_eq!(
            manager_name(None, "OpenAPI-Generator/31.0.0/python"),
            "OpenAPI-Generator"
        );
        assert_eq!(manager_name(Some("flux"), "kubectl/v1"), "flux");
        assert_eq!(manager_name(None, &"x".repeat(300)).len(), 128);
    }
}
