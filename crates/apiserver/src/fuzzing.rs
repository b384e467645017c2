//! Entry points for fuzzing: untrusted bytes through the whole HTTP API, as a client would send
//! them. The fuzz targets under `fuzz/` (cargo-fuzz, nightly) and the replay of their corpora
//! in `cargo test` (`tests/fuzz_corpus.rs`, stable) both call these, so a finding stays a
//! regression test without nightly.
//!
//! Each call must return normally whatever the bytes are. A panic, a hang, or a 5xx answer to
//! a client's bad input (an internal error where kube-apiserver answers 4xx) is a finding: the
//! harness panics on a 5xx so that the fuzzer reports it. Writes are dry runs (`dryRun=All`),
//! so every input meets the same stored state and the fuzzer's memory stays flat.

use axum::body::Body;
use http::{Method, Request};
use tower::ServiceExt;

use nodeport_alloc::{PortRange, ip, port};

use crate::resource::Kind;
use crate::{Config, router};

/// The kinds an input's first byte picks from (its low four bits). New kinds are appended,
/// never inserted, so that a saved input keeps meaning the same request.
const KINDS: &[Kind] = &[
    Kind::Namespace,
    Kind::Service,
    Kind::Endpoints,
    Kind::Node,
    Kind::EndpointSlice,
    Kind::ServiceCidr,
    Kind::Event,
    Kind::EventsV1,
    Kind::IpAddress,
    Kind::Role,
    Kind::ClusterRole,
    Kind::RoleBinding,
    Kind::ClusterRoleBinding,
];

/// The kind an input's first byte names.
fn kind(selector: u8) -> Kind {
    KINDS[usize::from(selector & 0x0f) % KINDS.len()]
}

/// Content types a request body may come in.
const BODY_TYPES: [&str; 3] = [
    "application/json",
    "application/yaml",
    "application/vnd.kubernetes.protobuf",
];

/// Patch content types.
const PATCH_TYPES: [&str; 3] = [
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
];

/// The content type of a server-side apply.
const APPLY_PATCH: &str = "application/apply-patch+yaml";

/// The Service every patch is applied to.
const WEB: &str = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","labels":{"app":"web"}},"spec":{"type":"NodePort","selector":{"app":"web"},"ports":[{"name":"http","port":80,"targetPort":8080}],"externalTrafficPolicy":"Local"}}"#;

/// An in-memory API server, built once per fuzzing process.
pub struct Api {
    runtime: tokio::runtime::Runtime,
    /// The routes, built once as a server builds them at start: building them again for
    /// each input took more than half of the harness's time (perf, docs/FUZZING.md). A clone
    /// per request shares the table.
    router: axum::Router,
}

impl Default for Api {
    fn default() -> Self {
        Self::new()
    }
}

