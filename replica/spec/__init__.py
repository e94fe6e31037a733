"""Speculative decoding: proposers (draft model, n-gram lookup) and verification rules."""
