"""The cost model: bytes and step time per method on a cluster."""
