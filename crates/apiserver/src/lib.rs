//! Kubernetes-compatible API server with NodePort and ClusterIP allocation.

pub mod error;
pub mod registry;
pub mod resource;
pub mod storage;
pub mod store;

/// Formats an error with its chain of causes, for logs.
pub fn report(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
