"""Integrations with foreign frameworks (DeepSpeed), each imported lazily."""
