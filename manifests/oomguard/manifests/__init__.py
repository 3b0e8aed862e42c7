"""The Kubernetes manifests `oomguard generate` writes under deploy/kubernetes (`kubernetes`)."""
