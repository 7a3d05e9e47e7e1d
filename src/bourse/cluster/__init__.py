"""Adapters that let several gateway replicas act as one exchange, over Redis."""
