"""The emulated network: namespaces joined by shaped links."""
