"""The disk tier below the KV pool: blocks the prefix cache evicts are kept in files, and a
later prompt with the same prefix loads them back instead of computing them."""
