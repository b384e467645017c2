//! PATCH formats: JSON patch, JSON merge patch and strategic merge patch.
//!
//! Strategic merge patch follows `k8s.io/apimachinery/pkg/util/strategicpatch` for the served
//! kinds, with their merge keys (the `patchMergeKey`/`patchStrategy` tags of `k8s.io/api`) and the
//! directives kubectl sends: `$patch: replace|merge|delete`, `$retainKeys`,
//! `$setElementOrder/<list>`, `$deleteFromPrimitiveList/<list>`, and `null` to delete a key.
//!
//! One deliberate difference: Service `spec.ports` merge by `port` **and** `protocol` (the
//! `listMapKeys` of the type), not by `port` alone as the struct tag says. With `port` alone,
//! adding `80/UDP` next to `80/TCP` with `kubectl apply` merges the two entries into one
//! (kubernetes#91590, #47249). An entry of the patch without `protocol` matches the `TCP` entry of
//! that port, or the only entry of that port, so patches computed by kubectl from the `port` tag
//! keep working.

use serde_json::{Map, Value};

use super::PatchType;
use crate::error::ApiError;
use crate::resource::Kind;

/// How a list field merges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListStrategy {
    /// The patch's list replaces the original (no `patchStrategy`, or `listType=atomic`).
    Replace,
    /// A set of scalars: the patch's values are added (`patchStrategy:"merge"` on `[]string`).
    MergePrimitive,
    /// A map keyed by these fields (`patchMergeKey`).
    MergeByKeys(&'static [&'static str]),
}

fn list_strategy(kind: Kind, path: &str) -> ListStrategy {
    use ListStrategy::*;
    match (kind, path) {
        (_, "metadata.finalizers") => MergePrimitive,
        (_, "metadata.ownerReferences") => MergeByKeys(&["uid"]),
        (Kind::Service, "spec.ports") => MergeByKeys(&["port", "protocol"]),
        (Kind::Service | Kind::Namespace | Kind::Node, "status.conditions") => {
            MergeByKeys(&["type"])
        }
        (Kind::Node, "status.addresses") => MergeByKeys(&["type"]),
        (Kind::Node, "spec.podCIDRs") => MergePrimitive,
        _ => Replace,
    }
}

fn unprocessable(message: impl Into<String>) -> ApiError {
    ApiError::unprocessable(message)
}

/// Applies `patch` of `patch_type` to `original`.
pub fn apply(
    kind: Kind,
    patch_type: PatchType,
    original: &Value,
    patch: &Value,
) -> Result<Value, ApiError> {
    let mut doc = original.clone();
    match patch_type {
        PatchType::Json => {
            let ops: json_patch::Patch = serde_json::from_value(patch.clone())
                .map_err(|e| ApiError::bad_request(format!("invalid JSON patch: {e}")))?;
            json_patch::patch(&mut doc, &ops).map_err(|e| unprocessable(e.to_string()))?;
        }
        PatchType::Merge => {
            if !patch.is_object() {
                return Err(ApiError::bad_request(
                    "a JSON merge patch must be a JSON object",
                ));
            }
            json_patch::merge(&mut doc, patch);
        }
        PatchType::StrategicMerge => {
            let Value::Object(patch) = patch else {
                return Err(ApiError::bad_request(
                    "a strategic merge patch must be a JSON object",
                ));
            };
            let Value::Object(map) = &mut doc else {
                return Err(ApiError::internal("stored object is not a JSON object"));
            };
            merge_map(kind, "", map, patch)?;
        }
    }
    Ok(doc)
}

fn child_path(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// Removes directive keys from a patch value that is inserted as a whole.
fn strip_directives(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(
            items
                .iter()
                .filter(|v| !is_directive_element(v))
                .map(strip_directives)
                .collect(),
        ),
        other => other.clone(),
    }
}

fn is_directive_element(v: &Value) -> bool {
    v.as_object()
        .is_some_and(|m| m.len() == 1 && m.contains_key("$patch"))
}