impl Api {
    /// A server on the embedded store in memory, holding the NodePort Service `default/web`.
    pub fn new() -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let state = runtime
            .block_on(crate::in_memory(&Config::default()))
            .expect("an in-memory server");
        let api = Api {
            runtime,
            router: router(state),
        };
        let status = api.send(
            Method::POST,
            "/api/v1/namespaces/default/services".into(),
            "application/json",
            WEB.as_bytes().to_vec(),
        );
        assert_eq!(status, 201, "the Service to patch could not be created");
        api
    }

    /// A create or an update of any served kind. `data[0]` picks the kind (low four bits), the
    /// body's content type (bits 4 and 5: JSON, YAML, protobuf) and POST or PUT (top bit); the
    /// rest of `data` is the body. Returns the HTTP status.
    pub fn body(&self, data: &[u8]) -> u16 {
        let Some((&selector, body)) = data.split_first() else {
            return 0;
        };
        let kind = kind(selector);
        let content_type = BODY_TYPES[usize::from((selector >> 4) & 0x03) % BODY_TYPES.len()];
        let collection = collection(kind);
        let (method, path) = if selector & 0x80 == 0 {
            (Method::POST, format!("{collection}?dryRun=All"))
        } else {
            (Method::PUT, format!("{collection}/web?dryRun=All"))
        };
        self.checked(method, path, content_type, body.to_vec(), data)
    }

    /// A patch of `default/web`. `data[0]` picks the patch type (its top bit: of `/status`);
    /// with bit 6 set it is a server-side apply instead (YAML, `fieldManager=fuzz`; bit 5:
    /// `force=true`), which no earlier saved input sets. The rest is the patch.
    pub fn patch(&self, data: &[u8]) -> u16 {
        let Some((&selector, body)) = data.split_first() else {
            return 0;
        };
        let subresource = if selector & 0x80 == 0 { "" } else { "/status" };
        let (content_type, query) = if selector & 0x40 == 0 {
            (
                PATCH_TYPES[usize::from(selector) % PATCH_TYPES.len()],
                "dryRun=All",
            )
        } else if selector & 0x20 == 0 {
            (APPLY_PATCH, "dryRun=All&fieldManager=fuzz")
        } else {
            (APPLY_PATCH, "dryRun=All&fieldManager=fuzz&force=true")
        };
        self.checked(
            Method::PATCH,
            format!("/api/v1/namespaces/default/services/web{subresource}?{query}"),
            content_type,
            body.to_vec(),
            data,
        )
    }

    /// A list (or a get, when `data[0]`'s top bit is set) of any served kind (`data[0]`'s low
    /// four bits) with `data[1..]` as
    /// the query string: label and field selectors, `limit`, `continue`, `resourceVersion` and
    /// the rest. `watch` parameters are dropped: a watch on a quiet store only ends at its
    /// timeout, and it is fuzzed through the same query parsing.
    pub fn query(&self, data: &[u8]) -> u16 {
        let Some((&selector, query)) = data.split_first() else {
            return 0;
        };
        let kind = kind(selector);
        let query: String = String::from_utf8_lossy(query)
            .split('&')
            .filter(|pair| {
                let key = pair.split('=').next().unwrap_or("");
                !key.eq_ignore_ascii_case("watch")
            })
            .collect::<Vec<_>>()
            .join("&");
        let target = if selector & 0x80 == 0 {
            collection(kind)
        } else {
            format!("{}/web", collection(kind))
        };
        // Bytes a URI's query cannot hold are percent-encoded, as a client library would send
        // them: RFC 3986's query characters stay (a `%` too, so that inputs can carry their own
        // escapes, valid or not), everything else (`<`, `>`, `"`, `{`, space, `#`, non-ASCII, …)
        // is encoded. Every input is then a request the server answers.
        let query: String = query
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/?%".contains(&b) {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        self.checked(
            Method::GET,
            format!("{target}?{query}"),
            "",
            Vec::new(),
            data,
        )
    }

    fn checked(
        &self,
        method: Method,
        path: String,
        content_type: &str,
        body: Vec<u8>,
        input: &[u8],
    ) -> u16 {
        let status = self.send(method.clone(), path.clone(), content_type, body);
        assert!(
            status < 500,
            "{method} {path} ({content_type}) answered {status} for input {:?}",
            String::from_utf8_lossy(input)
        );
        status
    }

    fn send(&self, method: Method, path: String, content_type: &str, body: Vec<u8>) -> u16 {
        let mut request = Request::builder().method(method).uri(path);
        if !content_type.is_empty() {
            request = request.header(http::header::CONTENT_TYPE, content_type);
        }
        let Ok(request) = request.body(Body::from(body)) else {
            return 0; // not a request a client could send (an invalid URI)
        };
        self.runtime.block_on(async {
            let response = self
                .router
                .clone()
                .oneshot(request)
                .await
                .expect("the router is infallible");
            let status = response.status().as_u16();
            // Read the whole answer, as a client would: encoding errors show up here too.
            let _ = http_body_util::BodyExt::collect(response.into_body()).await;
            status
        })
    }
}

/// `--service-node-port-range` (first byte even) or `--service-cluster-ip-range` (odd) as
/// given on the command line; returns whether it parsed. What parses must also make an
/// allocator, print back as a value that parses to the same range, and hand out an address
/// or port inside it.
pub fn flags(data: &[u8]) -> bool {
    let Some((&selector, text)) = data.split_first() else {
        return false;
    };
    // A command-line argument is a string; clap refuses one that is not UTF-8.
    let Ok(text) = std::str::from_utf8(text) else {
        return false;
    };
    if selector & 1 == 0 {
        let Ok(range) = PortRange::parse(text) else {
            return false;
        };
        let printed = range.to_string();
        assert_eq!(
            PortRange::parse(&printed).ok(),
            Some(range),
            "{text:?} parsed as {printed}, which does not parse back"
        );
        let mut ports = port::Allocator::with_seed(range, 1);
        let port = ports.allocate_next().expect("a new range has a free port");
        assert!(range.contains(port), "{port} is outside {range}");
        true
    } else {
        let Ok((primary, secondary)) = crate::flags::cluster_ip_ranges(text) else {
            return false;
        };
        for net in std::iter::once(primary).chain(secondary) {
            let mut ips = ip::Allocator::with_seed(net, 1).expect("checked by the parser");
            if let Ok(address) = ips.allocate_next() {
                assert!(net.contains(&address), "{address} is outside {net}");
            }
        }
        true
    }
}

