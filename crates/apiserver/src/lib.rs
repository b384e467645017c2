//! Kubernetes-compatible API server with NodePort and ClusterIP allocation (work in progress).