fn merge_map(
    kind: Kind,
    path: &str,
    original: &mut Map<String, Value>,
    patch: &Map<String, Value>,
) -> Result<(), ApiError> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            if let Value::Object(m) = strip_directives(&Value::Object(patch.clone())) {
                *original = m;
            }
            return Ok(());
        }
        Some("delete") => {
            original.clear();
            return Ok(());
        }
        Some("merge") | None => {}
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "Unknown patch type: {other} in map: {path}"
            )));
        }
    }
    let mut orders = Vec::new();
    for (key, value) in patch {
        if let Some(field) = key.strip_prefix("$setElementOrder/") {
            orders.push((field.to_owned(), value.clone()));
            continue;
        }
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Value::Array(remove)) =
                (original.get_mut(field), value)
            {
                list.retain(|v| !remove.contains(v));
            }
            continue;
        }
        if key.starts_with('$') {
            continue;
        }
        let child = child_path(path, key);
        if value.is_null() {
            original.remove(key);
            continue;
        }
        match (original.get_mut(key), value) {
            (Some(Value::Object(orig)), Value::Object(p)) => {
                if p.get("$patch").and_then(Value::as_str) == Some("delete") {
                    original.remove(key);
                } else {
                    merge_map(kind, &child, orig, p)?;
                }
            }
            (Some(Value::Array(orig)), Value::Array(p)) => {
                let merged = merge_list(kind, &child, orig, p)?;
                *orig = merged;
            }
            (_, Value::Object(p)) if p.get("$patch").and_then(Value::as_str) == Some("delete") => {
                original.remove(key);
            }
            (_, v) => {
                original.insert(key.clone(), strip_directives(v));
            }
        }
    }
    if let Some(Value::Array(keys)) = patch.get("$retainKeys") {
        let keep: Vec<&str> = keys.iter().filter_map(Value::as_str).collect();
        original.retain(|k, _| keep.contains(&k.as_str()));
    }
    for (field, order) in orders {
        if let (Some(Value::Array(list)), Value::Array(order)) = (original.get_mut(&field), order) {
            reorder(list, &order);
        }
    }
    Ok(())
}

/// The value of a key field, with the API default for `protocol`.
fn key_value<'a>(element: &'a Value, key: &str) -> Option<&'a Value> {
    element.get(key)
}

fn element_matches(kind_keys: &[&str], original: &Value, patch: &Value) -> bool {
    kind_keys
        .iter()
        .all(|k| match (key_value(original, k), key_value(patch, k)) {
            (a, b) if a == b => true,
            (None, Some(Value::String(p))) | (Some(Value::String(p)), None) if *k == "protocol" => {
                p == "TCP"
            }
            _ => false,
        })
}

/// Finds the element of `list` a patch element refers to. Keys missing from the patch element are
/// resolved as described in the module docs.
fn find_match(keys: &[&str], list: &[Value], patch: &Value) -> Option<usize> {
    if let Some(i) = list.iter().position(|o| element_matches(keys, o, patch)) {
        return Some(i);
    }
    // Keys the patch leaves out: match on the keys it gives, if that picks one element.
    let given: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| patch.get(*k).is_some())
        .collect();
    if given.is_empty() || given.len() == keys.len() {
        return None;
    }
    let candidates: Vec<usize> = list
        .iter()
        .enumerate()
        .filter(|(_, o)| given.iter().all(|k| o.get(*k) == patch.get(*k)))
        .map(|(i, _)| i)
        .collect();
    (candidates.len() == 1).then(|| candidates[0])
}

fn merge_list(
    kind: Kind,
    path: &str,
    original: &[Value],
    patch: &[Value],
) -> Result<Vec<Value>, ApiError> {
    let replace = patch.iter().any(|v| {
        v.get("$patch").and_then(Value::as_str) == Some("replace") && is_directive_element(v)
    });
    match list_strategy(kind, path) {
        _ if replace => Ok(patch
            .iter()
            .filter(|v| !is_directive_element(v))
            .map(strip_directives)
            .collect()),
        ListStrategy::Replace => Ok(patch.iter().map(strip_directives).collect()),
        ListStrategy::MergePrimitive => {
            let mut merged = original.to_vec();
            for v in patch {
                if !merged.contains(v) {
                    merged.push(v.clone());
                }
            }
            Ok(merged)
        }
        ListStrategy::MergeByKeys(keys) => {
            let mut merged = original.to_vec();
            for p in patch {
                let Value::Object(pmap) = p else {
                    return Err(ApiError::bad_request(format!(
                        "unable to merge {path}: list items must be objects"
                    )));
                };
                let directive = pmap.get("$patch").and_then(Value::as_str);
                let found = find_match(keys, &merged, p);
                match (directive, found) {
                    (Some("delete"), Some(i)) => {
                        merged.remove(i);
                    }
                    (Some("delete"), None) => {}
                    (_, Some(i)) => {
                        if let Value::Object(orig) = &mut merged[i] {
                            merge_map(kind, path, orig, pmap)?;
                        }
                    }
                    (_, None) => merged.push(strip_directives(p)),
                }
            }
            Ok(merged)
        }
    }
}