/// A `--token-auth-file`'s text; returns whether it parsed. Every token the file lists must
/// authenticate as its row's user, and nothing else than a listed token may authenticate.
pub fn token_file(data: &[u8]) -> bool {
    // The file is read as UTF-8 text (`Tokens::load`); other bytes are a read error.
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let Ok(tokens) = crate::auth::Tokens::parse(std::path::Path::new("tokens.csv"), text) else {
        return false;
    };
    for (token, user) in tokens.users() {
        assert_eq!(
            tokens.authenticate(token),
            Some(user),
            "listed token {token:?} does not authenticate as its user"
        );
    }
    for line in text.lines() {
        if tokens.users().all(|(token, _)| token != line) {
            assert!(
                tokens.authenticate(line).is_none(),
                "the unlisted token {line:?} authenticated"
            );
        }
    }
    true
}

/// A stored `RangeAllocation` document restored into an allocator, as the store does when it
/// loads the bitmaps (`data[0] % 5`: the default NodePort range, an IPv4 and an IPv6 ClusterIP
/// range, an allocator over the document's own range, or the ServiceCIDR document); returns
/// whether it was restored. A restored bitmap must encode, decode and restore again to the
/// same snapshot.
pub fn range_allocation(data: &[u8]) -> bool {
    let Some((&selector, document)) = data.split_first() else {
        return false;
    };
    if selector % 5 == 4 {
        let Ok(extra) = crate::cidr_ranges::ExtraRanges::decode(document) else {
            return false;
        };
        let again = crate::cidr_ranges::ExtraRanges::decode(&extra.encode())
            .expect("an encoded document decodes");
        assert_eq!(again, extra, "the ServiceCIDR document does not round-trip");
        return true;
    }
    let Ok(snapshot) = crate::store::decode_range(document) else {
        return false;
    };
    let restored = match selector % 5 {
        0 => {
            let mut ports = port::Allocator::new(PortRange::default());
            ports
                .restore(&snapshot.range, &snapshot.data)
                .map(|()| ports.snapshot())
                .ok()
        }
        1 | 2 => {
            let cidr = if selector % 5 == 1 {
                "10.96.0.0/16"
            } else {
                "fd00:10:96::/108"
            };
            let mut ips =
                ip::Allocator::new(cidr.parse().expect("a CIDR")).expect("a usable range");
            ips.restore(&snapshot.range, &snapshot.data)
                .map(|()| ips.snapshot())
                .ok()
        }
        _ => {
            // The document's own range: a port range, else a CIDR.
            match port::Allocator::from_snapshot(&snapshot) {
                Ok(ports) => Some(ports.snapshot()),
                Err(_) => ip::Allocator::from_snapshot(&snapshot)
                    .ok()
                    .map(|ips| ips.snapshot()),
            }
        }
    };
    let Some(restored) = restored else {
        return false;
    };
    let decoded = crate::store::decode_range(&crate::store::encode_range(&restored))
        .expect("an encoded snapshot decodes");
    assert_eq!(decoded, restored, "a restored snapshot does not round-trip");
    let again = match port::Allocator::from_snapshot(&decoded) {
        Ok(ports) => ports.snapshot(),
        Err(_) => ip::Allocator::from_snapshot(&decoded)
            .expect("a restored snapshot restores again")
            .snapshot(),
    };
    assert_eq!(again, restored, "a restored snapshot restores differently");
    true
}

/// The collection path of `kind` (in namespace `default` when namespaced).
fn collection(kind: Kind) -> String {
    let prefix = match kind.group() {
        "" => "/api/v1".to_owned(),
        group => format!("/apis/{group}/{}", kind.version()),
    };
    if kind.namespaced() {
        format!("{prefix}/namespaces/default/{}", kind.resource())
    } else {
        format!("{prefix}/{}", kind.resource())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_served_kind_can_be_fuzzed() {
        for kind in Kind::ALL {
            assert!(
                KINDS.contains(&kind),
                "{kind:?} is missing from fuzzing::KINDS"
            );
        }
    }
}