/// `$setElementOrder`: elements named in `order` come first, in that order; the rest keep their
/// relative order after them. Each order entry takes the first element it matches.
fn reorder(list: &mut Vec<Value>, order: &[Value]) {
    let mut taken = vec![false; list.len()];
    let mut result = Vec::with_capacity(list.len());
    for entry in order {
        let Value::Object(keys) = entry else { continue };
        let found = list.iter().enumerate().find(|(i, v)| {
            !taken[*i]
                && keys.iter().all(|(k, want)| {
                    v.get(k) == Some(want)
                        || (k == "protocol" && v.get(k).is_none() && want == "TCP")
                })
        });
        if let Some((i, _)) = found {
            taken[i] = true;
            result.push(list[i].clone());
        }
    }
    for (i, v) in list.iter().enumerate() {
        if !taken[i] {
            result.push(v.clone());
        }
    }
    *list = result;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn smp(original: Value, patch: Value) -> Value {
        apply(Kind::Service, PatchType::StrategicMerge, &original, &patch).unwrap()
    }

    #[test]
    fn adding_udp_next_to_tcp_on_the_same_port_keeps_both() {
        // Test_ServiceSetPortWithPatch in test/integration/service/api_semantics.go.
        let out = smp(
            json!({"spec":{"ports":[{"port":80,"protocol":"TCP","nodePort":30080}]}}),
            json!({"spec":{"$setElementOrder/ports":[{"port":80},{"port":80}],
                           "ports":[{"port":80,"protocol":"UDP"}]}}),
        );
        assert_eq!(
            out["spec"]["ports"],
            json!([{"port":80,"protocol":"TCP","nodePort":30080},{"port":80,"protocol":"UDP"}])
        );
    }

    #[test]
    fn a_port_entry_without_protocol_merges_into_the_tcp_entry() {
        let out = smp(
            json!({"spec":{"ports":[{"port":80,"protocol":"UDP"},{"port":80,"protocol":"TCP","targetPort":80}]}}),
            json!({"spec":{"ports":[{"port":80,"targetPort":8080}]}}),
        );
        assert_eq!(out["spec"]["ports"][1]["targetPort"], json!(8080));
        assert_eq!(out["spec"]["ports"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn directives_delete_replace_retain_and_null() {
        let out = smp(
            json!({"metadata":{"labels":{"a":"1","b":"2"},"finalizers":["x","y"]},
                   "spec":{"ports":[{"port":80,"protocol":"TCP"},{"port":443,"protocol":"TCP"}],
                           "selector":{"app":"web","tier":"fe"},"type":"NodePort","externalTrafficPolicy":"Cluster"}}),
            json!({"metadata":{"labels":{"a":null},"$deleteFromPrimitiveList/finalizers":["x"]},
                   "spec":{"ports":[{"$patch":"delete","port":443}],
                           "selector":{"$patch":"replace","app":"api"},
                           "$retainKeys":["ports","selector","type"]}}),
        );
        assert_eq!(out["metadata"]["labels"], json!({"b":"2"}));
        assert_eq!(out["metadata"]["finalizers"], json!(["y"]));
        assert_eq!(out["spec"]["ports"], json!([{"port":80,"protocol":"TCP"}]));
        assert_eq!(out["spec"]["selector"], json!({"app":"api"}));
        assert!(out["spec"].get("externalTrafficPolicy").is_none());
    }

    #[test]
    fn lists_without_merge_strategy_are_replaced() {
        let out = smp(
            json!({"spec":{"externalIPs":["192.0.2.1","192.0.2.2"]}}),
            json!({"spec":{"externalIPs":["192.0.2.3"]}}),
        );
        assert_eq!(out["spec"]["externalIPs"], json!(["192.0.2.3"]));
    }

    #[test]
    fn json_patch_and_merge_patch_apply() {
        let original = json!({"metadata":{"labels":{"a":"1"}},"spec":{"type":"ClusterIP"}});
        let out = apply(
            Kind::Service,
            PatchType::Json,
            &original,
            &json!([{"op":"replace","path":"/spec/type","value":"NodePort"}]),
        )
        .unwrap();
        assert_eq!(out["spec"]["type"], "NodePort");
        let out = apply(
            Kind::Service,
            PatchType::Merge,
            &original,
            &json!({"metadata":{"labels":{"a":null,"b":"2"}}}),
        )
        .unwrap();
        assert_eq!(out["metadata"]["labels"], json!({"b":"2"}));
        let err = apply(
            Kind::Service,
            PatchType::Json,
            &original,
            &json!([{"op":"test","path":"/spec/type","value":"NodePort"}]),
        )
        .unwrap_err();
        assert_eq!(err.code(), 422);
    }
}
